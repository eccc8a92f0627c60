"""Per-step signals of a batch of trajectories: how episodes ended and what every filter removed.

These are what `audit.py` reads for reward-hacking signatures, so each is logged every step:

    status/<s>_frac            fraction of episodes ending timeout / truncated / infra_error
    status/timeout_frac/<d>    the same for tasks labelled difficulty d (metadata["difficulty"])
    episode/turns              mean assistant turns per episode          (multi-turn only)
    episode/tool_calls         mean tool calls per episode
    episode/tool_call_rate     tool calls per turn (Σ calls ÷ Σ turns)
    episode/malformed_call_rate  malformed calls per turn (Σ malformed ÷ Σ turns)
    episode/tool_errors/<c>    mean tool errors of cause c per episode
    episode/stitch_breaks/<r>  mean prefix breaks of reason r per episode
    filter/<reason>_frac       fraction of the step's episodes a filter took out of the loss:
                               infra_error (excluded), truncated_mask (truncation="mask"),
                               zero_var_group (no signal in the group)

An episode split into several samples counts once (its first sample carries its metrics).
"""
from __future__ import annotations

import collections
from typing import Sequence

from posttrain_jax.types import Status, Trajectory

_STATUSES = (Status.TIMEOUT, Status.TRUNCATED, Status.INFRA_ERROR)


def episode_signals(trajs: Sequence[Trajectory]) -> dict[str, float]:
  """The signals above for one step's trajectories (episode-level means)."""
  eps = [t for t in trajs if t.metrics.get("sample_index", 0) == 0]
  if not eps:
    return {}
  n = len(eps)
  out = {f"status/{s.value}_frac": sum(t.status is s for t in eps) / n for s in _STATUSES}
  by_level: dict[str, list[bool]] = collections.defaultdict(list)
  for t in eps:
    if "difficulty" in t.metrics:
      by_level[str(t.metrics["difficulty"])].append(t.status is Status.TIMEOUT)
  out.update({f"status/timeout_frac/{d}": sum(v) / len(v) for d, v in by_level.items()})
  out["filter/infra_error_frac"] = out["status/infra_error_frac"]
  out["filter/truncated_mask_frac"] = sum(
      t.status is Status.TRUNCATED and t.num_sampled == 0 for t in eps) / n
  multi = [t for t in eps if "turns" in t.metrics]
  if multi:
    turns = sum(float(t.metrics["turns"]) for t in multi)
    calls = sum(float(t.metrics.get("tool_calls", 0)) for t in multi)
    malformed = sum(float(t.metrics.get("tool_errors/malformed", 0)) for t in multi)
    out.update({"episode/turns": turns / len(multi), "episode/tool_calls": calls / len(multi),
                "episode/tool_call_rate": calls / turns if turns else 0.0,
                "episode/malformed_call_rate": malformed / turns if turns else 0.0})
    for prefix in ("tool_errors/", "stitch_breaks/"):
      keys = {k for t in multi for k in t.metrics if k.startswith(prefix)}
      for k in sorted(keys):
        out[f"episode/{k}"] = sum(float(t.metrics.get(k, 0)) for t in multi) / len(multi)
  return out
