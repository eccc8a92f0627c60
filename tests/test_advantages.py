"""Advantage estimators: hand cases, a float64 loop reference, and the failure-status rules."""
import dataclasses

import numpy as np
import pytest

from posttrain_jax.advantages import (ADVANTAGE_ESTIMATORS, AdvantageConfig, BaselineState,
                                      compute_advantages, grpo_advantages)
from posttrain_jax.types import Status, Trajectory

_counter = iter(range(10 ** 6))


def _traj(group, reward, status=Status.OK, task=None):
  i = next(_counter)
  return Trajectory(id=f"t{i}", task_id=task or f"task-{group}", token_ids=[1, 2, 3],
                    loss_mask=[0, 1, 1], behaviour_logprobs=[0.0, -0.5, -0.7],
                    policy_version=[-1, 0, 0], group_id=group, reward=reward, status=status)


def _hand_batch():
  return [
      _traj("g1", 1.0), _traj("g1", 0.0), _traj("g1", 0.0), _traj("g1", 1.0),
      _traj("g1", None, Status.INFRA_ERROR),          # ours: excluded everywhere
      _traj("g2", 1.0), _traj("g2", 1.0), _traj("g2", 1.0),                   # zero variance
      _traj("g3", 0.5),                                                        # group of one
      _traj("g4", 1.0), _traj("g4", 0.0, Status.TIMEOUT), _traj("g4", 0.0),   # timeout = failure
      _traj("g5", None, Status.INFRA_ERROR),          # a group of infra errors only: no group
  ]


@pytest.mark.parametrize("estimator, ddof, g1, g4", [
    # g1 = 1, 0, 0, 1: mean 0.5, population std 0.5 → ±1; sample std sqrt(1/3) → ±0.866025.
    # g4 = 1, 0, 0: mean 1/3, population std 0.471405 → 1.414214, −0.707107;
    #   sample std 0.577350 → 1.154701, −0.577350.
    ("grpo", 0, [1, -1, -1, 1], [1.414214, -0.707107, -0.707107]),
    ("grpo", 1, [0.866025, -0.866025, -0.866025, 0.866025], [1.154701, -0.577350, -0.577350]),
    ("drgrpo", 1, [0.5, -0.5, -0.5, 0.5], [2 / 3, -1 / 3, -1 / 3]),
    # RLOO: 1 − mean(0, 0, 1) = 2/3; 0 − mean(1, 0, 1) = −2/3 | 1 − 0 = 1; 0 − mean(1, 0) = −0.5.
    ("rloo", 1, [2 / 3, -2 / 3, -2 / 3, 2 / 3], [1.0, -0.5, -0.5]),
])
def test_group_estimators_hand(estimator, ddof, g1, g4):
  res = compute_advantages(_hand_batch(), AdvantageConfig(estimator=estimator, std_ddof=ddof))
  a = res.advantages
  np.testing.assert_allclose(a[0:4], g1, rtol=1e-5)
  assert np.isnan(a[4]) and not res.keep[4]                 # infra error: no advantage
  np.testing.assert_array_equal(a[5:9], 0.0)                # zero variance and group of one
  np.testing.assert_allclose(a[9:12], g4, rtol=1e-5)
  assert np.isnan(a[12]) and not res.keep[12]
  assert res.keep.sum() == 11
  s = res.stats
  assert s["infra_excluded"] == 2 and s["num_trajectories"] == 13
  assert s["num_groups"] == 4 and s["zero_var_groups"] == 2
  assert s["zero_var_group_frac"] == pytest.approx(0.5)
  assert res.group_sizes == {"g1": 4, "g2": 3, "g3": 1, "g4": 3}
  assert (s["group_size_min"], s["group_size_mean"], s["group_size_max"]) == (1, 2.75, 4)


def test_zero_variance_never_divides_by_eps():
  # Equal rewards whose float64 mean is not exactly 0.7 (R − mean ≈ 1e-16): dividing by
  # std + eps would give ±1e4 here.
  assert np.full(3, 0.7).sum() / 3 != 0.7
  res = compute_advantages([_traj("g", 0.7), _traj("g", 0.7), _traj("g", 0.7)],
                           AdvantageConfig(eps=1e-20))
  np.testing.assert_array_equal(res.advantages, 0.0)
  assert res.stats["zero_var_group_frac"] == 1.0
  # Nearly equal (but different) rewards: finite, bounded by eps.
  res = compute_advantages([_traj("h", 0.1), _traj("h", 0.1 + 1e-6)], AdvantageConfig())
  assert np.all(np.isfinite(res.advantages)) and np.all(np.abs(res.advantages) < 1.0)


