"""Pallas GPU (Triton) kernels for the LM-head log-probs (math in lm_head.py).

Forward, grid (row block i, vocabulary split s): each program walks its share of the vocab
tiles, computes z = h_i W_j / tau tile by tile (a loop over D blocks feeds the tensor cores),
and keeps an online (max, sum exp, shifted entropy sum, target logit) per row. The S partial
states per row are merged in XLA (split-K / "flash decoding" style), so small N still fills the
GPU. Backward, same grid: recompute the z tile, form dz, then for each D block atomically add
dz W_j^T into dh and h_i^T dz into dW (Cut Cross-Entropy style; fp32 accumulators padded to
block multiples, so every atomic is in bounds). FLOPs: 2·N·D·V forward, 6·N·D·V backward.

Every load is masked (other=0) against the true N / D / V, and logits of columns >= V are set
to NEG, so any N, D, V works; the block sizes themselves must be powers of two for Triton.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import _pallas_common as _common

from . import online_softmax

NEG = online_softmax.NEG


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes (powers of two on a real GPU; any size in interpret mode).

  block_n: token rows per program.  block_v: vocab columns per logit tile.
  block_d: hidden-size slice per matmul step.  vocab_splits: programs along V per row block.
  num_warps / num_stages: Triton compiler parameters.
  """
  block_n: int = 64
  block_v: int = 128
  block_d: int = 64
  vocab_splits: int = 16
  num_warps: int = 4
  num_stages: int = 2

  @classmethod
  def get_default(cls, backend: str | None = None) -> "BlockSizes":
    del backend
    return cls()


_cdiv, _precision, _dot = _common.cdiv, _common.precision, _common.dot


