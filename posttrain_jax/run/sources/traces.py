"""`rl.mode="traces"`: train on graded (or commented) sessions a harness recorded through the
proxy (byoh/trace_source.py): one trajectory per session, no groups (the `running` baseline,
global mean only: a session never comes back), corrected off-policy against the recorded
behaviour log-probs. One process reads the store."""
from __future__ import annotations

from posttrain_jax.byoh.tenant_source import TenantTraceRollouts
from posttrain_jax.byoh.trace_source import TraceRollouts
from posttrain_jax.run.sources import SourceContext, register_source


def check_traces(cfg) -> None:
  """A session without a grade has no reward: only a distillation loss learns from it, and only
  from a context a recorded session has (its feedback)."""
  rl = cfg.rl
  require = rl.traces.require
  if require == "grade":
    return
  if not cfg.distills():
    raise ValueError(f"rl.traces.require={require!r} takes sessions without a grade, whose "
                     f"samples have no reward; loss {rl.learner.loss!r} learns only from "
                     "rewards and would train them on advantage 0: use a distillation loss "
                     "('sampled_distill', 'full_distill') or rl.traces.require='grade'")
  if rl.teacher.context in ("reference", "sibling"):
    raise ValueError(f"rl.traces.require={require!r} with rl.teacher.context="
                     f"{rl.teacher.context!r}: a recorded session has no reference solution "
                     "and no siblings, so this teacher would score none of the sessions taken "
                     "for their feedback; use context 'feedback' or 'sdpo'")


def log_correction(ctx: SourceContext) -> None:
  correction = getattr(ctx.cfg.loss_config(off_policy=True), "correction", "none")
  ctx.log(f"training on graded sessions of {ctx.cfg.rl.traces.store.path}: off-policy "
          f"correction {correction!r} against the recorded behaviour log-probs")


@register_source("traces", groups=False, off_policy=True, multi_process=False, tenants=True,
                 check=check_traces, draws_per_step=lambda rl, prompts: 0)
def build_traces(ctx: SourceContext) -> TraceRollouts:
  log_correction(ctx)
  if ctx.cfg.rl.learner.lora.tenants:
    return TenantTraceRollouts(ctx.cfg.rl.traces, ctx.prompts_per_step, ctx.learner)
  return TraceRollouts(ctx.cfg.rl.traces, ctx.prompts_per_step, engine=ctx.engine)
