"""`rl.mode="online"`: serve the policy being trained and learn from the sessions it serves.
The proxy (byoh/online.py, settings in `rl.traces.online`) runs in this process on an engine of
its own (or the run's, where it can serve beside eval) holding a copy of the weights (the
learner donates its buffers while the proxy samples), swapped in every step; the sessions are
taken as in `traces` mode (`rl.traces`: `max_staleness` bounds how old a trained one may be;
`rl.traces.online.proxy.max_pending_sessions=-1` makes the proxy refuse or queue new sessions
that would be trained past it, byoh/backpressure.py). With `rl.learner.lora.tenants`, one
adapter per tenant, each served to its own tenant and trained on its sessions only
(byoh/tenant_source.py)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from posttrain_jax.byoh.online import OnlineServer
from posttrain_jax.byoh.tenant_source import TenantTraceRollouts
from posttrain_jax.byoh.trace_source import TraceRollouts
from posttrain_jax.errors import UserError
from posttrain_jax.run.sources import SourceContext, register_source
from posttrain_jax.run.sources.traces import check_traces, log_correction


def check_online(cfg) -> None:
  """check_traces, and per tenant: the proxy knows the tenants (api_keys), each has an adapter."""
  check_traces(cfg)
  tenants = cfg.rl.learner.lora.tenants
  if not tenants:
    return
  keyed = sorted({t for _, t in cfg.rl.traces.online.proxy.api_keys})
  if not keyed:
    raise ValueError("rl.learner.lora.tenants serves one adapter per tenant, and a tenant is "
                     "who an API key belongs to: set rl.traces.online.proxy.api_keys "
                     "((key, tenant) pairs)")
  missing = [t for t in keyed if t not in tenants]
  if missing:
    raise ValueError(f"rl.traces.online.proxy.api_keys names tenants {missing} that have no "
                     f"adapter in rl.learner.lora.tenants={list(tenants)}: add them")


@register_source("online", groups=False, off_policy=True, multi_process=False, tenants=True,
                 serves=True, check=check_online, draws_per_step=lambda rl, prompts: 0)
def build_online(ctx: SourceContext) -> TraceRollouts:
  traces = ctx.cfg.rl.traces
  log_correction(ctx)
  serving = ctx.engine if ctx.shareable else ctx.new_engine()
  copy = not ctx.copies_weights
  if copy:
    serving.update_weights(jax.tree.map(jnp.copy, ctx.learner.params), 0)
  tenants = ctx.cfg.rl.learner.lora.tenants
  views = {t: _fork(serving, ctx.cfg.rl.engine) for t in tenants}   # per tenant: one each
  server = OnlineServer(traces.online, serving, ctx.tokenizer, ctx.stop_ids, traces.store,
                        engines=views or None)
  if traces.online.proxy.max_pending_sessions < 0 and traces.max_staleness >= 0:
    # backpressure (byoh/backpressure.py): no session begun that would only be dropped as stale
    # (per tenant: each tenant trains about one step in len(tenants))
    server.proxy.gate.limit = ((traces.max_staleness + 1) * ctx.prompts_per_step
                               * max(len(tenants), 1))
  if tenants:
    ctx.log(f"online: serving {len(tenants)} tenants' adapters at {server.url}, each tenant's "
            "swapped after a step on its sessions")
    return TenantTraceRollouts(traces, ctx.prompts_per_step, ctx.learner, views, server=server)
  ctx.log(f"online: serving the policy at {server.url}, weights swapped every step")
  return TraceRollouts(traces, ctx.prompts_per_step, engine=serving, copy_weights=copy,
                       server=server)


def _fork(engine, name: str):
  """A view of `engine` with a weights slot of its own (a tenant's adapter on the shared base)."""
  if not callable(getattr(engine, "fork", None)):
    raise UserError(f"rl.learner.lora.tenants online needs an engine that serves several "
                    f"adapters at once (`fork`: the embedded sampler, rl.engine='jax'); "
                    f"rl.engine={name!r} has none")
  return engine.fork()
