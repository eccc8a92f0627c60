"""The run's own state: one frozen record, saved with every checkpoint and restored as a unit.

Beside the arrays (the TrainState and a teacher's EMA, checkpoint.py) a checkpoint holds what
the loop needs to continue exactly where it was:

    step            global step (SFT and RL steps counted through)
    tasks_state     the task iterator's position (base64 of its bytes)
    rollouts        the rollout source's own state (actors/source.py: its queue, its draws, ...)
    baseline        the running baseline (advantages.py), per-task means and the global mean
    shapes          the RL step's compiled trimmed shapes (batching.ShapeReuse)
    rewards         every RL step's mean reward (the RESULT line's first/last ten)
    heldout_before  the held-out eval at the start of RL
    train_s, eval_s seconds spent in training steps and in held-out evals (cumulative)
    stopped         {"reason", "step", ...} when the run ended early (a target, a budget)
    metrics_rows    rows in metrics.jsonl at this step (a resumed run cuts what came after)
    config          the RunConfig it was written with (a resume compares it)

Each process writes its own record (its task shard, its rollout state); the loop replaces the
record (`dataclasses.replace`) instead of mutating it.
"""
from __future__ import annotations

import base64
import dataclasses
from typing import Any, Optional

from posttrain_jax.advantages import BaselineState


@dataclasses.dataclass(frozen=True)
class RunState:
  step: int = 0
  tasks_state: str = ""
  rollouts: Optional[dict] = None
  baseline: BaselineState = BaselineState()
  shapes: Optional[dict] = None
  rewards: tuple[float, ...] = ()
  heldout_before: Optional[dict] = None
  train_s: float = 0.0
  eval_s: float = 0.0
  stopped: Optional[dict] = None
  metrics_rows: Optional[int] = None
  config: Optional[dict] = None

  @property
  def task_bytes(self) -> bytes:
    return base64.b64decode(self.tasks_state)

  def to_json(self) -> dict[str, Any]:
    return {"step": self.step, "tasks_state": self.tasks_state, "rollouts": self.rollouts,
            "baseline": {"task_means": dict(self.baseline.task_means),
                         "global_mean": self.baseline.global_mean},
            "shapes": self.shapes, "rewards": list(self.rewards),
            "heldout_before": self.heldout_before,
            "time_totals": {"train_s": self.train_s, "eval_s": self.eval_s},
            "stopped": self.stopped, "metrics_rows": self.metrics_rows, "config": self.config}

  @classmethod
  def from_json(cls, d: dict[str, Any]) -> "RunState":
    b = d.get("baseline") or {}
    totals = d.get("time_totals") or {}
    return cls(step=int(d["step"]), tasks_state=d["tasks_state"], rollouts=d.get("rollouts"),
               baseline=BaselineState(dict(b.get("task_means", {})), b.get("global_mean")),
               shapes=d.get("shapes"), rewards=tuple(d.get("rewards", ())),
               heldout_before=d.get("heldout_before"), train_s=totals.get("train_s", 0.0),
               eval_s=totals.get("eval_s", 0.0), stopped=d.get("stopped"),
               metrics_rows=d.get("metrics_rows"), config=d.get("config"))


def encode_task_state(raw: bytes) -> str:
  return base64.b64encode(raw).decode()