def _logit_tile(h_ref, w_ref, r0, c0, row_ok, col_ok, *, d, bd, transposed, precision):
  """fp32 [bn, bv] = h[r0:r0+bn] @ W[:, c0:c0+bv], masked loads (zeros outside N/D/V)."""
  bn, bv = row_ok.shape[0], col_ok.shape[0]

  def step(kb, acc):
    d_ok = kb * bd + jnp.arange(bd) < d
    hb = plgpu.load(h_ref.at[pl.ds(r0, bn), pl.ds(kb * bd, bd)],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if transposed:
      wb = plgpu.load(w_ref.at[pl.ds(c0, bv), pl.ds(kb * bd, bd)],
                      mask=col_ok[:, None] & d_ok[None, :], other=0.0)
      return acc + _dot(hb, wb, 1, 1, precision)
    wb = plgpu.load(w_ref.at[pl.ds(kb * bd, bd), pl.ds(c0, bv)],
                    mask=d_ok[:, None] & col_ok[None, :], other=0.0)
    return acc + _dot(hb, wb, 1, 0, precision)

  return lax.fori_loop(0, _cdiv(d, bd), step, jnp.zeros((bn, bv), jnp.float32))


def _fwd_kernel(h_ref, w_ref, y_ref, m_ref, r_ref, a_ref, zy_ref, *, n, d, v, inv_tau,
                transposed, bn, bv, bd, tiles_per_split, precision):
  i, s = pl.program_id(0), pl.program_id(1)
  r0 = i * bn
  row_ok = r0 + jnp.arange(bn) < n
  y = y_ref[...]
  j0 = s * tiles_per_split
  j1 = jnp.minimum(j0 + tiles_per_split, _cdiv(v, bv))

  def tile(j, carry):
    m, r, a, zy = carry
    cols = j * bv + jnp.arange(bv)
    col_ok = cols < v
    z = _logit_tile(h_ref, w_ref, r0, j * bv, row_ok, col_ok, d=d, bd=bd,
                    transposed=transposed, precision=precision) * inv_tau
    z = jnp.where(col_ok[None, :], z, NEG)
    zy = zy + jnp.sum(jnp.where(cols[None, :] == y[:, None], z, 0.0), axis=1)
    return (*online_softmax.update(m, r, a, z), zy)

  init = (*online_softmax.init((bn,)), jnp.zeros((bn,), jnp.float32))
  m, r, a, zy = lax.fori_loop(j0, j1, tile, init)
  m_ref[...] = m
  r_ref[...] = r
  a_ref[...] = a
  zy_ref[...] = zy


def _plan(n, v, bs):
  bn = bs.block_n
  n_pad = _cdiv(n, bn) * bn
  n_vt = _cdiv(v, bs.block_v)
  splits = max(1, min(bs.vocab_splits, n_vt))
  tps = _cdiv(n_vt, splits)
  splits = _cdiv(n_vt, tps)
  return bn, n_pad, n_vt, splits, tps


@functools.partial(jax.jit, static_argnames=("inv_tau", "transposed", "bs", "interpret"))
def forward(h, w, y, *, inv_tau: float, transposed: bool, bs: BlockSizes, interpret: bool = False):
  """(logp, lse, entropy) fp32 [N]."""
  n, d = h.shape
  v = w.shape[0] if transposed else w.shape[1]
  bn, n_pad, _, splits, tps = _plan(n, v, bs)
  y_pad = jnp.pad(y.astype(jnp.int32), (0, n_pad - n))
  kernel = functools.partial(
      _fwd_kernel, n=n, d=d, v=v, inv_tau=inv_tau, transposed=transposed, bn=bn,
      bv=bs.block_v, bd=bs.block_d, tiles_per_split=tps, precision=_precision(h.dtype))
  part = jax.ShapeDtypeStruct((splits, n_pad), jnp.float32)
  part_spec = pl.BlockSpec((None, bn), lambda i, s: (s, i))
  m, r, a, zy = pl.pallas_call(
      kernel,
      grid=(n_pad // bn, splits),
      in_specs=[pl.BlockSpec(h.shape, lambda i, s: (0, 0)),
                pl.BlockSpec(w.shape, lambda i, s: (0, 0)),
                pl.BlockSpec((bn,), lambda i, s: (i,))],
      out_specs=[part_spec] * 4,
      out_shape=[part] * 4,
      compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
      interpret=interpret,
      name="lm_head_logprob_fwd",
  )(h, w, y_pad)
  mm, rr, aa = online_softmax.merge(m[:, :n], r[:, :n], a[:, :n], axis=0)
  return online_softmax.finalize(mm, rr, aa, jnp.sum(zy[:, :n], axis=0))


def _bwd_kernel(h_ref, w_ref, y_ref, lse_ref, g_ref, ca_ref, cb_ref, dh_in, dw_in, dh_ref, dw_ref,
                *, n, d, v, inv_tau, transposed, bn, bv, bd, tiles_per_split, precision):
  del dh_in, dw_in  # aliased to dh_ref / dw_ref (zero-initialised accumulators)
  i, s = pl.program_id(0), pl.program_id(1)
  r0 = i * bn
  row_ok = r0 + jnp.arange(bn) < n
  y, lse, g, ca, cb = y_ref[...], lse_ref[...], g_ref[...], ca_ref[...], cb_ref[...]
  j0 = s * tiles_per_split
  j1 = jnp.minimum(j0 + tiles_per_split, _cdiv(v, bv))

  def tile(j, carry):
    c0 = j * bv
    cols = c0 + jnp.arange(bv)
    col_ok = cols < v
    z = _logit_tile(h_ref, w_ref, r0, c0, row_ok, col_ok, d=d, bd=bd,
                    transposed=transposed, precision=precision) * inv_tau
    zc = z - lse[:, None]
    dz = (jnp.where(cols[None, :] == y[:, None], g[:, None], 0.0)
          - jnp.exp(zc) * (ca[:, None] + cb[:, None] * zc))
    dz = jnp.where(row_ok[:, None] & col_ok[None, :], dz, 0.0) * inv_tau

    def dstep(kb, carry):
      k0 = kb * bd
      d_ok = k0 + jnp.arange(bd) < d
      hb = plgpu.load(h_ref.at[pl.ds(r0, bn), pl.ds(k0, bd)],
                      mask=row_ok[:, None] & d_ok[None, :], other=0.0)
      dzh = dz.astype(hb.dtype)
      if transposed:
        wb = plgpu.load(w_ref.at[pl.ds(c0, bv), pl.ds(k0, bd)],
                        mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        dh_part = _dot(dz.astype(wb.dtype), wb, 1, 0, precision)      # [bn, bd]
        dw_part = _dot(dzh, hb, 0, 0, precision)                      # [bv, bd]
        plgpu.atomic_add(dw_ref, (pl.ds(c0, bv), pl.ds(k0, bd)), dw_part)
      else:
        wb = plgpu.load(w_ref.at[pl.ds(k0, bd), pl.ds(c0, bv)],
                        mask=d_ok[:, None] & col_ok[None, :], other=0.0)
        dh_part = _dot(dz.astype(wb.dtype), wb, 1, 1, precision)      # [bn, bd]
        dw_part = _dot(hb, dzh, 0, 0, precision)                      # [bd, bv]
        plgpu.atomic_add(dw_ref, (pl.ds(k0, bd), pl.ds(c0, bv)), dw_part)
      plgpu.atomic_add(dh_ref, (pl.ds(r0, bn), pl.ds(k0, bd)), dh_part)
      return carry

    lax.fori_loop(0, _cdiv(d, bd), dstep, 0)
    return carry

  lax.fori_loop(j0, j1, tile, 0)


@functools.partial(jax.jit, static_argnames=("inv_tau", "transposed", "bs", "interpret"))
def backward(h, w, y, lse, g, coef_a, coef_b, *, inv_tau: float, transposed: bool,
             bs: BlockSizes, interpret: bool = False):
  """fp32 (dh, dW) for dz = g [v = y] - p (a + b (z - lse))."""
  n, d = h.shape
  v = w.shape[0] if transposed else w.shape[1]
  bn, n_pad, n_vt, splits, tps = _plan(n, v, bs)
  bv, bd = bs.block_v, bs.block_d
  d_pad, v_pad = _cdiv(d, bd) * bd, n_vt * bv
  pad = lambda x: jnp.pad(x, (0, n_pad - n))
  rows = [pad(y.astype(jnp.int32))] + [pad(x.astype(jnp.float32)) for x in (lse, g, coef_a, coef_b)]
  dh0 = jnp.zeros((n_pad, d_pad), jnp.float32)
  dw0 = jnp.zeros((v_pad, d_pad) if transposed else (d_pad, v_pad), jnp.float32)
  kernel = functools.partial(
      _bwd_kernel, n=n, d=d, v=v, inv_tau=inv_tau, transposed=transposed, bn=bn, bv=bv, bd=bd,
      tiles_per_split=tps, precision=_precision(h.dtype))
  full = lambda x: pl.BlockSpec(x.shape, lambda i, s: (0,) * x.ndim)
  row_spec = pl.BlockSpec((bn,), lambda i, s: (i,))
  dh, dw = pl.pallas_call(
      kernel,
      grid=(n_pad // bn, splits),
      in_specs=[full(h), full(w)] + [row_spec] * 5 + [full(dh0), full(dw0)],
      out_specs=[full(dh0), full(dw0)],
      out_shape=[jax.ShapeDtypeStruct(dh0.shape, jnp.float32),
                 jax.ShapeDtypeStruct(dw0.shape, jnp.float32)],
      input_output_aliases={7: 0, 8: 1},
      compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
      interpret=interpret,
      name="lm_head_logprob_bwd",
  )(h, w, *rows, dh0, dw0)
  dw = dw[:v, :d] if transposed else dw[:d, :v]
  return dh[:n, :d], dw
