"""Batch inputs a loss declares beyond what rollouts carry, filled in one place.

A rollout's batch holds the sampled ids, the masks, the advantages and the behaviour log-probs.
A loss may also read (LossSpec.needs, losses/base.py):

    old_logp                            log π_old, the learner before this batch's first update
                                        (always available: a forward of the current weights)
    ref_logp                            log π_ref, the RL start weights (`reference` given)
    teacher_logp / _mask / _hidden      the distillation teacher's view (`teacher` given)

`BatchInputs.fill` computes exactly the fields the loss needs under its *current* config (a
correction added when a source turned off-policy may change them), plus `old_logp` when a
batch is trained for several epochs (the PPO ratio's fixed denominator), plus a report-only
`ref_logp` every `kl_every` versions when a reference is held only for the `kl` metric. A
needed field nobody can provide is one error naming it and the loss.

`required(loss_spec, loss_cfg)` is where a run asks which providers it must build (a reference
copy of the weights, a teacher): the same question, asked once, of the same declaration.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from posttrain_jax import teacher as teacher_lib

KL_EVERY = 10   # report-only KL: versions between two reference forwards
REFERENCE = frozenset({"ref_logp"})
TEACHER = teacher_lib.FIELDS


def required(spec, loss_cfg, *, report_kl: bool = False) -> dict[str, bool]:
  """Which providers a run with this loss must build: {"reference": ..., "teacher": ...}."""
  needs = spec.needs(loss_cfg)
  return {"reference": bool(needs & REFERENCE) or report_kl, "teacher": bool(needs & TEACHER)}


@dataclasses.dataclass
class BatchInputs:
  """The providers of one run. `reference`: the RL start weights (params) or None; `teacher`: a
  teacher.SelfTeacher or None; `update_epochs` > 1 adds old_logp; a reference held while the
  loss does not read it is scored every `kl_every` versions (0 = never), for the `kl` metric."""
  reference: Any = None
  teacher: Any = None
  update_epochs: int = 1
  kl_every: int = KL_EVERY

  def needs(self, learner, version: int) -> set[str]:
    """The fields to fill for a step at `version` under the learner's current loss config."""
    needs = set(learner.spec.needs(learner.loss_cfg))
    if self.update_epochs > 1:
      needs.add("old_logp")
    if self.reference is not None and self.kl_every > 0 and version % self.kl_every == 0:
      needs.add("ref_logp")
    available = {"old_logp", "behaviour_logp"}
    if self.reference is not None:
      available |= REFERENCE
    if self.teacher is not None:
      available |= TEACHER
    missing = needs - available
    if missing:
      raise ValueError(f"loss {learner.cfg.loss!r} needs {sorted(missing)}, which this run "
                       "cannot provide (ref_logp needs a reference; the teacher fields a "
                       "distillation teacher)")
    return needs

  def fill(self, learner, batch, keep, tasks, version: int
           ) -> tuple[Any, dict[str, float], dict[str, Any]]:
    """(the batch with its needed fields, metrics of filling it, extra learner.step arguments);
    `keep` are the trajectories the batch was built from, in order; `tasks` the step's tasks."""
    needs = self.needs(learner, version)
    metrics: dict[str, float] = {}
    if needs & TEACHER:
      batch, metrics = self.teacher.fill(learner, keep, batch, {t.id: t for t in tasks},
                                         needs=needs)
    if "ref_logp" in needs:
      batch = dataclasses.replace(batch, ref_logp=np.asarray(learner.logprobs(batch,
                                                                              self.reference)))
    if "old_logp" in needs:
      batch = dataclasses.replace(batch, old_logp=np.asarray(learner.logprobs(batch)))
    step_kwargs = self.teacher.step_inputs(learner) if self.teacher is not None else {}
    return batch, metrics, step_kwargs

  def after_update(self, learner) -> None:
    """An EMA teacher follows the new weights."""
    if self.teacher is not None:
      self.teacher.after_update(learner)

  def wants_ungraded(self, learner) -> bool:
    """A distillation loss learns from samples without a grade (their feedback)."""
    return bool(learner.spec.needs(learner.loss_cfg) & TEACHER)


__all__ = ["BatchInputs", "KL_EVERY", "required"]
