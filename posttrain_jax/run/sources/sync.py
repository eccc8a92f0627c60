"""`rl.mode="sync"`: generate, then train (on-policy). Each step runs one episode batch of
`prompts_per_step` tasks on the weights of the previous update (actors/rollout.py); with
`rl.oversample` it draws ceil(P·(1 + o)) tasks and the step trains P of their groups, those
with a learning signal first (DAPO's dynamic sampling, one round; rl_step.py)."""
from __future__ import annotations

import math

from posttrain_jax.actors.rollout import SyncRollouts
from posttrain_jax.run.sources import SourceContext, register_source


def draws_per_step(rl, prompts: int) -> int:
  """Tasks a step draws: `prompts`, more with rl.oversample; the 1e-9 keeps float error
  (50 · (1 + 0.1) = 55.00000000000001) from drawing one more."""
  return math.ceil(prompts * (1 + rl.oversample) - 1e-9) if rl.oversample > 0 else prompts


def build_sync(ctx: SourceContext) -> SyncRollouts:
  rl = ctx.cfg.rl
  return SyncRollouts(ctx.episode(ctx.engine), ctx.tasks, rl.rollout.group_size,
                      draws_per_step(rl, ctx.prompts_per_step), seed=ctx.cfg.seed,
                      retry=rl.retry,
                      train_groups=ctx.prompts_per_step if rl.oversample > 0 else None)


register_source("sync", oversamples=True, draws_per_step=draws_per_step)(build_sync)
