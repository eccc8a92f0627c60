"""Early stops from the config: `eval.target_accuracy` ends RL at the first in-run eval whose
`eval.target_metric` reaches it (that eval is the final one); `train_budget_s` at the first
step boundary with `time/train_s_total` ≥ the budget (then the final eval runs). The `stopped`
record goes into the run state; resuming a stopped run finishes it again without training,
unless the current config no longer stops there (a higher target, a larger budget)."""
from __future__ import annotations

from typing import Optional


def stop_reason(cfg, step: int, evaluated: Optional[dict], train_s: float) -> Optional[dict]:
  """The `stopped` record when the run ends early at `step` (after its in-run eval, if any)."""
  ev, budget = cfg.eval, cfg.train_budget_s
  if evaluated is not None and ev.target_accuracy is not None:
    value = evaluated.get(f"eval/{ev.target_metric}")
    if value is not None and value >= ev.target_accuracy:
      return {"reason": "target", "step": step, "metric": ev.target_metric, "value": value,
              "target": ev.target_accuracy, "eval": evaluated}
  if budget is not None and train_s >= budget:
    return {"reason": "budget", "step": step, "train_s": train_s, "budget_s": budget}
  return None


def stop_note(s: dict, train_s: float) -> str:
  if s["reason"] == "target":
    return (f"stopped at step {s['step']}: held-out {s['metric']} {s['value']:.4f} reached "
            f"eval.target_accuracy={s['target']} after {train_s:.1f} s of training")
  return (f"stopped at step {s['step']}: {s['train_s']:.1f} s of training reached "
          f"train_budget_s={s['budget_s']}")


def still_stops(cfg, saved: dict, train_s: float) -> bool:
  """Whether a checkpointed stop holds under the current config."""
  ev, budget = cfg.eval, cfg.train_budget_s
  return (saved["reason"] == "target" and ev.target_accuracy is not None
          and saved["metric"] == ev.target_metric and saved["value"] >= ev.target_accuracy) or (
      saved["reason"] == "budget" and budget is not None and train_s >= budget)