def _ref_group(rewards, groups, estimator, ddof, eps=1e-6):
  """float64 loops over the groups (no vectorised code)."""
  out = []
  for i, (r, g) in enumerate(zip(rewards, groups)):
    members = [rewards[j] for j in range(len(rewards)) if groups[j] == g]
    if max(members) == min(members):
      out.append(0.0)
      continue
    mean = sum(members) / len(members)
    if estimator == "grpo":
      var = sum((x - mean) ** 2 for x in members) / (len(members) - ddof)
      out.append((r - mean) / (var ** 0.5 + eps))
    elif estimator == "drgrpo":
      out.append(r - mean)
    else:
      others = [rewards[j] for j in range(len(rewards)) if groups[j] == g and j != i]
      out.append(r - sum(others) / len(others))
  return np.array(out)


@pytest.mark.parametrize("estimator, ddof", [("grpo", 0), ("grpo", 1), ("drgrpo", 1),
                                             ("rloo", 1)])
def test_group_estimators_match_numpy_reference(estimator, ddof):
  rng = np.random.default_rng(7)
  groups = [f"g{g}" for g in rng.integers(0, 6, 40)]
  rewards = [float(x) for x in np.round(rng.normal(size=40), 1)]
  rewards[:3] = [0.3, 0.3, 0.3]
  groups[:3] = ["same"] * 3
  statuses = [Status.INFRA_ERROR if u < 0.15 else Status.OK for u in rng.uniform(size=40)]
  trajs = [_traj(g, None if s is Status.INFRA_ERROR else r, s)
           for g, r, s in zip(groups, rewards, statuses)]
  res = compute_advantages(trajs, AdvantageConfig(estimator=estimator, std_ddof=ddof))
  ok = [i for i, s in enumerate(statuses) if s is Status.OK]
  want = _ref_group([rewards[i] for i in ok], [groups[i] for i in ok], estimator, ddof)
  np.testing.assert_allclose(res.advantages[ok], want, rtol=1e-5, atol=1e-6)
  assert np.all(np.isnan(res.advantages[[i for i in range(40) if i not in ok]]))
  assert res.advantages[0] == 0.0 and np.count_nonzero(res.advantages[ok]) > 20


def test_infra_errors_do_not_move_the_baseline():
  base = [_traj("g", 1.0), _traj("g", 0.0), _traj("g", 0.0)]
  with_infra = base + [_traj("g", None, Status.INFRA_ERROR), _traj("g", 0.0, Status.INFRA_ERROR)]
  a = compute_advantages(base).advantages
  b = compute_advantages(with_infra).advantages
  np.testing.assert_array_equal(a, b[:3])
  # Scored as 0 instead (the bug the rule prevents), the baseline would move.
  fake_zero = base + [_traj("g", 0.0)]
  assert not np.allclose(compute_advantages(fake_zero).advantages[:3], a)


def test_array_function_ignores_invalid_members():
  adv, zero_var = grpo_advantages(np.array([1.0, 0.0, 5.0, 2.0]), np.array([0, 0, 0, 1]),
                                  np.array([True, True, False, True]), 2, std_ddof=0)
  np.testing.assert_allclose(np.asarray(adv), [1.0, -1.0, 0.0, 0.0], rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(zero_var), [False, True])


def test_running_baseline_hand():
  cfg = AdvantageConfig(estimator="running", baseline_rate=0.5)
  t = lambda task, r, status=Status.OK: dataclasses.replace(
      _traj(None, r, status), task_id=task, group_id=None)
  # Call 1: nothing seen yet → A = 0. State: a = 1, b = 0, global: 1 then 1 + 0.5·(0 − 1) = 0.5.
  res = compute_advantages([t("a", 1.0), t("b", 0.0), t("a", None, Status.INFRA_ERROR)], cfg)
  np.testing.assert_array_equal(res.advantages[:2], [0.0, 0.0])
  assert np.isnan(res.advantages[2])
  assert res.state == BaselineState({"a": 1.0, "b": 0.0}, 0.5)
  assert res.stats["unseen_tasks"] == 2
  # Call 2: a has baseline 1 → A = −1; c is new → global 0.5 → A = 0.5.
  # Then a = 1 + 0.5·(0 − 1) = 0.5, c = 1, global 0.5 → 0.25 → 0.625.
  res2 = compute_advantages([t("a", 0.0), t("c", 1.0)], cfg, res.state)
  np.testing.assert_allclose(res2.advantages, [-1.0, 0.5])
  assert res2.state == BaselineState({"a": 0.5, "b": 0.0, "c": 1.0}, 0.625)
  assert res.state == BaselineState({"a": 1.0, "b": 0.0}, 0.5)   # the old state is unchanged


