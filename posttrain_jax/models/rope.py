"""Rotary position embeddings (RoPE) in HF's "rotate-half" layout.

    inv_freq_i = theta^(-2i/d),  i = 0..d/2-1
    angle(p)   = p * inv_freq;  cos/sin repeated twice to width d
    rope(x, p) = x * cos(p) + rotate_half(x) * sin(p),  rotate_half([a, b]) = [-b, a]

Scalings: "linear" divides inv_freq by `factor`; "llama3" (Llama 3.1) divides the low
frequencies by `factor`, keeps the high ones and interpolates smoothly in between.
HF checkpoints already store q/k projections in this layout: no weight permutation needed.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from posttrain_jax.models.config import ModelConfig


def inv_frequencies(cfg: ModelConfig) -> np.ndarray:
  """[head_dim // 2] float32 inverse frequencies, with the config's scaling applied."""
  d = cfg.head_dim
  inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))
  inv = inv.astype(np.float32)
  params = dict(cfg.rope_scaling)
  kind = params.get("rope_type", "default")
  if kind == "linear":
    inv = inv / np.float32(params["factor"])
  elif kind == "llama3":
    factor = params["factor"]
    lo, hi = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old_len / lo, inv / factor, inv)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / hi) & ~(wavelen > old_len / lo)
    inv = np.where(medium, smoothed, scaled).astype(np.float32)
  return inv


def cos_sin(positions_bt: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
  """cos, sin of shape [B, T, head_dim] (float32)."""
  angles = positions_bt.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
  angles = jnp.concatenate([angles, angles], axis=-1)
  return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x_bthd: jax.Array, cos_btd: jax.Array, sin_btd: jax.Array) -> jax.Array:
  """Rotates x [B, T, H, head_dim]; computed in float32, returned in x's dtype."""
  x = x_bthd.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  out = x * cos_btd[:, :, None, :] + rotated * sin_btd[:, :, None, :]
  return out.astype(x_bthd.dtype)
