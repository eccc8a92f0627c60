"""rl.mode = "auto": overlap generation with training only where the measured bound says it pays.

An asynchronous step (actors/pool.py) samples step k+1 while step k trains. It pays for that
with one more learner forward per step (log π_old for the off-policy correction of the
one-step-stale samples, `rl.async_correction`) and, where the sampler and the learner share
devices (the embedded JAX sampler always does; an in-process vLLM on the same GPU too), with
their contention. So after `probe_steps` synchronous steps (the first, which compiles, is left
out) the trainer measures

    g  = generate seconds per step      t = train seconds per step   (medians over the probe:
                                                                   a step that compiled is out)
    f  = one learner forward of the last batch, alone
    g1 = one generation of the last step's prompts, alone
    b  = the wall time of that generation and k = round(g1 / f) forwards back to back run at
         once (two threads: they contend for the whole generation, as in an async step)

and the overlap the hardware gives, o = clip((g1 + k·f − b) / min(g1, k·f), 0, 1): 1 when the
two run on separate devices (a vLLM server), 0 when they take turns on the same cores. The
bound on an asynchronous step is

    async ≈ g + t + f − o · min(g, t + f)         (sync = g + t)

and the run turns asynchronous iff async ≤ (1 − min_gain) · sync. The choice, the figures and
the reason go to the log and the checkpoint (a resumed run keeps it; metrics.jsonl's
`rl/async` says which mode each step ran in).

The bound is optimistic: it leaves out the pool's threads (grading, weight copies) and the
contention beyond one generation. Measured on this 2-core CPU (the default run, the embedded
sampler): o 0.47, bound +3.5% (sync stays); a forced async run of the tiny case took 0.197
s/step against sync's 0.113 (benchmarks/step_breakdown.py). Hence min_gain = 15%.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class AutoModeConfig:
  """How rl.mode="auto" decides (see the module docstring)."""
  probe_steps: int = 5      # synchronous steps measured (after the first): their median
  min_gain: float = 0.15    # turn async only for a predicted step at least this much shorter

  def __post_init__(self):
    if self.probe_steps < 1:
      raise ValueError(f"AutoModeConfig.probe_steps must be ≥ 1, got {self.probe_steps}")
    if not 0.0 <= self.min_gain < 1.0:
      raise ValueError(f"AutoModeConfig.min_gain must be in [0, 1), got {self.min_gain}")


@dataclasses.dataclass(frozen=True)
class Probe:
  """The measured figures (seconds)."""
  generate_s: float        # g: per synchronous step (mean over the probe steps)
  train_s: float           # t: per synchronous step
  forward_s: float         # f: one learner forward, alone
  generate_alone_s: float  # g1: one generation, alone
  together_s: float        # b: that generation and `forward_reps` forwards at once
  forward_reps: int = 1    # k: forwards run back to back beside the generation


@dataclasses.dataclass(frozen=True)
class Decision:
  mode: str                # "sync" | "async"
  why: str
  overlap: float           # o
  sync_step_s: float
  async_step_s: float      # the bound

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


def decide(p: Probe, min_gain: float) -> Decision:
  """The mode the bound picks (pure: the module docstring's formulas)."""
  fwd = p.forward_reps * p.forward_s
  shorter = min(p.generate_alone_s, fwd)
  saved = p.generate_alone_s + fwd - p.together_s
  overlap = float(np.clip(saved / shorter, 0.0, 1.0)) if shorter > 0 else 0.0
  sync = p.generate_s + p.train_s
  extra = p.forward_s
  bound = sync + extra - overlap * min(p.generate_s, p.train_s + extra)
  gain = 1.0 - bound / sync if sync > 0 else 0.0
  mode = "async" if gain >= min_gain else "sync"
  why = (f"sync step {sync:.4f} s = generate {p.generate_s:.4f} + train {p.train_s:.4f}; "
         f"generation {p.generate_alone_s:.4f} s and {p.forward_reps} learner forward(s) of "
         f"{p.forward_s:.4f} s took {p.together_s:.4f} s at once (overlap {overlap:.2f}); "
         f"async bound {bound:.4f} s/step "
         f"= {100 * gain:+.1f}% vs sync, "
         f"{'≥' if gain >= min_gain else '<'} the {100 * min_gain:.0f}% rl.auto.min_gain")
  return Decision(mode, why, overlap, sync, bound)


def measure(generate: Callable[[], object], forward: Callable[[], object], *,
            rounds: int = 3) -> tuple[float, float, float, int]:
  """(g1, f, b, k): medians over `rounds` of `generate()` alone and `forward()` alone, then k =
  round(g1 / f) forwards back to back on this thread while `generate()` runs on another (b: the
  wall time of both), so the two contend for the whole generation, as an async step's learner
  and sampler do. Each is called once first, untimed (compiles)."""
  generate()
  forward()
  alone_g, alone_f = [], []
  for _ in range(rounds):
    t0 = time.perf_counter()
    generate()
    alone_g.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    forward()
    alone_f.append(time.perf_counter() - t0)
  g1, f = float(np.median(alone_g)), float(np.median(alone_f))
  k = max(1, round(g1 / f)) if f > 0 else 1
  both = []
  for _ in range(rounds):
    errors: list[BaseException] = []

    def run_generate():
      try:
        generate()
      except BaseException as e:  # noqa: BLE001 -- re-raised below, in the caller's thread
        errors.append(e)
    t0 = time.perf_counter()
    th = threading.Thread(target=run_generate, name="overlap-probe")
    th.start()
    for _ in range(k):
      forward()
    th.join()
    both.append(time.perf_counter() - t0)
    if errors:
      raise errors[0]
  return g1, f, float(np.median(both)), k
