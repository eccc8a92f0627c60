"""The figures of benchmarks/time_to_accuracy.py: one run's summary, medians over seeds, the
speedup ratios and their lower bounds where TRL never reached the target."""
from __future__ import annotations

import math
import statistics


def _summary(who, seed, step_s, curve, hits, train_s, eval_s, completions=64,
             load1=math.nan, recipe=None) -> dict:
  steady = step_s[1:] if len(step_s) > 1 else step_s   # the first holds our compile
  s_per_step = statistics.median(steady) if steady else math.nan
  return {"who": who, "seed": seed, "steps": len(step_s), "s_per_step": s_per_step,
          "first_step_s": step_s[0] if step_s else math.nan, "load1": load1, "recipe": recipe,
          "completions_per_step": completions,
          "completions_per_s": completions / s_per_step if s_per_step else math.nan,
          "train_s": train_s, "eval_s": eval_s, "start_acc": curve[0][2] if curve else math.nan,
          "best_acc": max(c[2] for c in curve) if curve else math.nan,
          "s_to_target": {str(t): (h[1] if h else math.inf) for t, h in hits.items()},
          "steps_to_target": {str(t): (h[0] if h else None) for t, h in hits.items()},
          "curve": curve}


def _median(xs):
  xs = [x for x in xs if x == x]
  return statistics.median(xs) if xs else math.nan


def _fmt(x, nd=1):
  return "nan" if x != x else ("inf" if math.isinf(x) else f"{x:.{nd}f}")


def side_medians(runs, who, recipe, targets) -> dict:
  mine = [r for r in runs if r["who"] == who and r["recipe_name"] == recipe]
  return {"s_to_target": {str(t): _median([r["s_to_target"][str(t)] for r in mine])
                          for t in targets},
          "s_per_step": _median([r["s_per_step"] for r in mine]), "seeds": len(mine)}


def _ratio(trl_t, ours_t):
  return trl_t / ours_t if ours_t == ours_t and trl_t == trl_t and ours_t > 0 else math.nan


def _lower_ratio(trl_bound, ours_t):
  """TRL's lower bound over ours' seconds; nan where ours never reached the target either."""
  return _ratio(trl_bound, ours_t) if math.isfinite(ours_t) else math.nan


def trl_at_least(runs, recipe, top) -> float:
  """A lower bound on TRL's median seconds to `top` on `recipe`: a run that never reached it
  counts the seconds it trained (budget or steps ran out) instead of inf, so "TRL took more
  than X s" is a number beside speedup's inf."""
  mine = [r for r in runs if r["who"] == "trl" and r["recipe_name"] == recipe]
  return _median([r["s_to_target"][top] if math.isfinite(r["s_to_target"][top]) else r["train_s"]
                  for r in mine])
