"""Int8 weights: symmetric per-output-channel quantisation of a [in, out] projection kernel.

    s_j  = max_i |W_ij| / 127                      (float32, one per output channel)
    q_ij = round(W_ij / s_j) ∈ [-127, 127]         (int8, round half to even)
    W_ij ≈ q_ij · s_j,    |W_ij − q_ij · s_j| ≤ s_j / 2   (up to float32 rounding)

An `Int8Kernel` (q, s) is a pytree: it passes through jit, `nnx.merge` and the parameter dicts
as two arrays, and decoder.Linear dequantises it inside the forward pass (W = q · s in float32,
then the compute dtype), so no float copy of the kernel outlives a step. The scale is sharded
like the kernel's output axis (its logical axis is the kernel's second one).

Simplified: weights only (activations stay in the compute dtype, the matmul is a float one);
no zero point, no groups within a channel; an all-zero channel gets s = 0 and dequantises to 0.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

_QMAX = 127


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int8Kernel:
  """A quantised [in, out] kernel: W ≈ q · scale (scale broadcast over the input axis)."""
  q: Any       # int8 [in, out]
  scale: Any   # float32 [out]

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.q.shape)


def quantize(w: jax.Array) -> Int8Kernel:
  """The int8 kernel of a float [in, out] `w` (see the module docstring)."""
  w = jnp.asarray(w, jnp.float32)
  scale = jnp.max(jnp.abs(w), axis=0) / _QMAX
  q = jnp.round(w / jnp.where(scale > 0, scale, 1.0))
  return Int8Kernel(q=jnp.clip(q, -_QMAX, _QMAX).astype(jnp.int8), scale=scale)


def dequantize(k: Int8Kernel, dtype=jnp.float32) -> jax.Array:
  """q · scale, computed in float32, returned in `dtype`."""
  return (k.q.astype(jnp.float32) * k.scale).astype(dtype)


def as_float(kernel: Any, dtype) -> jax.Array:
  """A kernel value as a `dtype` array: an `Int8Kernel` dequantised, an array cast."""
  return dequantize(kernel, dtype) if isinstance(kernel, Int8Kernel) else kernel.astype(dtype)


def shardings(kernel_sharding: jax.sharding.Sharding) -> Int8Kernel:
  """The shardings of a kernel's (q, scale): q as the kernel, scale as its output axis."""
  if isinstance(kernel_sharding, NamedSharding):
    spec = tuple(kernel_sharding.spec) + (None, None)
    return Int8Kernel(q=kernel_sharding, scale=NamedSharding(
        kernel_sharding.mesh, PartitionSpec(spec[1]), memory_kind=kernel_sharding.memory_kind))
  return Int8Kernel(q=kernel_sharding, scale=kernel_sharding)


__all__ = ["Int8Kernel", "quantize", "dequantize", "as_float", "shardings"]
