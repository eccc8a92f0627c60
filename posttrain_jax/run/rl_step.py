"""One RL step, the same for the trainer and the benchmarks:

    source.update_weights(params, version)        weights of version v to the rollout engine
    tasks, trajs = source.collect(step)           graded groups (sync: fresh; async: from the queue)
    adv = advantages(trajs, baseline state)       infra errors excluded; running baseline updated;
                                                  with `train_groups` (rl.oversample: more
                                                  groups drawn than trained) the groups with a
                                                  learning signal are trained first (below)
                                                  with a distillation loss an ungraded sample
                                                  (reward None: feedback, no grade) is trained
                                                  with A = 0, out of the baselines, counted
                                                  (filter/ungraded_frac: out of the RL term)
    batch = pack(kept trajectories, adv)          then fit_shape: unused rows / positions cut
                                                  to a bucket (batch_cfg.trim; exact,
                                                  batching.py), one shape on every process,
                                                  or a compiled shape that holds it (`shapes`)
    batch, extra = inputs.fill(...)              exactly the fields the loss declares it needs
                                                  (run/inputs.py: old / reference / teacher)
    update_epochs × learner.step(batch)           skipped when no trajectory survived
    inputs.after_update(learner)                  an EMA teacher follows the new weights

Signal first (DAPO's dynamic sampling, one generation round): with `train_groups` = k the
source drew more groups than a step trains (rl.oversample). The k trained are the groups with
a learning signal (a member with A ≠ 0: rewards not all equal) in draw order, then, if fewer
than k have one, groups without in draw order; the rest are left out of the batch and counted
(`filter/oversample_dropped_frac`, of the groups drawn; `batch/signal_group_frac`, of the
groups trained). Advantages are per group, so a group's do not depend on which others are
trained; `reward/mean` is over every graded sample drawn, not only the trained ones.

A step whose every rollout failed (nothing kept) does not touch the weights or the optimizer
state: AdamW's momentum would still move them on an empty batch.

Several processes: each collects and packs its own share of the step's prompts; the learner's
forwards and update are collectives over the global batch, so whether the step trains is
decided for the job (any process kept something: a process that kept nothing feeds an empty
part of the batch rather than skip a collective the others wait in).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional

import numpy as np

from posttrain_jax import batching
from posttrain_jax.advantages import AdvantageConfig, BaselineState, compute_advantages
from posttrain_jax.multihost import max_over_processes
from posttrain_jax.run.inputs import KL_EVERY, BatchInputs
from posttrain_jax.step_metrics import episode_signals
from posttrain_jax.types import Status


@dataclasses.dataclass(frozen=True)
class StepResult:
  """What a step produced besides the learner's new state."""
  metrics: dict[str, float]
  baseline: Optional[BaselineState]   # the running baseline after the step (estimator "running")
  tasks: list                         # the tasks whose groups were used
  trajectories: list                  # every trajectory collected (infra errors included)
  updated: bool                       # False when nothing was trainable (weights untouched)
  batch: Any = None                   # the TrainBatch trained on (None when not updated)
  version: int = 0                    # the policy version the step's rollouts were asked of


