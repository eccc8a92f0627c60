"""`rl.mode="async"`: an actor pool samples while the learner trains (actors/pool.py). A step's
batch may come from policies up to `rl.replay.max_staleness` versions old, corrected
off-policy (`rl.async_correction`, TIS by default, when the loss has no correction of its
own); the checkpoint holds the replay queue and the unfinished work."""
from __future__ import annotations

from posttrain_jax.actors.pool import AsyncRollouts
from posttrain_jax.run.sources import SourceContext, register_source


def _check(cfg) -> None:
  rl = cfg.rl
  if rl.replay.min_scored > rl.rollout.group_size:
    raise ValueError(f"replay.min_scored={rl.replay.min_scored} > rollout.group_size="
                     f"{rl.rollout.group_size}: every group would be dropped; lower min_scored "
                     "to at most group_size")


@register_source("async", off_policy=True, lockstep=False, check=_check)
def build_async(ctx: SourceContext) -> AsyncRollouts:
  rl = ctx.cfg.rl
  engine = ctx.engine if ctx.shareable else ctx.new_engine()   # rollouts beside eval
  correction = getattr(ctx.cfg.loss_config(off_policy=True), "correction", "none")
  ctx.log(f"async rollouts: off-policy correction {correction!r} on samples up to "
          f"{rl.replay.max_staleness} versions stale (rl.async_correction)")
  return AsyncRollouts(ctx.episode(engine), ctx.tasks, rl.rollout.group_size,
                       ctx.prompts_per_step, seed=ctx.cfg.seed, replay=rl.replay, pool=rl.pool,
                       retry=rl.retry, copy_weights=not ctx.copies_weights)
