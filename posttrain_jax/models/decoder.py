"""Decoder-only transformer (Llama 3.x / Qwen2 / Qwen3) in Flax NNX.

    h_0 = E[x]
    h_l = h_{l-1} + Attn(RMSNorm(h_{l-1}));  h_l = h_l + SwiGLU(RMSNorm(h_l))
    out = RMSNorm(h_L)                      (final hidden states, what `__call__` returns)
    logits = out @ W_head                   (separate: training never materialises them)

Attention is grouped-query (H query heads share H/KV key/value heads), with RoPE on q and k
(after a per-head RMSNorm in Qwen3). One mask serves training and decoding: a query at
slot i attends to key slot j iff j <= i, both carry the same non-zero segment id -- or key
j's segment is query i's shared prefix (`prefix_ids[i]`, training only: the sequences of a
group attend one copy of their prompt, batching.py). Packed sequences therefore never see
each other, padding (segment 0) is never attended, and a KV cache is just more key slots,
written at `cache.index`.

Module and parameter names mirror HF's checkpoint names (`model.layers.3.self_attn.q_proj`),
so HF I/O is a mechanical rename plus a transpose of each `kernel` ([in, out] here,
[out, in] in HF). Every parameter carries its logical axes as metadata (`axes=`).

A projection may carry LoRA adapters (models/lora.py attaches them): y = x W + s·dropout(x) A B.
`dropout_rng` (training only) is split per layer and per projection; None = no dropout.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from posttrain_jax import sharding as shd
from posttrain_jax.models.config import ModelConfig
from posttrain_jax.models.quant import as_float
from posttrain_jax.models.rope import apply_rope, cos_sin, inv_frequencies

_NEG_INF = -1e30  # finite: a fully masked row (a padding query) gives a uniform softmax, not NaN


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """Per-layer keys/values [B, S, KV, head_dim], segment id per slot [B, S] (0 = empty)."""
  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  segment_ids: jax.Array
  index: jax.Array  # int32 scalar: the next slot to write

  @property
  def max_len(self) -> int:
    return self.segment_ids.shape[1]


def init_cache(cfg: ModelConfig, batch: int, max_len: int) -> KVCache:
  shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
  zeros = lambda: jnp.zeros(shape, cfg.compute_jnp_dtype)
  return KVCache(k=tuple(zeros() for _ in range(cfg.num_layers)),
                 v=tuple(zeros() for _ in range(cfg.num_layers)),
                 segment_ids=jnp.zeros((batch, max_len), jnp.int32),
                 index=jnp.zeros((), jnp.int32))


def _normal(rngs: nnx.Rngs, shape, dtype, std=0.02):
  return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


def _keys(rng: Optional[jax.Array], n: int) -> tuple:
  """n independent keys from `rng`, or n Nones without one."""
  return (None,) * n if rng is None else tuple(jax.random.split(rng, n))


class Linear(nnx.Module):
  """y = x @ kernel (+ bias) + s · dropout(x) @ lora_a @ lora_b; kernel [in, out] with logical
  axes `axes`. The adapter term only where models/lora.py attached one (lora_a [in, r], lora_b
  [r, out], s = lora_scale, dropout rate lora_dropout, applied only when given a key). The
  kernel's value may be a quant.Int8Kernel (LoRA's int8 base): dequantised here, per call."""

  def __init__(self, din: int, dout: int, *, bias: bool, axes: tuple[str, str],
               cfg: ModelConfig, rngs: nnx.Rngs):
    self.kernel = nnx.Param(_normal(rngs, (din, dout), cfg.param_jnp_dtype), axes=axes)
    self.bias = (nnx.Param(jnp.zeros((dout,), cfg.param_jnp_dtype), axes=axes[1:])
                 if bias else None)
    self.dtype = cfg.compute_jnp_dtype
    self.lora_a = self.lora_b = nnx.data(None)  # LoRA adapters (models/lora.py); None = none
    self.lora_scale, self.lora_dropout = 0.0, 0.0

  def __call__(self, x: jax.Array, rng: Optional[jax.Array] = None) -> jax.Array:
    # As one 2-D matmul: XLA:CPU runs the [rows, in] x [in, out] product and its two backward
    # products about twice as fast as the 3-D dot_general (measured on the tiny model).
    kernel = as_float(self.kernel.get_value(), self.dtype)
    x2 = x.astype(self.dtype).reshape(-1, x.shape[-1])
    y = jnp.dot(x2, kernel)
    if self.lora_a is not None:
      y = y + self._adapter(x2, rng)
    y = y.reshape(*x.shape[:-1], kernel.shape[-1])
    if self.bias is not None:
      y = y + self.bias[...].astype(self.dtype)
    return y

  def _adapter(self, x2: jax.Array, rng: Optional[jax.Array]) -> jax.Array:
    """s · dropout(x) A B for [rows, in] x (inverted dropout: kept inputs scaled by 1/(1-p))."""
    p = self.lora_dropout
    if rng is not None and p > 0:
      keep = jax.random.bernoulli(rng, 1.0 - p, x2.shape)
      x2 = jnp.where(keep, x2 / (1.0 - p), 0.0).astype(x2.dtype)
    a, b = self.lora_a[...].astype(self.dtype), self.lora_b[...].astype(self.dtype)
    return jnp.dot(jnp.dot(x2, a), b) * jnp.asarray(self.lora_scale, self.dtype)


class RMSNorm(nnx.Module):
  """y = x / sqrt(mean(x^2) + eps) * scale, the statistic in float32."""

  def __init__(self, dim: int, *, eps: float, axes: tuple[str], cfg: ModelConfig):
    self.scale = nnx.Param(jnp.ones((dim,), cfg.param_jnp_dtype), axes=axes)
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return self.scale[...].astype(x.dtype) * y.astype(x.dtype)


class Attention(nnx.Module):
  """Grouped-query self-attention with RoPE (+ q/k RMSNorm for Qwen3)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, mesh: Optional[Mesh], rules):
    d, h, kv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.q_proj = Linear(d, h * hd, bias=cfg.qkv_bias, axes=("embed", "heads"), cfg=cfg, rngs=rngs)
    self.k_proj = Linear(d, kv * hd, bias=cfg.qkv_bias, axes=("embed", "kv_heads"), cfg=cfg, rngs=rngs)
    self.v_proj = Linear(d, kv * hd, bias=cfg.qkv_bias, axes=("embed", "kv_heads"), cfg=cfg, rngs=rngs)
    self.o_proj = Linear(h * hd, d, bias=cfg.o_bias, axes=("heads", "embed"), cfg=cfg, rngs=rngs)
    if cfg.qk_norm:
      self.q_norm = RMSNorm(hd, eps=cfg.rms_norm_eps, axes=("head_dim",), cfg=cfg)
      self.k_norm = RMSNorm(hd, eps=cfg.rms_norm_eps, axes=("head_dim",), cfg=cfg)
    else:
      self.q_norm = self.k_norm = None
    self.num_heads, self.num_kv_heads, self.head_dim = h, kv, hd
    self.mesh, self.rules = mesh, rules

  def __call__(self, x_btd, cos, sin, mask_bts, kv_cache=None, index=None, rng=None):
    b, t, _ = x_btd.shape
    rq, rk, rv, ro = _keys(rng, 4)
    q = self.q_proj(x_btd, rq).reshape(b, t, self.num_heads, self.head_dim)
    k = self.k_proj(x_btd, rk).reshape(b, t, self.num_kv_heads, self.head_dim)
    v = self.v_proj(x_btd, rv).reshape(b, t, self.num_kv_heads, self.head_dim)
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    q = shd.shard(q, ("batch", "length", "act_heads", None), self.mesh, self.rules)
    if kv_cache is not None:
      k_all, v_all = kv_cache
      k = jax.lax.dynamic_update_slice(k_all, k.astype(k_all.dtype), (0, index, 0, 0))
      v = jax.lax.dynamic_update_slice(v_all, v.astype(v_all.dtype), (0, index, 0, 0))
    new_kv = (k, v)
    # GQA: the G query heads of a kv head are stacked along the query axis, so each score
    # matmul is one [G*T, hd] x [hd, S] product per (batch, kv head) -- fewer, larger matmuls.
    kv, group, hd, s_len = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim, k.shape[1]
    q = q.reshape(b, t, kv, group, hd).transpose(0, 2, 3, 1, 4).reshape(b, kv, group * t, hd)
    scores = jnp.einsum("bkqd,bskd->bkqs", q, k.astype(q.dtype),
                        preferred_element_type=jnp.float32) * (hd ** -0.5)
    scores = jnp.where(mask_bts[:, None, None], scores.reshape(b, kv, group, t, s_len), _NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype).reshape(b, kv, group * t, s_len)
    out = jnp.einsum("bkqs,bskd->bkqd", probs, v.astype(q.dtype))
    out = out.reshape(b, kv, group, t, hd).transpose(0, 3, 1, 2, 4).reshape(b, t, kv * group * hd)
    return self.o_proj(out, ro), new_kv


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, mesh: Optional[Mesh], rules):
    d, f = cfg.hidden_size, cfg.intermediate_size
    self.gate_proj = Linear(d, f, bias=cfg.mlp_bias, axes=("embed", "mlp"), cfg=cfg, rngs=rngs)
    self.up_proj = Linear(d, f, bias=cfg.mlp_bias, axes=("embed", "mlp"), cfg=cfg, rngs=rngs)
    self.down_proj = Linear(f, d, bias=cfg.mlp_bias, axes=("mlp", "embed"), cfg=cfg, rngs=rngs)
    self.mesh, self.rules = mesh, rules

  def __call__(self, x, rng=None):
    rg, ru, rd = _keys(rng, 3)
    hidden = jax.nn.silu(self.gate_proj(x, rg)) * self.up_proj(x, ru)
    hidden = shd.shard(hidden, ("batch", "length", "act_mlp"), self.mesh, self.rules)
    return self.down_proj(hidden, rd)


