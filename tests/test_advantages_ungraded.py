"""Ungraded trajectories (reward None, not an infra error), allowed for distillation losses:
A = 0 exactly, absent from every group statistic, counted; refused otherwise."""
import numpy as np
import pytest

from posttrain_jax.advantages import AdvantageConfig, compute_advantages
from posttrain_jax.types import Status, Trajectory

_ids = iter(range(10 ** 6))


def _traj(group, reward, status=Status.OK, **metrics):
  i = next(_ids)
  return Trajectory(id=f"t{i}", task_id=f"task-{group}", token_ids=[1, 2, 3], loss_mask=[0, 1, 1],
                    behaviour_logprobs=[0.0, -0.5, -0.7], policy_version=[-1, 0, 0],
                    group_id=group, reward=reward, status=status, metrics=metrics)


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "rloo"])
def test_group_statistics_are_those_of_the_graded_members(estimator):
  graded = [_traj("a", 1.0), _traj("a", 0.0), _traj("a", 0.0), _traj("b", 1.0), _traj("b", 1.0)]
  ungraded = [_traj("a", None), _traj("b", None), _traj("c", None), _traj("c", None)]
  infra = [_traj("a", None, Status.INFRA_ERROR)]
  cfg = AdvantageConfig(estimator=estimator)
  mixed = [graded[0], ungraded[0], graded[1], ungraded[2], graded[2], infra[0], graded[3],
           ungraded[1], graded[4], ungraded[3]]
  res = compute_advantages(mixed, cfg, allow_ungraded=True)
  alone = compute_advantages(graded, cfg)
  by_id = dict(zip([t.id for t in mixed], res.advantages))
  np.testing.assert_array_equal([by_id[t.id] for t in graded], alone.advantages)
  assert all(by_id[t.id] == 0.0 for t in ungraded)                       # exactly 0
  assert np.isnan(by_id[infra[0].id]) and res.keep.sum() == 9
  assert res.group_sizes == alone.group_sizes == {"a": 3, "b": 2}       # c: ungraded only
  for k in ("num_groups", "zero_var_groups", "zero_var_group_frac", "group_size_mean"):
    assert res.stats[k] == alone.stats[k], k
  assert res.stats["ungraded"] == 4 and res.stats["ungraded_frac"] == pytest.approx(4 / 10)
  with pytest.raises(ValueError, match="no reward"):
    compute_advantages(mixed, cfg)                       # not allowed: a loss without a teacher


def test_an_ungraded_episode_split_into_samples_counts_once_and_stays_zero():
  split = [_traj("g", None, sample_index=0, episode_id="e"),
           _traj("g", None, sample_index=1, episode_id="e"), _traj("g", 1.0), _traj("g", 0.0)]
  res = compute_advantages(split, AdvantageConfig(estimator="drgrpo"), allow_ungraded=True)
  np.testing.assert_allclose(res.advantages, [0.0, 0.0, 0.5, -0.5])
  assert res.stats["ungraded"] == 1 and res.stats["ungraded_frac"] == pytest.approx(1 / 3)
  assert res.group_sizes == {"g": 2}


def test_no_ungraded_trajectory_reports_zero():
  res = compute_advantages([_traj("g", 1.0), _traj("g", 0.0)])
  assert res.stats["ungraded"] == 0 and res.stats["ungraded_frac"] == 0.0
  assert compute_advantages([]).stats["ungraded_frac"] == 0.0
