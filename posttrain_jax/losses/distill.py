"""Sampled-token distillation: on-policy distillation as a policy gradient, mixable with RL.

For a sampled response token y_t with student log-prob log π_θ(y_t), teacher log-prob
log T(y_t) (the teacher scored the *student's* token, under its own context) and the engine's
behaviour log-prob log μ(y_t):

    δ_t = sg(log T(y_t) − log π_θ(y_t))                 per-token distillation advantage
    ρ_t = sg(min(π_θ(y_t) / μ(y_t), c))                 importance weight, clipped at c (default 2)
    A_t = coef · m_t · δ_t + rl_coef · Â_t               m_t = 1 where a teacher scored the token
    loss = −Σ_t w_t · ρ_t · A_t · log π_θ(y_t)           w_t: the aggregation weights (token_mean)

With y ~ π_θ (ρ = 1), E_y[δ ∇log π_θ(y)] = −∇KL(π_θ ‖ T): descending this loss descends the
reverse KL to the teacher, exactly (the k2 estimator's gradient, losses/kl.py; on-policy
distillation, Agarwal et al. 2024 / Thinking Machines 2025; SDPO and OPSD use the same per-token
advantage with the model itself as teacher under privileged context). With y ~ μ ≠ π_θ the
expectation is under μ, and ρ_t re-weights it towards π_θ (clipped: SDPO's default c = 2).
`is_clip=None` drops ρ (on-policy samples, or the caller accepts μ's expectation).

m_t: samples with no privileged context (no feedback, no reference, no successful sibling) have
no teacher; their tokens get m_t = 0, so they contribute only the RL term (nothing at all when
rl_coef = 0), and are counted (`distill/teacher_token_frac`). Â_t is the batch's advantage
(a running or group baseline from advantages.py): rl_coef > 0 mixes an RL signal in.

Inputs: teacher_logp and teacher_mask always; behaviour_logp when is_clip is not None.
Simplifications: only the sampled token enters (the full-distribution estimators, top-k + tail
and JSD(β), are losses/full_distill.py); δ_t is the immediate per-token term (the per-position
reverse KL given the prefix, not a return over later tokens); no PPO ratio clipping (one update
per batch: RunConfig refuses update_epochs > 1; ρ is the only ratio). Tokens without a teacher
stay in the token_mean denominator, so the distillation term's effective weight scales with
`distill/teacher_token_frac`.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from posttrain_jax.losses import aggregation as agg
from posttrain_jax.losses.base import register_loss, weighted
from posttrain_jax.losses.kl import batch_field
from posttrain_jax.types import TrainBatch


@dataclasses.dataclass(frozen=True)
class DistillConfig:
  """Sampled-token reverse-KL distillation, optionally mixed with the batch's RL advantage."""
  coef: float = 1.0                     # weight of the distillation advantage δ_t
  rl_coef: float = 0.0                  # weight of the batch's RL advantage Â_t (0 = pure distillation)
  is_clip: Optional[float] = 2.0        # c in ρ_t = min(π_θ/μ, c); None = no importance weight
  aggregation: str = "token_mean"       # a name in losses.aggregation.AGGREGATIONS
  max_len: Optional[int] = None         # L_max, only for aggregation "seq_mean_token_sum_norm"

  def __post_init__(self):
    if self.coef < 0 or self.rl_coef < 0 or self.coef + self.rl_coef == 0:
      raise ValueError(f"DistillConfig: coef={self.coef} and rl_coef={self.rl_coef} must be ≥ 0 "
                       "and not both 0")
    if self.is_clip is not None and not self.is_clip > 0:
      raise ValueError(f"DistillConfig.is_clip must be > 0 or None, got {self.is_clip}")
    agg.validate_aggregation(self.aggregation, self.max_len)