def rl_step(learner, source, *, step: int, version: int, advantage: AdvantageConfig,
            batch_cfg: batching.BatchConfig, baseline: Optional[BaselineState] = None,
            inputs: Optional[BatchInputs] = None, shapes: Optional[batching.ShapeReuse] = None,
            train_groups: Optional[int] = None, per_task_baseline: bool = True,
            update_epochs: int = 1, reference: Any = None, teacher: Any = None,
            kl_every: int = KL_EVERY, baseline_key=None) -> StepResult:
  """Runs one step (see the module docstring). `inputs`: the run's batch-input providers
  (run/inputs.py); without it they are built from `reference` (frozen params for ref_logp),
  `teacher` (a teacher.SelfTeacher for the teacher fields), `update_epochs` and `kl_every`;
  `shapes`: the run's compiled trimmed shapes (batching.ShapeReuse), else each batch runs in
  its own bucket; `train_groups`: train this many of the groups collected, signal first (see
  the module docstring), else all; `per_task_baseline`: False where the source's tasks never
  come back (the running baseline keeps only its global mean); `baseline_key`: the source's
  (actors/source.py), the running baseline's key of a trajectory (None: its task)."""
  if inputs is None:
    inputs = BatchInputs(reference, teacher, update_epochs, kl_every)
  t0 = time.perf_counter()
  source.update_weights(learner.params, version=version)
  t_sync = time.perf_counter() - t0
  tasks, trajs = source.collect(step)
  t_gen = time.perf_counter() - t0
  adv = compute_advantages(trajs, advantage, baseline,
                           allow_ungraded=inputs.wants_ungraded(learner),
                           per_task=per_task_baseline, baseline_key=baseline_key)
  scored = [t for t, k in zip(trajs, adv.keep) if k and t.reward is not None]
  trained, select_metrics = (signal_first(trajs, adv, train_groups) if train_groups is not None
                             else (adv.keep, {}))
  keep = [t for t, k in zip(trajs, trained) if k]
  metrics: dict[str, float] = {}
  input_metrics: dict[str, float] = {}
  shape_metrics: dict[str, float] = {}
  t1 = time.perf_counter()
  train = max_over_processes([len(keep)])[0] > 0   # the job's decision (module docstring)
  if train:
    batch = batching.build_batch(keep, adv.advantages[trained].tolist(), batch_cfg)
    if batch_cfg.trim:   # a collective with several processes, like learner.step below
      agree = (max_over_processes if shapes is None
               else lambda own: shapes.choose(max_over_processes(own)))
      batch = batching.fit_shape(batch, learner.row_multiple, batch_cfg.seq_bucket, agree=agree)
      if shapes is not None:
        shape_metrics = shapes.metrics()
    batch, input_metrics, step_kwargs = inputs.fill(learner, batch, keep, tasks, version)
    for _ in range(inputs.update_epochs):
      metrics = learner.step(batch, **step_kwargs)
    inputs.after_update(learner)
  t_train = time.perf_counter() - t1
  reward = float(np.mean([t.reward for t in scored])) if scored else float("nan")
  metrics.update({
      "reward/mean": reward,
      "response_len/mean": float(np.mean([t.num_sampled for t in trajs])) if trajs else 0.0,
      "truncated_frac": float(np.mean([t.status is Status.TRUNCATED for t in trajs]))
      if trajs else 0.0,
      "infra_error_frac": adv.stats["infra_error_frac"],
      "zero_var_group_frac": adv.stats.get("zero_var_group_frac", 0.0),
      "skipped_update": float(not train),
      "time/update_weights_s": t_sync, "time/generate_s": t_gen, "time/train_s": t_train,
  })
  metrics.update(input_metrics)
  metrics.update(shape_metrics)
  metrics.update(select_metrics)
  metrics.update(episode_signals(trajs))
  metrics["filter/zero_var_group_frac"] = metrics["zero_var_group_frac"]
  metrics["filter/ungraded_frac"] = adv.stats["ungraded_frac"]
  if adv.state is not None:
    metrics["baseline/global_mean"] = (adv.state.global_mean if adv.state.global_mean is not None
                                       else float("nan"))
    metrics["baseline/tasks"] = float(len(adv.state.task_means))
    metrics["baseline/unseen_tasks"] = adv.stats["unseen_tasks"]
  metrics.update(source.metrics())
  return StepResult(metrics, adv.state if adv.state is not None else baseline, tasks, trajs,
                    train, batch if train else None, version)


def signal_first(trajs, adv, k: int) -> tuple[np.ndarray, dict[str, float]]:
  """(keep [N] bool, metrics): the trajectories of the `k` groups a step trains, groups with a
  learning signal first, each kind in draw order (the module docstring); infra errors stay out.
  A trajectory without a group_id is a group of its own."""
  if k < 1:
    raise ValueError(f"train_groups must be ≥ 1, got {k}")
  names = [t.group_id if t.group_id is not None else t.id for t in trajs]
  order = list(dict.fromkeys(n for n, kept in zip(names, adv.keep) if kept))
  signal = {n: False for n in order}
  for n, kept, a in zip(names, adv.keep, adv.advantages):
    if kept and a != 0:
      signal[n] = True
  chosen = set(([n for n in order if signal[n]] + [n for n in order if not signal[n]])[:k])
  keep = np.array([kept and n in chosen for n, kept in zip(names, adv.keep)], bool)
  return keep, {
      "filter/oversample_dropped_frac": (len(order) - len(chosen)) / len(order) if order else 0.0,
      "batch/signal_group_frac": (sum(signal[n] for n in chosen) / len(chosen)
                                  if chosen else 0.0)}
