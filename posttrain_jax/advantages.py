"""Advantages from graded trajectories: group baselines (GRPO, Dr.GRPO, RLOO) and baselines for
single trajectories (a running per-task mean, or none).

For a group g (the G samples of one prompt / env seed) with rewards R_1..R_G:

    grpo     A_i = (R_i − mean_g R) / (std_g R + eps)      DeepSeekMath (Shao et al. 2024)
             std with `std_ddof` degrees of freedom: 1 by default (the sample std, what
             torch.std computes in TRL, verl and OpenRLHF); 0 gives the population std
    drgrpo   A_i = R_i − mean_g R                          Dr.GRPO (Liu et al. 2025), no std
    rloo     A_i = R_i − mean_{j≠i} R_j = G/(G−1)·(R_i − mean_g R)   RLOO (Ahmadian et al. 2024)

For single trajectories (BYOH; no group):

    running  A_i = R_i − b_task, b_task an EMA of the task's past rewards (rate `baseline_rate`),
             kept in an explicit `BaselineState` that the caller threads through (and checkpoints).
             Every trajectory of one call uses the state from before the call; a task not seen
             yet uses the EMA over all tasks; before any reward at all, A = 0. A source whose
             tasks never come back (recorded sessions: `per_task=False`) keeps only that global
             EMA: a per-task mean would never be read and would grow with every session.
    none     A_i = 0 (for losses whose signal is elsewhere, e.g. distillation)

Rules (ARCHITECTURE.md, REFERENCES.md "failure semantics"):
- A group whose rewards are all equal (a group of one included) has no signal: every member
  gets A = 0 exactly and the group is counted in `zero_var_group_frac`; we never divide by eps.
  eps only guards groups whose rewards differ.
- `infra_error` trajectories are *ours* to fix: they are left out of every statistic (group
  means, stds, sizes, running baselines) and get no advantage: `keep` is False and the
  advantage is NaN, so a batch builder that forgot to drop them fails loudly.
- `timeout` and `truncated` trajectories are ordinary members with the grader's reward (0 for
  a timeout): dropping them would reward running out the clock on hard problems.
- An *ungraded* trajectory (reward None, not an infra error: a recorded session with free-text
  feedback but no grade) raises unless the caller allows it (`allow_ungraded`, for losses that
  learn from the feedback: distillation). Allowed, it is kept and trained, but it has no reward
  signal: A = 0 exactly, it is left out of every statistic (group means, stds, sizes, zero-
  variance counts, the running baseline, which it never updates), and it is counted
  (`ungraded`, `ungraded_frac` of the episodes). So a mixed loss (distillation + rl_coef·Â)
  gives it only its distillation term.
Simplifications: rewards are scalars per trajectory (a per-token advantage is the batch
builder's broadcast); no whitening across groups; no reward clipping.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Optional, Sequence

import numpy as np

from posttrain_jax.registry import Registry
from posttrain_jax.types import Status, Trajectory


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
  """How rewards become advantages."""
  estimator: str = "grpo"               # grpo | drgrpo | rloo | running | none (the registry)
  std_ddof: int = 1                     # grpo's std: 1 = sample std (TRL, verl), 0 = population
  eps: float = 1e-6                     # grpo: added to std (only groups with unequal rewards)
  baseline_rate: float = 0.1            # running: EMA rate, b ← b + rate·(R − b)

  def __post_init__(self):
    ADVANTAGE_ESTIMATORS.get(self.estimator)
    if self.std_ddof not in (0, 1):
      raise ValueError(f"AdvantageConfig.std_ddof must be 0 or 1, got {self.std_ddof}")
    if self.eps < 0:
      raise ValueError(f"AdvantageConfig.eps must be ≥ 0, got {self.eps}")
    if not 0.0 < self.baseline_rate <= 1.0:
      raise ValueError(f"AdvantageConfig.baseline_rate must be in (0, 1], got {self.baseline_rate}")


# ------------------------------------------------------------------ array level (NumPy, float64)
# Host-side on purpose: advantages are computed once per batch by the batch builder, on shapes
# that change every step (no compile), in float64 (then cast to float32).

def group_stats(rewards_n, group_idx_n, valid_n, num_groups: int):
  """(size_g, mean_g, zero_var_g) over valid members; zero_var_g is True for groups whose
  members all have exactly the same reward (groups of one included); empty groups are False."""
  valid_n = np.asarray(valid_n, bool)
  idx = np.asarray(group_idx_n, np.int64)
  r = np.where(valid_n, np.asarray(rewards_n, np.float64), 0.0)
  size_g = np.bincount(idx, weights=valid_n.astype(np.float64), minlength=num_groups)
  mean_g = np.bincount(idx, weights=r, minlength=num_groups) / np.maximum(size_g, 1.0)
  hi_g, lo_g = np.full(num_groups, -np.inf), np.full(num_groups, np.inf)
  np.maximum.at(hi_g, idx[valid_n], r[valid_n])
  np.minimum.at(lo_g, idx[valid_n], r[valid_n])
  zero_var_g = (size_g > 0) & (hi_g == lo_g)
  return size_g, mean_g, zero_var_g


def _std_scaled(dev_n, idx, valid_n, size_g, num_groups, std_ddof, eps):
  """GRPO: (R − mean) / (std + eps), std with `std_ddof` degrees of freedom."""
  var_g = np.bincount(idx, weights=np.where(valid_n, dev_n ** 2, 0.0), minlength=num_groups)
  std_g = np.sqrt(var_g / np.maximum(size_g - std_ddof, 1.0))
  return dev_n / (std_g[idx] + eps)


def _centered(dev_n, idx, valid_n, size_g, num_groups, std_ddof, eps):
  """Dr.GRPO: R − mean."""
  return dev_n


def _leave_one_out(dev_n, idx, valid_n, size_g, num_groups, std_ddof, eps):
  """RLOO: G/(G−1)·(R − mean); a group with unequal rewards has at least 2 members."""
  size_n = size_g[idx]
  return dev_n * size_n / np.maximum(size_n - 1.0, 1.0)


def _group_advantages(name: str, scale):
  def fn(rewards_n, group_idx_n, valid_n, num_groups: int, *, std_ddof: int = 1,
         eps: float = 1e-6) -> tuple[np.ndarray, np.ndarray]:
    valid_n = np.asarray(valid_n, bool)
    idx = np.asarray(group_idx_n, np.int64)
    r = np.where(valid_n, np.asarray(rewards_n, np.float64), 0.0)
    size_g, mean_g, zero_var_g = group_stats(r, idx, valid_n, num_groups)
    dev_n = r - mean_g[idx]
    signal_n = valid_n & ~zero_var_g[idx]
    adv_n = scale(dev_n, idx, valid_n, size_g, num_groups, std_ddof, eps)
    return np.where(signal_n, adv_n, 0.0).astype(np.float32), zero_var_g
  fn.__name__ = f"{name}_advantages"
  fn.__doc__ = (f"{name} advantages over groups given as indices in [0, num_groups): returns "
                "(adv_n float32, zero_var_g); invalid members and zero-variance groups get 0.")
  return fn


grpo_advantages = _group_advantages("grpo", _std_scaled)
drgrpo_advantages = _group_advantages("drgrpo", _centered)
rloo_advantages = _group_advantages("rloo", _leave_one_out)


# ------------------------------------------------------------------ single trajectories

@dataclasses.dataclass(frozen=True)
class BaselineState:
  """The running per-task baseline; never mutated (each update returns a new state)."""
  task_means: Mapping[str, float] = dataclasses.field(default_factory=dict)  # EMA per task_id
  global_mean: Optional[float] = None   # EMA over every reward seen; None before the first


def running_baseline_advantages(rewards: Sequence[float], task_ids: Sequence[str],
                                state: BaselineState, rate: float, per_task: bool = True
                                ) -> tuple[np.ndarray, BaselineState, int]:
  """(A_n, new state, number of tasks not seen before); see the module docstring.
  `per_task=False`: every task is new, b = the global EMA, and no per-task mean is kept."""
  adv = np.zeros(len(rewards), np.float32)
  unseen = set()
  for i, (r, task) in enumerate(zip(rewards, task_ids)):
    if task in state.task_means:
      baseline = state.task_means[task]
    else:
      unseen.add(task)
      baseline = r if state.global_mean is None else state.global_mean
    adv[i] = r - baseline
  means, global_mean = dict(state.task_means), state.global_mean
  for r, task in zip(rewards, task_ids):
    if per_task:
      means[task] = r if task not in means else means[task] + rate * (r - means[task])
    global_mean = r if global_mean is None else global_mean + rate * (r - global_mean)
  return adv, BaselineState(means, global_mean), len(unseen)


# ------------------------------------------------------------------ registry

@dataclasses.dataclass(frozen=True)
class EstimatorSpec:
  name: str
  kind: str                             # "group" | "running" | "none"
  group_fn: Optional[Callable] = None   # for kind "group": one of the *_advantages above


ADVANTAGE_ESTIMATORS: Registry[EstimatorSpec] = Registry("advantage estimator")
for _name, _fn in (("grpo", grpo_advantages), ("drgrpo", drgrpo_advantages),
                   ("rloo", rloo_advantages)):
  ADVANTAGE_ESTIMATORS.register(_name)(EstimatorSpec(_name, "group", _fn))
ADVANTAGE_ESTIMATORS.register("running")(EstimatorSpec("running", "running"))
ADVANTAGE_ESTIMATORS.register("none")(EstimatorSpec("none", "none"))


# ------------------------------------------------------------------ trajectories

@dataclasses.dataclass(frozen=True)
class AdvantageResult:
  """Per-trajectory advantages, in the order given."""
  advantages: np.ndarray                # float32 [N]; NaN where keep is False
  keep: np.ndarray                      # bool [N]; False (infra_error): the batch builder drops it
  stats: dict[str, float]               # see compute_advantages
  group_sizes: dict[str, int]           # group_id -> members counted (infra errors excluded)
  state: Optional[BaselineState] = None  # the running baseline after this call ("running" only)


def compute_advantages(trajectories: Sequence[Trajectory], cfg: AdvantageConfig = AdvantageConfig(),
                       state: Optional[BaselineState] = None, *,
                       allow_ungraded: bool = False, per_task: bool = True,
                       baseline_key: Optional[Callable[[Trajectory], str]] = None
                       ) -> AdvantageResult:
  """Advantages for a list of trajectories (groups identified by `group_id`).

  `allow_ungraded`: a trajectory with reward None that is not an infra error gets A = 0 and
  stays out of every statistic (module docstring) instead of raising. `per_task`: the running
  baseline keeps a mean per task (False where tasks never come back: recorded sessions);
  `baseline_key`: the running baseline keeps a mean per `baseline_key(trajectory)` instead (a
  tenant), whatever `per_task` says.

  stats: num_trajectories, infra_excluded, infra_error_frac, ungraded (episodes without a
  reward, infra errors apart), ungraded_frac (of the episodes), num_groups (groups with at least
  one counted member), zero_var_groups, zero_var_group_frac (of num_groups; 0 when there are
  none), group_size_min / _mean / _max, and for "running" unseen_tasks.
  """
  spec = ADVANTAGE_ESTIMATORS.get(cfg.estimator)
  n = len(trajectories)
  keep = np.array([t.status is not Status.INFRA_ERROR for t in trajectories], bool)
  every_kept = [t for t, k in zip(trajectories, keep) if k]
  # an episode split into several samples (a template broke the token prefix) counts once:
  # statistics over its first sample, its other samples share that sample's advantage
  heads = np.array([t.metrics.get("sample_index", 0) == 0 for t in every_kept], bool)
  kept = [t for t, h in zip(every_kept, heads) if h]
  ungraded = [t for t in kept if t.reward is None]
  if ungraded and spec.kind != "none" and not allow_ungraded:
    t = ungraded[0]
    raise ValueError(f"trajectory {t.id!r} (status {t.status.value}) has no reward; "
                     f"estimator {cfg.estimator!r} needs one (grade it or mark it infra_error)")
  graded = [t for t in kept if t.reward is not None]
  excluded = n - len(every_kept)
  episodes = sum(t.metrics.get("sample_index", 0) == 0 for t in trajectories)
  stats: dict[str, float] = {"num_trajectories": float(n), "infra_excluded": float(excluded),
                             "infra_error_frac": excluded / n if n else 0.0,
                             "ungraded": float(len(ungraded)),
                             "ungraded_frac": len(ungraded) / episodes if episodes else 0.0}
  advantages = np.full(n, np.nan, np.float32)
  group_sizes: dict[str, int] = {}
  new_state = None
  is_graded = np.array([t.reward is not None for t in kept], bool)

  if spec.kind == "group":
    missing = [t.id for t in kept if t.group_id is None]
    if missing:
      raise ValueError(f"estimator {cfg.estimator!r} needs group_id on every trajectory; "
                       f"{missing[:5]} have none (use 'running' or 'none' for single trajectories)")
    group_names = sorted({t.group_id for t in graded})
    index = {g: i for i, g in enumerate(group_names)}
    adv_heads = np.zeros(len(kept), np.float32)           # ungraded heads keep A = 0
    if graded:
      rewards = np.array([t.reward for t in graded], np.float64)
      idx = np.array([index[t.group_id] for t in graded], np.int32)
      adv, zero_var_g = spec.group_fn(rewards, idx, np.ones(len(graded), bool), len(group_names),
                                      std_ddof=cfg.std_ddof, eps=cfg.eps)
      adv_heads[is_graded] = adv
      sizes = np.bincount(idx, minlength=len(group_names))
    else:
      zero_var_g, sizes = np.zeros(0, bool), np.zeros(0, int)
    advantages[keep] = _spread(every_kept, heads, adv_heads)
    group_sizes = {g: int(s) for g, s in zip(group_names, sizes)}
    stats.update(num_groups=float(len(group_names)), zero_var_groups=float(zero_var_g.sum()),
                 zero_var_group_frac=float(zero_var_g.mean()) if len(group_names) else 0.0,
                 group_size_min=float(sizes.min()) if len(sizes) else 0.0,
                 group_size_mean=float(sizes.mean()) if len(sizes) else 0.0,
                 group_size_max=float(sizes.max()) if len(sizes) else 0.0)
  elif spec.kind == "running":
    adv, new_state, unseen = running_baseline_advantages(
        [t.reward for t in graded],
        [baseline_key(t) if baseline_key else t.task_id for t in graded],
        state or BaselineState(), cfg.baseline_rate, per_task or baseline_key is not None)
    adv_heads = np.zeros(len(kept), np.float32)           # ungraded heads keep A = 0
    adv_heads[is_graded] = adv
    advantages[keep] = _spread(every_kept, heads, adv_heads)
    stats["unseen_tasks"] = float(unseen)
  else:
    advantages[keep] = 0.0
  return AdvantageResult(advantages, keep, stats, group_sizes, new_state)


def _spread(every_kept: Sequence[Trajectory], heads: np.ndarray, adv_heads) -> np.ndarray:
  """Advantages for every kept trajectory from those of the episodes' first samples."""
  if heads.all():
    return np.asarray(adv_heads, np.float32)
  by_episode = {_episode(t): a for t, a in zip([t for t, h in zip(every_kept, heads) if h],
                                               adv_heads)}
  return np.array([by_episode.get(_episode(t), 0.0) for t in every_kept], np.float32)


def _episode(t: Trajectory) -> str:
  return t.metrics.get("episode_id", t.id)