def distill_inputs(cfg: DistillConfig) -> set[str]:
  out = {"teacher_logp", "teacher_mask"}
  if cfg.is_clip is not None:
    out.add("behaviour_logp")
  return out


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DistillTerms:
  """Per-token constants: aggregation weight (loss mask included), teacher log-prob and mask,
  behaviour log-prob (None without an importance weight), RL advantage."""
  weight_bt: jax.Array
  teacher_logp_bt: jax.Array
  teacher_mask_bt: jax.Array
  behaviour_logp_bt: Optional[jax.Array]
  advantages_bt: jax.Array


def distill_token_terms(batch: TrainBatch, cfg: DistillConfig) -> DistillTerms:
  weight_bt, _ = agg.aggregation_weights(cfg.aggregation, batch, cfg.max_len)
  why = "loss 'sampled_distill'"
  mask = batch_field(batch, "teacher_mask", why) * (batch.loss_mask > 0)
  teacher = jnp.where(mask > 0, batch_field(batch, "teacher_logp", why), 0.0)
  beh = (None if cfg.is_clip is None
         else batch_field(batch, "behaviour_logp", f"{why} with is_clip={cfg.is_clip}"))
  return DistillTerms(weight_bt, teacher, mask, beh, jax.lax.stop_gradient(batch.advantages))


def _is_weight(sg_logp, terms: DistillTerms, cfg: DistillConfig):
  if terms.behaviour_logp_bt is None:
    return jnp.ones_like(sg_logp)
  # exp(min(x, log c)) == min(exp(x), c) without overflow for large x
  return jnp.exp(jnp.minimum(sg_logp - terms.behaviour_logp_bt, jnp.log(cfg.is_clip)))


def distill_token_loss(logp: jax.Array, terms: DistillTerms, cfg: DistillConfig) -> jax.Array:
  live = terms.weight_bt != 0
  logp = jnp.where(live, logp, 0.0)   # padding may hold any value
  sg = jax.lax.stop_gradient(logp)
  delta = terms.teacher_mask_bt * (terms.teacher_logp_bt - sg)
  adv = cfg.coef * delta + cfg.rl_coef * terms.advantages_bt
  rho = jnp.where(live, _is_weight(sg, terms, cfg), 0.0)
  return jnp.where(live, -terms.weight_bt * rho * adv * logp, 0.0)


@register_loss("sampled_distill", DistillConfig, inputs=distill_inputs,
               token_terms=distill_token_terms, token_loss=distill_token_loss)
def distill_loss(logp_bt: jax.Array, batch: TrainBatch, cfg: DistillConfig):
  """See the module docstring. Metrics: loss; distill/reverse_kl (mean of log π_θ − log T on
  teacher-scored tokens: the sampled estimate of KL(π_θ‖T)); distill/teacher_token_frac (the
  share of sampled tokens with a teacher); is_weight/mean, is_weight/clipped_frac; nll."""
  terms = distill_token_terms(batch, cfg)
  loss = jnp.sum(distill_token_loss(logp_bt, terms, cfg))
  _, count = agg.aggregation_weights(cfg.aggregation, batch, cfg.max_len)
  sg = jax.lax.stop_gradient(logp_bt)
  sampled = (batch.loss_mask > 0).astype(jnp.float32)
  m = terms.teacher_mask_bt.astype(jnp.float32)
  metrics = {
      "loss": weighted(loss * count, count),
      "nll": agg.token_mean_metric(-sg, batch),
      "distill/reverse_kl": weighted(jnp.sum(m * jnp.where(m > 0, sg - terms.teacher_logp_bt, 0.0)),
                                     jnp.sum(m)),
      "distill/teacher_token_frac": weighted(jnp.sum(m), jnp.sum(sampled)),
  }
  if terms.behaviour_logp_bt is not None:
    rho = _is_weight(jnp.where(sampled > 0, sg, terms.behaviour_logp_bt), terms, cfg)
    raw = sg - terms.behaviour_logp_bt
    metrics["is_weight/mean"] = weighted(jnp.sum(sampled * rho), jnp.sum(sampled))
    metrics["is_weight/clipped_frac"] = weighted(
        jnp.sum(sampled * (raw > jnp.log(cfg.is_clip))), jnp.sum(sampled))
  return loss, metrics
