"""Per-tenant learning on the job: one adapter per tenant, each trained on its own sessions only.

With `rl.learner.lora.tenants` named (posttrain_jax/tenants.py), the learner stacks one adapter
per tenant on the shared frozen base, and this source (the `traces` / `online` modes) decides
whose turn a step is:

    ready    = graded, settled sessions not trained yet, of tenants that have an adapter
    tenant   = among tenants with >= prompts_per_step ready, the one whose oldest ready session
               is oldest (none has that many by `wait_s`: the oldest ready session's tenant)
    select   learner.select(tenant): the step's log-probs, loss and update are that tenant's
    take     up to prompts_per_step of that tenant's sessions (TraceRollouts._take)

A session is only ever trained into its own tenant's adapter, against its own tenant's running
baseline (`baseline_key`: one EMA of rewards per tenant, so a tenant whose task is harder is not
pushed down by another's easier rewards). Serving (online): each tenant has
an engine view of its own (`views`, e.g. JaxSampler.fork: the same compiled programs and base
arrays, its own weights slot), and the proxy routes a call to its authenticated tenant's view,
so a tenant never samples another's adapter. After a step only the tenant trained gets new
weights, labelled with its own version = the updates its adapter received (learner.step_count);
staleness (`max_staleness`, `traces/staleness/*`) is counted in those versions. Metrics per
step: `tenant/index` (the row trained), `tenant/<name>/version` for every tenant (as the step
collects, before its update), and
`traces/no_adapter`: ready sessions of tenants without an adapter, never trained.
"""
from __future__ import annotations

import collections
from typing import Mapping, Optional

from posttrain_jax.byoh.trace_source import TraceRollouts, TraceSourceConfig
from posttrain_jax.tasks.task import Task
from posttrain_jax.types import Trajectory


class TenantTraceRollouts(TraceRollouts):
  """TraceRollouts, one tenant a step (the module docstring). `learner`: a per-tenant Learner;
  `views`: tenant -> the engine serving that tenant's adapter (online), or {} (traces)."""

  @staticmethod
  def baseline_key(traj) -> str:
    """The running baseline keeps one mean per tenant (rebuild.py tags each sample)."""
    return "tenant:" + str(traj.metrics.get("tenant", ""))

  def __init__(self, cfg: TraceSourceConfig, sessions_per_step: int, learner,
               views: Optional[Mapping[str, object]] = None, **kw):
    if cfg.tenant is not None:
      raise ValueError(f"rl.traces.tenant={cfg.tenant!r} with lora.tenants: a per-tenant run "
                       "trains every tenant named in rl.learner.lora.tenants; leave it None")
    super().__init__(cfg, sessions_per_step, engine=None, **kw)
    self.learner, self.views = learner, dict(views or {})
    self._installed = False
    self._no_adapter = 0     # ready sessions whose tenant has no adapter (not trained)

  def update_weights(self, params, version: int) -> None:
    """The tenant trained last (at the first call, every tenant) gets its adapters, each view
    labelled with its tenant's own version; `params`/`version` are the run's (unused but the
    backpressure's clock)."""
    del params
    learner = self.learner
    current = learner.tenants[learner.tenant]
    for tenant in learner.tenants if not self._installed else (current,):
      learner.select(tenant)
      if tenant in self.views:
        self.views[tenant].update_weights(learner.params, learner.step_count)
    learner.select(current)
    self._installed = True
    self.version = version
    if self.server is not None:
      self.server.proxy.gate.report(version, self._backlog)

  def _ready(self) -> list[tuple[float, str, str]]:
    """Ready sessions of tenants with an adapter; the others are counted, never trained."""
    known, everyone = set(self.learner.tenants), super()._ready()
    ready = [r for r in everyone if r[1] in known]
    self._no_adapter = len(everyone) - len(ready)
    return ready

  def _choose(self, ready: list[tuple[float, str, str]]) -> Optional[str]:
    counts = _per_tenant(ready)
    full = [r for r in ready if counts[r[1]] >= self.per_step]
    pick = full or ready
    return pick[0][1] if pick else None    # `ready` is oldest first

  def collect(self, step: int) -> tuple[list[Task], list[Trajectory]]:
    ready = self._ready()
    deadline = self._clock() + self.cfg.wait_s
    while (not any(n >= self.per_step for n in _per_tenant(ready).values())
           and self._clock() < deadline):
      self._sleep(self.cfg.poll_s)
      ready = self._ready()
    tenant = self._choose(ready)
    if tenant is None:
      return self._take([])
    self.learner.select(tenant)
    self.version = self.learner.step_count    # staleness in the tenant's own versions
    own = [r for r in ready if r[1] == tenant]
    out = self._take(own)
    self._backlog += len(ready) - len(own)    # the other tenants' sessions wait too
    self._metrics["traces/backlog"] = float(self._backlog)
    self._metrics["tenant/index"] = float(self.learner.tenant)
    self._metrics["traces/no_adapter"] = float(self._no_adapter)
    for i, name in enumerate(self.learner.tenants):
      self._metrics[f"tenant/{name}/version"] = float(self.learner.state.step[i])
    return out


def _per_tenant(ready) -> dict[str, int]:
  return collections.Counter(tenant for _, tenant, _ in ready)