class Block(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, mesh: Optional[Mesh], rules):
    self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, axes=("norm",), cfg=cfg)
    self.self_attn = Attention(cfg, rngs, mesh, rules)
    self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps,
                                            axes=("norm",), cfg=cfg)
    self.mlp = MLP(cfg, rngs, mesh, rules)
    self.mesh, self.rules = mesh, rules

  def __call__(self, x, cos, sin, mask, kv_cache=None, index=None, rng=None):
    ra, rm = _keys(rng, 2)
    attn, new_kv = self.self_attn(self.input_layernorm(x), cos, sin, mask, kv_cache, index, ra)
    x = x + attn
    x = x + self.mlp(self.post_attention_layernorm(x), rm)
    return shd.shard(x, ("batch", "length", "act_embed"), self.mesh, self.rules), new_kv


def _block_call(block, x, cos, sin, mask, rng):
  return block(x, cos, sin, mask, rng=rng)[0]


class Decoder(nnx.Module):
  """The whole model. `__call__` returns final hidden states; `lm_head_weight` the head."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, mesh: Optional[Mesh] = None,
               rules=shd.DEFAULT_RULES):
    self.cfg = cfg
    self.embed_tokens = nnx.Param(
        _normal(rngs, (cfg.vocab_size, cfg.hidden_size), cfg.param_jnp_dtype),
        axes=("vocab", "embed"))
    self.layers = nnx.List([Block(cfg, rngs, mesh, rules) for _ in range(cfg.num_layers)])
    self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, axes=("norm",), cfg=cfg)
    self.lm_head = (None if cfg.tie_word_embeddings else
                    Linear(cfg.hidden_size, cfg.vocab_size, bias=False, axes=("embed", "vocab"),
                           cfg=cfg, rngs=rngs))
    self.mesh, self.rules = mesh, rules

  def __call__(self, input_ids_bt: jax.Array, positions_bt: jax.Array,
               segment_ids_bt: Optional[jax.Array] = None,
               cache: Optional[KVCache] = None,
               prefix_ids_bt: Optional[jax.Array] = None,
               dropout_rng: Optional[jax.Array] = None) -> tuple[jax.Array, Optional[KVCache]]:
    """Final hidden states [B, T, D] (compute dtype) and the updated cache (or None).
    `prefix_ids_bt`: per query slot, a segment whose earlier slots it also attends (0 = none).
    `dropout_rng`: the key of the LoRA adapters' dropout (training, no cache); None = none."""
    cfg = self.cfg
    b, t = input_ids_bt.shape
    if segment_ids_bt is None:
      segment_ids_bt = jnp.ones((b, t), jnp.int32)
    x = jnp.take(self.embed_tokens[...], input_ids_bt, axis=0).astype(cfg.compute_jnp_dtype)
    x = shd.shard(x, ("batch", "length", "act_embed"), self.mesh, self.rules)
    cos, sin = cos_sin(positions_bt, inv_frequencies(cfg))
    if cache is None:
      q_slot, kv_slot, kv_seg = jnp.arange(t), jnp.arange(t), segment_ids_bt
    else:
      kv_seg = jax.lax.dynamic_update_slice(cache.segment_ids, segment_ids_bt, (0, cache.index))
      q_slot, kv_slot = cache.index + jnp.arange(t), jnp.arange(cache.max_len)
    same = segment_ids_bt[:, :, None] == kv_seg[:, None, :]
    if prefix_ids_bt is not None:
      same = same | (prefix_ids_bt[:, :, None] == kv_seg[:, None, :])
    mask = same & (kv_seg[:, None, :] != 0) & (q_slot[:, None] >= kv_slot[None, :])[None]
    if cache is None:
      call = nnx.remat(_block_call) if cfg.remat else _block_call
      for i, layer in enumerate(self.layers):
        rng = None if dropout_rng is None else jax.random.fold_in(dropout_rng, i)
        x = call(layer, x, cos, sin, mask, rng)
      return self.norm(x), None
    ks, vs = [], []
    for i, layer in enumerate(self.layers):
      x, (k, v) = layer(x, cos, sin, mask, (cache.k[i], cache.v[i]), cache.index)
      ks.append(k)
      vs.append(v)
    new_cache = KVCache(k=tuple(ks), v=tuple(vs), segment_ids=kv_seg, index=cache.index + t)
    return self.norm(x), new_cache

  def head(self) -> tuple[jax.Array, bool]:
    """(weight, transposed): [D, V] untied head, or the [V, D] embedding with transposed=True.

    The layout the fused LM-head kernels take, so a tied head is never copied.
    """
    if self.lm_head is None:
      return self.embed_tokens[...], True
    return self.lm_head.kernel[...], False

  def lm_head_weight(self) -> jax.Array:
    """The LM head as [D, V] (the embedding transposed when tied)."""
    if self.lm_head is None:
      return self.embed_tokens[...].T
    return self.lm_head.kernel[...]

  def logits(self, hidden_btd: jax.Array) -> jax.Array:
    """Materialised logits [..., V] in float32 (sampling and tests; not the training path)."""
    w = self.lm_head_weight().astype(hidden_btd.dtype)
    return jnp.dot(hidden_btd, w, preferred_element_type=jnp.float32)