def test_running_baseline_without_per_task_means_for_tasks_that_never_return():
  """Recorded sessions (per_task=False): each is new, so b = the global EMA, and no per-task
  mean is stored: the state stays one number however many sessions pass."""
  cfg = AdvantageConfig(estimator="running", baseline_rate=0.5)
  t = lambda task, r: dataclasses.replace(_traj(None, r), task_id=task, group_id=None)
  state = None
  for k in range(50):
    res = compute_advantages([t(f"s{k}", float(k % 2))], cfg, state, per_task=False)
    if state is not None:   # A = r − the global EMA before this call
      np.testing.assert_allclose(res.advantages, [float(k % 2) - state.global_mean], rtol=1e-6)
    state = res.state
  assert state.task_means == {} and 0.0 < state.global_mean < 1.0
  kept = compute_advantages([t("s0", 1.0), t("s0", 0.0)], cfg, None).state
  assert kept.task_means == {"s0": 0.5}   # a task bank's tasks keep theirs


def test_running_baseline_matches_loop_reference():
  rng = np.random.default_rng(8)
  cfg = AdvantageConfig(estimator="running", baseline_rate=0.2)
  state, means, glob = None, {}, None
  for _ in range(4):
    tasks = [f"k{k}" for k in rng.integers(0, 4, 6)]
    rewards = [float(x) for x in rng.uniform(size=6)]
    trajs = [dataclasses.replace(_traj(None, r), task_id=k, group_id=None)
             for k, r in zip(tasks, rewards)]
    res = compute_advantages(trajs, cfg, state)
    want = []
    for k, r in zip(tasks, rewards):
      want.append(r - (means[k] if k in means else (r if glob is None else glob)))
    for k, r in zip(tasks, rewards):
      means[k] = r if k not in means else (1 - 0.2) * means[k] + 0.2 * r
      glob = r if glob is None else (1 - 0.2) * glob + 0.2 * r
    np.testing.assert_allclose(res.advantages, want, rtol=1e-5, atol=1e-6)
    state = res.state
  assert state.global_mean == pytest.approx(glob)


def test_none_estimator_and_errors():
  trajs = [_traj(None, None), _traj(None, 1.0, Status.INFRA_ERROR)]
  res = compute_advantages(trajs, AdvantageConfig(estimator="none"))
  assert res.advantages[0] == 0.0 and np.isnan(res.advantages[1])
  assert list(res.keep) == [True, False]
  with pytest.raises(ValueError, match="group_id"):
    compute_advantages([_traj(None, 1.0)], AdvantageConfig(estimator="grpo"))
  with pytest.raises(ValueError, match="no reward"):
    compute_advantages([_traj("g", None, Status.TIMEOUT)], AdvantageConfig(estimator="rloo"))
  with pytest.raises(KeyError) as e:
    AdvantageConfig(estimator="ppo")
  for name in ADVANTAGE_ESTIMATORS.names():
    assert name in str(e.value)
  with pytest.raises(ValueError, match="std_ddof"):
    AdvantageConfig(std_ddof=2)


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "rloo"])
def test_order_invariance_and_empty_input(estimator):
  """Shuffling the trajectories shuffles the advantages the same way and nothing else."""
  rng = np.random.default_rng(9)
  groups, rewards = rng.integers(0, 4, 20), rng.integers(0, 3, 20)   # integers: exact sums
  trajs = [_traj(f"g{g}", float(r)) for g, r in zip(groups, rewards)]
  trajs += [_traj("g0", None, Status.INFRA_ERROR)]
  cfg = AdvantageConfig(estimator=estimator)
  res = compute_advantages(trajs, cfg)
  perm = rng.permutation(len(trajs))
  res_p = compute_advantages([trajs[i] for i in perm], cfg)
  np.testing.assert_array_equal(res_p.advantages, res.advantages[perm])
  assert res_p.stats == res.stats and res_p.group_sizes == res.group_sizes
  empty = compute_advantages([], cfg)
  assert empty.advantages.shape == (0,) and empty.stats["num_groups"] == 0
  assert empty.stats["zero_var_group_frac"] == 0.0


def test_an_episode_split_into_samples_counts_once():
  """A multi-turn episode whose template broke the prefix has two samples: the group statistics
  see the episode once and both samples get its advantage."""
  def traj(tid, r, k=0, ep=None):
    return Trajectory(id=tid, task_id="t", token_ids=[1, 2], loss_mask=[0, 1],
                      behaviour_logprobs=[0.0, -1.0], policy_version=[-1, 0], group_id="g",
                      reward=r, metrics={"sample_index": k, "episode_id": ep or tid})
  split = [traj("a.0", 1.0, 0, "a"), traj("a.1", 1.0, 1, "a"), traj("b", 0.0), traj("c", 0.0)]
  whole = [traj("a", 1.0), traj("b", 0.0), traj("c", 0.0)]
  got = compute_advantages(split, AdvantageConfig(estimator="grpo"))
  want = compute_advantages(whole, AdvantageConfig(estimator="grpo"))
  np.testing.assert_allclose(got.advantages, [want.advantages[0], *want.advantages], rtol=1e-6)
  assert got.group_sizes == {"g": 3}
