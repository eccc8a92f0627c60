"""The rollout-source protocol: what the run loop asks of anything that supplies graded samples.

    source.update_weights(params, version)   the policy of `version` goes to the engine(s)
    tasks, trajs = source.collect(step)      the step's graded trajectories (and their tasks)
    source.after_step(step_result, learner)  the step's outcome (auto: its probe; else nothing)
    source.metrics()                         per-step counters since the last call
    source.state() / source.restore(state)   its part of the checkpoint (JSON)
    source.close()                           stop (async: in-flight work finishes or is saved)

and four read-only facts the run needs without asking which source it is:

    off_policy        a batch may hold samples of older policies (async, recorded traces): the
                      loss gets `rl.async_correction` when it was given none. It may change
                      during a run (auto turning async); the loop reads it every step.
    train_groups      train this many of the groups a step collected, those with a learning
                      signal first (rl.oversample); None = all of them
    repeats_tasks     a task comes back (task banks) or each is seen once (recorded sessions):
                      the running baseline keeps a per-task mean only for the former
    baseline_key      trajectory -> the key the running baseline keeps a mean for instead of its
                      task (per-tenant learning: the tenant, so one tenant's rewards never set
                      another's baseline); None = the task

`SourceBase` gives the defaults; the sources themselves live with what they read from
(actors/rollout.py, actors/pool.py, byoh/trace_source.py) and are registered by name in
posttrain_jax/run/sources/ (`rl.mode`).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Protocol


class RolloutSource(Protocol):
  off_policy: bool
  train_groups: Optional[int]
  repeats_tasks: bool
  baseline_key: Optional[Callable[[Any], str]]

  def update_weights(self, params, version: int) -> None: ...
  def collect(self, step: int) -> tuple[list, list]: ...
  def after_step(self, result: Any, learner: Any) -> None: ...
  def metrics(self) -> dict[str, float]: ...
  def state(self) -> dict: ...
  def restore(self, state: dict) -> None: ...
  def saved_note(self) -> str: ...
  def close(self) -> None: ...


class SourceBase:
  """Defaults of the optional parts of the protocol."""
  off_policy: bool = False
  train_groups: Optional[int] = None
  repeats_tasks: bool = True
  baseline_key: Optional[Callable[[Any], str]] = None

  def after_step(self, result: Any, learner: Any) -> None:
    """Sees each step's StepResult (rl_step.py) after the update; nothing by default."""
    del result, learner

  def saved_note(self) -> str:
    """What a preemption left in the checkpoint besides the weights (for the log line)."""
    return ""

  def close(self) -> None:
    pass


def check_kind(state: dict, kind: str) -> bool:
  """True when `state` is a checkpointed state of a source of `kind` (False for none); raises
  for another kind's, whose queued work would be lost."""
  if not state:
    return False
  if state.get("kind") != kind:
    raise ValueError(f"checkpointed rollout state is {state.get('kind')!r}, not {kind!r}: it was "
                     "written by another RLPhaseConfig.mode (its queued work would be lost); "
                     "resume with that mode")
  return True
