"""`rl.mode="online"`: serve the policy being trained and learn from the sessions it serves.
The proxy (byoh/online.py, settings in `rl.traces.online`) runs in this process on an engine of
its own (or the run's, where it can serve beside eval) holding a copy of the weights (the
learner donates its buffers while the proxy samples), swapped in every step; the sessions are
taken as in `traces` mode (`rl.traces`: `max_staleness` bounds how old a trained one may be;
`rl.traces.online.proxy.max_pending_sessions=-1` makes the proxy refuse or queue new sessions
that would be trained past it, byoh/backpressure.py)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from posttrain_jax.byoh.online import OnlineServer
from posttrain_jax.byoh.trace_source import TraceRollouts
from posttrain_jax.run.sources import SourceContext, register_source
from posttrain_jax.run.sources.traces import check_traces, log_correction


@register_source("online", groups=False, off_policy=True, multi_process=False,
                 check=check_traces, draws_per_step=lambda rl, prompts: 0)
def build_online(ctx: SourceContext) -> TraceRollouts:
  traces = ctx.cfg.rl.traces
  log_correction(ctx)
  serving = ctx.engine if ctx.shareable else ctx.new_engine()
  copy = not ctx.copies_weights
  if copy:
    serving.update_weights(jax.tree.map(jnp.copy, ctx.learner.params), 0)
  server = OnlineServer(traces.online, serving, ctx.tokenizer, ctx.stop_ids, traces.store)
  if traces.online.proxy.max_pending_sessions < 0 and traces.max_staleness >= 0:
    # backpressure (byoh/backpressure.py): no session begun that would only be dropped as stale
    server.proxy.gate.limit = (traces.max_staleness + 1) * ctx.prompts_per_step
  ctx.log(f"online: serving the policy at {server.url}, weights swapped every step")
  return TraceRollouts(traces, ctx.prompts_per_step, engine=serving, copy_weights=copy,
                       server=server)
