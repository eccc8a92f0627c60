"""Held-out evaluation: the episode type's own eval (actors/episode.py) on tasks never trained
on, sampled at the policy temperature (`eval/accuracy`) and greedy (`eval/accuracy_greedy`),
with whatever else the episode type reports beside it (multi-turn: `timeout_frac`,
`infra_error_frac`, so an eval that reads low says why). Each value is the mean over every
process's shard of the held-out tasks, weighted by its count.

Our failures are retried with `rl.retry`'s backoff (EngineError: the engine or its weight sync;
EnvInfraError: a tool backend or sandbox). When every attempt fails, or a grader cannot read a
held-out task's reference (GraderError: retrying would not help), the eval is *reported*, not
raised: its accuracies are NaN, `eval/failed` = 1, a log line says why, and a run that trained
for hours goes on. `eval/retries` counts the attempts that failed (present when > 0). Any other
exception is a bug and propagates.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import jax

from posttrain_jax.engines.base import EngineError
from posttrain_jax.graders import GraderError
from posttrain_jax.envs.env import EnvInfraError
from posttrain_jax.multihost import all_gather_json

SEED = 12345   # every eval samples with the same seed: evals differ only by the weights


class Evaluator:
  """`episode_spec`: the registry entry of rl.episode; `episode`: builds an episode on an engine."""

  def __init__(self, cfg, episode_spec, episode: Callable, held_out, log):
    self.cfg, self.spec, self.episode, self.held_out, self.log = (cfg, episode_spec, episode,
                                                                  held_out, log)

  def __call__(self, engine, learner=None, version: Optional[int] = None
               ) -> tuple[dict[str, float], float]:
    """The held-out metrics (after syncing the learner's weights at `version`, when given) and
    the seconds it took."""
    t0 = time.perf_counter()
    out = self._eval_or_report(engine, learner, version)
    return out, time.perf_counter() - t0

  def _eval_or_report(self, engine, learner, version) -> dict[str, float]:
    retry, errors = self.cfg.rl.retry, []
    for attempt in range(retry.max_retries + 1):
      if attempt:
        time.sleep(retry.delay(attempt))
      try:
        if learner is not None:
          engine.update_weights(learner.params, version=version)
        out = self.evaluate(engine)
        return {**out, "eval/retries": float(attempt)} if attempt else out
      except (EngineError, EnvInfraError) as e:
        errors.append(f"{type(e).__name__}: {e}")
        self.log(f"held-out eval attempt {attempt + 1}/{retry.max_retries + 1} failed: "
                 f"{errors[-1]}")
      except GraderError as e:
        errors.append(f"{type(e).__name__}: {e}")
        break
    self.log(f"held-out eval FAILED after {len(errors)} attempt(s), reported as NaN, training "
             f"goes on: {errors[-1]}")
    return {**{f"eval/{n}": float("nan") for n, _, _ in self.modes()}, "eval/failed": 1.0,
            "eval/retries": float(len(errors))}

  def modes(self) -> list[tuple[str, float, int]]:
    """(metric name, temperature, samples per task) of each eval the config asks for."""
    ev = self.cfg.eval
    out = [("accuracy", ev.temperature, ev.samples_per_prompt)] if ev.sampled else []
    return out + ([("accuracy_greedy", 0.0, 1)] if ev.greedy else [])

  def evaluate(self, engine) -> dict[str, float]:
    """The episode type's eval on the held-out tasks, per mode (module docstring)."""
    episode, out = self.episode(engine), {}
    for name, temperature, n in self.modes():
      d = self.spec.evaluate(episode, self.held_out, temperature, n, self.cfg.eval.max_tokens,
                             SEED)
      count = d.pop("count")
      out[f"eval/{name}"] = job_mean(d.pop("accuracy"), count)
      for k, v in d.items():
        out[f"eval/{name}/{k}"] = job_mean(v, count)
    return out


def job_mean(mean: float, count: float) -> float:
  """The mean over every process's shard from each one's (mean, count); one process: `mean`."""
  if jax.process_count() == 1:
    return mean
  parts = [(m, c) for m, c in all_gather_json([None if mean != mean else mean, count])
           if c and m is not None]
  total = sum(c for _, c in parts)
  return sum(m * c for m, c in parts) / total if total else float("nan")
