"""Small helpers shared by the Pallas GPU and TPU LM-head kernels."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def cdiv(a, b):
  return -(-a // b)


def precision(dtype):
  """fp32 inputs: exact fp32 matmuls (HIGHEST); bf16: the hardware default."""
  return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def dot(a, b, ca, cb, precision):
  """a . b contracting a's axis `ca` with b's axis `cb`, accumulated in fp32."""
  return lax.dot_general(a, b, (((ca,), (cb,)), ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)
