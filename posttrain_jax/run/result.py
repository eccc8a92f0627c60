"""What a finished run reports: result.json and the one `RESULT ...` line launch/train.py prints."""
from __future__ import annotations

import numpy as np


def result(cfg, state, final_eval: dict, end_step: int, seconds: float) -> dict:
  """heldout_*: the sampled accuracy, or the greedy one in a greedy-only eval
  (eval.sampled=False); reward_first10 / _last10: the mean reward of the first and last ten RL
  steps; minutes: this process's wall time; stopped / steps: an early stop (run/stops.py);
  top_reply_after / constant_baseline: the final eval's share of replies that are its most
  common one, and what one answer to every held-out task scores (actors/rollout.py: a rise to
  constant_baseline with top_reply_after near 1 is a collapse onto a frequent answer, not the
  task learned; NaN where the episode type does not report them)."""
  r = [x for x in state.rewards if x == x]
  before, stopped, nan = state.heldout_before or {}, state.stopped, float("nan")
  key = "eval/accuracy" if cfg.eval.sampled else "eval/accuracy_greedy"
  return {
      "heldout_before": before.get(key, nan), "heldout_after": final_eval.get(key, nan),
      "heldout_greedy_before": before.get("eval/accuracy_greedy", nan),
      "heldout_greedy_after": final_eval.get("eval/accuracy_greedy", nan),
      "reward_first10": float(np.mean(r[:10])) if r else nan,
      "reward_last10": float(np.mean(r[-10:])) if r else nan,
      "minutes": seconds / 60, "train_s_total": state.train_s, "eval_s_total": state.eval_s,
      "stopped": stopped["reason"] if stopped else None, "steps": end_step,
      "top_reply_after": final_eval.get(f"{key}/top_reply_frac", nan),
      "constant_baseline": final_eval.get(f"{key}/constant_baseline", nan),
  }


def result_line(result: dict) -> str:
  """`RESULT heldout_before=… … minutes=…`, `top_reply_after=… constant_baseline=…` where the
  eval reports them, then `stopped=<target|budget> steps=<k>` for a run that ended early."""
  keys = ("heldout_before", "heldout_after", "reward_first10", "reward_last10", "minutes")
  line = "RESULT " + " ".join(f"{k}={result[k]:.4f}" if k != "minutes" else f"{k}={result[k]:.2f}"
                              for k in keys)
  line += "".join(f" {k}={result[k]:.4f}" for k in ("top_reply_after", "constant_baseline")
                  if result.get(k, float("nan")) == result.get(k))   # present and not NaN
  if result.get("stopped"):
    line += f" stopped={result['stopped']} steps={result['steps']}"
  return line
