"""How per-token terms become one scalar: token-mean, sequence-mean, Dr.GRPO's constant norm.

With ℓ_t the per-token term, m_t the loss mask, L_i = Σ_{t∈i} m_t the sampled length of
sequence i, n the number of sequences with L_i > 0 and G the number of valid sequences:

    token_mean               Σ_t ℓ_t m_t / Σ_t m_t                       (DAPO)      count Σ m
    seq_mean_token_mean      (1/n) Σ_i Σ_{t∈i} ℓ_t m_t / L_i             (GRPO)      count n
    seq_mean_token_sum_norm  Σ_i Σ_{t∈i} ℓ_t m_t / (G · L_max)           (Dr.GRPO)   count G

Each is written as a constant per-token weight w_t (so `loss = Σ_t w_t ℓ_t` is separable) and
a count that does not depend on parameters; `loss · count` is a plain sum over sequences, so
micro-batches combine exactly as Σ_k loss_k·count_k / Σ_k count_k. Sequence sums go through
`batch.seq_ids` / `batch.seq_valid` (segment sums), never rows, so packed == unpacked.
Simplifications: a sequence with no sampled token is left out of n (its mean is undefined)
but counts in Dr.GRPO's G (it is one of the G responses); an empty batch gives weights 0 and
count 0 instead of dividing by zero.
"""
from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

from posttrain_jax.losses.base import weighted
from posttrain_jax.registry import Registry
from posttrain_jax.types import TrainBatch

# (batch, max_len) -> (weight_bt, count); weight_bt already includes the mask.
AggregationFn = Callable[[TrainBatch, Optional[int]], tuple[jax.Array, jax.Array]]
AGGREGATIONS: Registry[AggregationFn] = Registry("aggregation")


def seq_sum(x_bt: jax.Array, batch: TrainBatch) -> jax.Array:
  """Σ_{t ∈ sequence s} m_t x_t for every global sequence s: [B, T] -> [S]."""
  mask_bt = batch.loss_mask
  ids_bt = jnp.where(mask_bt > 0, batch.seq_ids, 0)
  return jax.ops.segment_sum((x_bt * mask_bt).ravel(), ids_bt.ravel(),
                             num_segments=batch.num_seqs)


def seq_gather(x_s: jax.Array, batch: TrainBatch) -> jax.Array:
  """Broadcasts a per-sequence value to that sequence's tokens: [S] -> [B, T] (0 off-mask)."""
  ids_bt = jnp.where(batch.loss_mask > 0, batch.seq_ids, 0)
  return jnp.where(batch.loss_mask > 0, x_s[ids_bt], 0.0)


def seq_lengths(batch: TrainBatch) -> jax.Array:
  """L_s, the number of sampled tokens of each sequence: [S]."""
  return seq_sum(jnp.ones_like(batch.loss_mask), batch)


def nonempty_seqs(batch: TrainBatch) -> jax.Array:
  """1 for valid sequences with at least one sampled token: [S]."""
  return batch.seq_valid * (seq_lengths(batch) > 0)


def _safe_inv(x):
  return jnp.where(x > 0, 1.0 / jnp.where(x > 0, x, 1.0), 0.0)


@AGGREGATIONS.register("token_mean")
def token_mean(batch: TrainBatch, max_len: Optional[int] = None):
  del max_len
  count = jnp.sum(batch.loss_mask)
  return batch.loss_mask * _safe_inv(count), count


@AGGREGATIONS.register("seq_mean_token_mean")
def seq_mean_token_mean(batch: TrainBatch, max_len: Optional[int] = None):
  del max_len
  len_s = seq_lengths(batch)
  n = jnp.sum(nonempty_seqs(batch))
  weight_bt = seq_gather(_safe_inv(len_s), batch) * _safe_inv(n)
  return weight_bt * batch.loss_mask, n


@AGGREGATIONS.register("seq_mean_token_sum_norm")
def seq_mean_token_sum_norm(batch: TrainBatch, max_len: Optional[int] = None):
  if max_len is None or max_len <= 0:
    raise ValueError("aggregation 'seq_mean_token_sum_norm' (Dr.GRPO) needs a positive "
                     f"max_len (the constant L_max, e.g. the generation budget); got {max_len}")
  g = jnp.sum(batch.seq_valid)
  return batch.loss_mask * _safe_inv(g * max_len), g


def aggregation_weights(name: str, batch: TrainBatch, max_len: Optional[int] = None):
  """(weight_bt, count) for the named aggregation; `loss = Σ weight_bt · ℓ_bt`."""
  weight_bt, count = AGGREGATIONS.get(name)(batch, max_len)
  return jax.lax.stop_gradient(weight_bt), jax.lax.stop_gradient(count)


def validate_aggregation(name: str, max_len: Optional[int]) -> None:
  """Config-time check: a known name, and L_max for Dr.GRPO."""
  AGGREGATIONS.get(name)
  if name == "seq_mean_token_sum_norm" and (max_len is None or max_len <= 0):
    raise ValueError("aggregation 'seq_mean_token_sum_norm' (Dr.GRPO) needs a positive "
                     f"max_len (the constant L_max, e.g. the generation budget); got {max_len}")


def token_mean_metric(x_bt: jax.Array, batch: TrainBatch):
  """A (Σ m x, Σ m) pair: the token mean of x over sampled tokens, gradients stopped."""
  m = batch.loss_mask
  return weighted(jnp.sum(jnp.where(m > 0, x_bt, 0.0) * m), jnp.sum(m))
