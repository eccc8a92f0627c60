"""Supervised fine-tuning: masked negative log-likelihood of the target tokens.

    loss = Σ_t w_t · (−log π_θ(y_t)),   w_t = m_t / Σ m   (token_mean, the default)

Any aggregation of losses/aggregation.py can be chosen (e.g. a per-sequence mean so long
answers do not dominate). Simplifications: no label smoothing, no z-loss; the log-prob comes
from the learner (fused LM-head kernel), so the loss never sees logits.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from posttrain_jax.losses import aggregation as agg
from posttrain_jax.losses.base import register_loss, weighted
from posttrain_jax.types import TrainBatch


@dataclasses.dataclass(frozen=True)
class SFTConfig:
  """Masked NLL."""
  aggregation: str = "token_mean"       # a name in losses.aggregation.AGGREGATIONS
  max_len: Optional[int] = None         # L_max, only for aggregation "seq_mean_token_sum_norm"

  def __post_init__(self):
    agg.validate_aggregation(self.aggregation, self.max_len)


def sft_token_terms(batch: TrainBatch, cfg: SFTConfig) -> jax.Array:
  """The aggregation weight w_t (mask included), [B, T]."""
  weight_bt, _ = agg.aggregation_weights(cfg.aggregation, batch, cfg.max_len)
  return weight_bt


def sft_token_loss(logp: jax.Array, weight: jax.Array, cfg: SFTConfig) -> jax.Array:
  del cfg
  return jnp.where(weight != 0, -weight * logp, 0.0)


@register_loss("sft", SFTConfig, inputs=(), token_terms=sft_token_terms,
               token_loss=sft_token_loss)
def sft_loss(logp_bt: jax.Array, batch: TrainBatch, cfg: SFTConfig):
  """Σ_t w_t (−log π_θ(y_t)); metrics: loss, nll (token mean, whatever the aggregation)."""
  weight_bt, count = agg.aggregation_weights(cfg.aggregation, batch, cfg.max_len)
  loss = jnp.sum(sft_token_loss(logp_bt, weight_bt, cfg))
  metrics = {"loss": weighted(loss * count, count),
             "nll": agg.token_mean_metric(-jax.lax.stop_gradient(logp_bt), batch)}
  return loss, metrics
