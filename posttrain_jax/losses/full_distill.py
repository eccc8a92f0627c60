"""Full-distribution distillation: a divergence between the student's and the teacher's next-token
distributions at every teacher-scored position, through the LM-head kernels (never [N, V]).

At a sampled position t (student context x, y_<t; teacher context x, c, y_<t, aligned by
teacher.py) with S = softmax(h_t W / τ), T = softmax(h_T,t W_T / τ):

    loss = Σ_t w_t · m_t · D(S_t, T_t)           w_t: the aggregation weights; m_t: teacher mask

    D = JSD_β(T ‖ S) = β KL(T ‖ M) + (1 − β) KL(S ‖ M),  M = β T + (1 − β) S   (default, β 0.5)
        forward_kl KL(T ‖ S)  (mode covering),  reverse_kl KL(S ‖ T)  (mode seeking)

    topk = k: D over k + 1 buckets instead of V: the student's top-k ids (both models' log-probs
    there) plus one tail bucket per model, log(1 − Σ_k p) (SDPO's default k = 100; top-20 was
    reported to match the full vocabulary). topk = None: the whole vocabulary (kernels/teacher.py's
    two-pass chunked divergence; its gradient is derived there).

β → 0 is forward-KL-like and β → 1 reverse-KL-like (kernels/teacher.py states ours; TRL and GKD
agree). The teacher is stop-gradient. Full-distribution divergences need no importance weight
for off-policy samples (the divergence at a position does not depend on which token was
sampled there, only the positions do), so behaviour log-probs are not read.

The teacher's head: HeadInputs.teacher_w, the head of the teacher's weights (an EMA or the
frozen start, passed to the learner's step by teacher.py), or W itself (stop-gradient) when the
teacher is the model with the current weights. teacher_hidden holds h_T at each student
position, computed by teacher.py from the teacher sequence under the teacher's weights (the
ones whose head is W_T). Tokens without a teacher stay in the aggregation's denominator (the
term's weight scales with `distill/teacher_token_frac`).

This is a *head* loss (LossSpec.head): `fn(head, batch, cfg)` with `head` = (h [N, D], W,
transposed, temperature) instead of per-token log-probs.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from posttrain_jax.kernels import reference as kernel_ref
from posttrain_jax.kernels import teacher as teacher_kernels
from posttrain_jax.losses import aggregation as agg
from posttrain_jax.losses.base import HeadInputs, register_loss, weighted
from posttrain_jax.losses.kl import batch_field
from posttrain_jax.types import TrainBatch

DIVERGENCES = teacher_kernels.DIVERGENCES


@dataclasses.dataclass(frozen=True)
class FullDistillConfig:
  """Divergence to the teacher's distribution at every teacher-scored position."""
  divergence: str = "jsd"               # "jsd" | "forward_kl" | "reverse_kl"
  beta: float = 0.5                     # JSD's β (0 < β < 1); divergence "jsd" only
  topk: Optional[int] = 100             # student top-k + one tail bucket; None = full vocabulary
  impl: str = "auto"                    # kernels/teacher.py impl: auto | chunked | reference
  aggregation: str = "token_mean"       # a name in losses.aggregation.AGGREGATIONS
  max_len: Optional[int] = None         # L_max, only for aggregation "seq_mean_token_sum_norm"

  def __post_init__(self):
    if self.divergence not in DIVERGENCES:
      raise ValueError(f"FullDistillConfig.divergence is {self.divergence!r}; valid: "
                       f"{DIVERGENCES}")
    if self.divergence == "jsd" and not 0.0 < self.beta < 1.0:
      raise ValueError(f"FullDistillConfig.beta must be in (0, 1) for jsd, got {self.beta}")
    if self.topk is not None and self.topk < 1:
      raise ValueError(f"FullDistillConfig.topk must be ≥ 1 or None, got {self.topk}")
    agg.validate_aggregation(self.aggregation, self.max_len)


def per_token_divergence(head: HeadInputs, teacher_h: jax.Array, mask_n: jax.Array,
                         cfg: FullDistillConfig) -> jax.Array:
  """D_n [N] (0 where mask_n is False); the teacher's head is head.teacher_w, or the student's
  own (stop-gradient) when that is None."""
  w_t = jax.lax.stop_gradient(head.w if head.teacher_w is None else head.teacher_w)
  kw = dict(temperature=head.temperature, mask=mask_n, transposed=head.transposed,
            teacher_transposed=head.transposed, impl=cfg.impl)
  if cfg.topk is None:
    return teacher_kernels.teacher_divergence(head.h, head.w, teacher_h, w_t, kind=cfg.divergence,
                                              beta=cfg.beta, **kw)
  vocab = head.w.shape[0 if head.transposed else 1]
  out = teacher_kernels.topk_logprobs(head.h, head.w, teacher_h, w_t, k=min(cfg.topk, vocab), **kw)
  ls = jnp.concatenate([out.student_logp_nk, out.student_tail_n[:, None]], axis=1)
  lt = jnp.concatenate([out.teacher_logp_nk, out.teacher_tail_n[:, None]], axis=1)
  return jnp.where(mask_n, kernel_ref.divergence(ls, jax.lax.stop_gradient(lt), cfg.divergence,
                                                 cfg.beta), 0.0)


@register_loss("full_distill", FullDistillConfig, inputs=("teacher_hidden", "teacher_mask"),
               head=True)
def full_distill_loss(head: HeadInputs, batch: TrainBatch, cfg: FullDistillConfig):
  """See the module docstring. Metrics: loss; distill/divergence (mean D on teacher-scored
  tokens); distill/teacher_token_frac (their share of the sampled tokens)."""
  why = "loss 'full_distill'"
  n = head.h.shape[0]
  m_bt = batch_field(batch, "teacher_mask", why) * (batch.loss_mask > 0)
  teacher_h = batch_field(batch, "teacher_hidden", why).reshape(n, -1)
  mask_n = m_bt.reshape(-1) > 0
  d_n = per_token_divergence(head, teacher_h.astype(head.h.dtype), mask_n, cfg)
  weight_bt, count = agg.aggregation_weights(cfg.aggregation, batch, cfg.max_len)
  loss = jnp.sum(weight_bt.reshape(-1) * d_n)
  m = m_bt.astype(jnp.float32)
  sampled = (batch.loss_mask > 0).astype(jnp.float32)
  metrics = {"loss": weighted(loss * count, count),
             "distill/divergence": weighted(jnp.sum(jax.lax.stop_gradient(d_n)), jnp.sum(m)),
             "distill/teacher_token_frac": weighted(jnp.sum(m), jnp.sum(sampled))}
  return loss, metrics
