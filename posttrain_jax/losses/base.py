"""The loss protocol and its registry.

A loss is a pure function

    fn(logp_bt, batch: TrainBatch, cfg) -> (loss, metrics)

`logp_bt` is the learner's per-token log-prob of `batch.target_ids` ([B, T], differentiable).
`loss` is the scalar normalised *within this batch* and `metrics["loss"] == (loss * count, count)`
where `count` (the normaliser: tokens, sequences, ...) does not depend on parameters. Every
metric is a weighted pair `(sum, count)` so that gradient accumulation over micro-batches is
exact: the learner differentiates `loss * count`, sums over micro-batches and divides by the
summed count.

A loss is *separable* when its value is a sum of per-token terms, each depending on `logp`
only through that token's own `logp_t`:

    loss = sum_t token_loss(logp_t, aux_t, cfg),   aux = token_terms(batch, cfg)

`token_terms` precomputes everything that needs the whole batch (advantages, normalising
weights, masks) as `[B, T]` arrays; `token_loss` is elementwise and works on any shape. The
fused LM-head kernel uses this form to compute gradients during its forward pass.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from posttrain_jax.registry import Registry

Metrics = dict[str, tuple[jax.Array, jax.Array]]
LossFn = Callable[..., tuple[jax.Array, Metrics]]


@dataclasses.dataclass(frozen=True)
class LossSpec:
  """A registered loss: the function, its config class and, if separable, its per-token form."""
  name: str
  fn: LossFn
  config_cls: type
  token_terms: Optional[Callable[[Any, Any], Any]] = None       # (batch, cfg) -> aux pytree of [B, T]
  token_loss: Optional[Callable[[jax.Array, Any, Any], jax.Array]] = None  # (logp, aux, cfg) -> ell

  @property
  def separable(self) -> bool:
    return self.token_loss is not None


LOSSES: Registry[LossSpec] = Registry("loss")


def register_loss(name: str, config_cls: type, *, token_terms=None, token_loss=None):
  """Decorator: `@register_loss("grpo", GRPOConfig, token_terms=..., token_loss=...)`."""
  if (token_terms is None) != (token_loss is None):
    raise ValueError(f"loss {name!r}: give both token_terms and token_loss, or neither")

  def deco(fn: LossFn) -> LossFn:
    LOSSES.register(name)(LossSpec(name, fn, config_cls, token_terms, token_loss))
    return fn
  return deco


def get_loss(name: str) -> LossSpec:
  return LOSSES.get(name)


def weighted(total: jax.Array, count: jax.Array) -> tuple[jax.Array, jax.Array]:
  """A metric as a (sum, count) pair, both float32 scalars, gradients stopped."""
  return (jax.lax.stop_gradient(jnp.asarray(total, jnp.float32)),
          jax.lax.stop_gradient(jnp.asarray(count, jnp.float32)))
