"""`rl.mode="auto"`: start sync; after `rl.auto.probe_steps` steps (the first, which compiles,
left out) measure whether sampling the next step while this one trains pays on this hardware
(overlap.py) and turn async only where the bound predicts a gain of `rl.auto.min_gain`. The
choice, its figures and why go to the log and to this source's checkpointed state (a resumed
run keeps it); `rl/async` in every step's metrics says which mode the step ran in. With several
processes it stays sync. Turning async continues the sync source's draws (its next draw and
its requeued items) in the pool, and flips `off_policy`, so the loop gives the loss its
correction for the stale samples."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import numpy as np

from posttrain_jax import overlap
from posttrain_jax.actors.rollout import encode_prompt
from posttrain_jax.actors.source import SourceBase, check_kind
from posttrain_jax.run.sources import SourceContext, register_source
from posttrain_jax.run.sources.sync import build_sync, draws_per_step


class AutoRollouts(SourceBase):
  """A sync source that may hand over to an async one (module docstring)."""

  def __init__(self, ctx: SourceContext):
    self.ctx = ctx
    self.inner = build_sync(ctx)
    self.decision: Optional[dict] = None   # {"mode", "why", figures..., "version"}
    self._probe: list[tuple[float, float]] = []

  # the protocol, delegated to the source in use
  @property
  def off_policy(self) -> bool:
    return self.inner.off_policy

  @property
  def train_groups(self) -> Optional[int]:
    return self.inner.train_groups

  def update_weights(self, params, version: int) -> None:
    self.inner.update_weights(params, version)

  def collect(self, step: int):
    return self.inner.collect(step)

  def metrics(self) -> dict[str, float]:
    return {**self.inner.metrics(), "rl/async": float(self.off_policy)}

  def saved_note(self) -> str:
    return self.inner.saved_note()

  def close(self) -> None:
    self.inner.close()

  def state(self) -> dict:
    return {"kind": "auto", "decision": self.decision, "inner": self.inner.state()}

  def restore(self, state: dict) -> None:
    if not check_kind(state, "auto"):
      return
    self.decision = state["decision"]
    if self.decision is not None and self.decision["mode"] == "async":
      self.inner = self.ctx.build("async")
    self.inner.restore(state["inner"])

  # the probe
  def after_step(self, result: Any, learner: Any) -> None:
    if self.decision is not None or result.version == 0 or not result.updated:
      return
    self._probe.append((result.metrics["time/generate_s"], result.metrics["time/train_s"]))
    if len(self._probe) < self.ctx.cfg.rl.auto.probe_steps:
      return
    d = self._decide(result, learner)
    self.decision = {**d.to_dict(), "version": result.version + 1}
    self.ctx.log(f"rl.mode=auto: {d.mode} from version {result.version + 1} on: {d.why}")
    if d.mode == "async":
      self._turn_async()

  def _decide(self, result, learner) -> overlap.Decision:
    g, t = (float(x) for x in np.median(self._probe, axis=0))   # a step that compiled is out
    rl = self.ctx.cfg.rl
    if jax.process_count() > 1:
      return overlap.Decision("sync", f"{jax.process_count()} processes: rl.mode='async' runs "
                              "in one process", 0.0, g + t, g + t)
    if rl.replay.min_scored > rl.rollout.group_size:
      return overlap.Decision("sync", f"async would drop every group: rl.replay.min_scored="
                              f"{rl.replay.min_scored} > rl.rollout.group_size="
                              f"{rl.rollout.group_size}", 0.0, g + t, g + t)
    sp = dataclasses.replace(rl.rollout.sampling(self.ctx.stop_ids),
                             max_tokens=self.ctx.sample_tokens)
    prompts = [encode_prompt(self.ctx.tokenizer, task) for task in result.tasks]
    # the engine still holds the weights the step's update donated: give it the new ones, as
    # the next step would first (a server engine syncs them once more then)
    version = result.version + 1
    self.inner.update_weights(learner.params, version=version)
    n, engine = rl.rollout.group_size, self.ctx.engine
    g1, f, b, k = overlap.measure(lambda: engine.generate(prompts, sp, n=n, seed=version - 1),
                                  lambda: learner.logprobs(result.batch))
    return overlap.decide(overlap.Probe(g, t, f, g1, b, k), rl.auto.min_gain)

  def _turn_async(self) -> None:
    rl = self.ctx.cfg.rl
    if rl.oversample > 0:
      self.ctx.log(f"rl.oversample={rl.oversample} applies to sync steps only: the pool draws "
                   f"{self.ctx.prompts_per_step} tasks a step, filtered by rl.replay.filter="
                   f"{rl.replay.filter!r}")
    draw, requeued = self.inner.handover()
    self.inner.close()
    self.inner = self.ctx.build("async")
    self.inner.start_at(draw, requeued)


@register_source("auto", oversamples=True, draws_per_step=draws_per_step)
def build_auto(ctx: SourceContext) -> AutoRollouts:
  return AutoRollouts(ctx)
