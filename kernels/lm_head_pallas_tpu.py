"""Pallas TPU (Mosaic) kernels for the LM-head log-probs (math in lm_head.py).

Forward, grid (row block i "parallel", vocab tile j "arbitrary"): blocks h_i [bn, D] and
W_j [D, bv] are DMA'd to VMEM by the pipeline; z = h_i W_j / tau on the MXU; an online
(max, sum exp, shifted entropy sum, target logit) per row lives in VMEM scratch and is written
(the output blocks, resident across j, are the accumulators); log1p & co. run in XLA after the kernel. Backward, two kernels (no atomics on TPU): dh with grid (i, j) accumulating
dz W_j^T over j in scratch, and dW with grid (j, i) accumulating h_i^T dz over i; both recompute
the z tile, so the backward costs 8·N·D·V FLOPs (10·N·D·V in all, against 8 for the GPU
kernel with atomics). D is not tiled: a [bn, D] and a [D, bv] block must fit VMEM.

Partial edge blocks (N % bn, V % bv) hold undefined values on TPU (NaN in interpret mode):
logits of columns >= V are replaced by NEG, and W columns / h rows outside the array are
zeroed before they enter a matmul whose other operand was masked, so no garbage propagates.
Per-row vectors travel as [N, 1] arrays with (bn, 1) blocks.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import _pallas_common as _common

from . import online_softmax

NEG = online_softmax.NEG


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """block_n: token rows per block (multiple of 8).  block_v: vocab columns per tile (multiple of
  128).  vmem_limit_bytes: scoped VMEM limit handed to Mosaic (None: compiler default)."""
  block_n: int = 256
  block_v: int = 512
  vmem_limit_bytes: int | None = 64 * 1024 * 1024

  @classmethod
  def get_default(cls, backend: str | None = None) -> "BlockSizes":
    del backend
    return cls()


_cdiv, _precision, _dot = _common.cdiv, _common.precision, _common.dot


def _w_spec(d, bv, transposed, tile_axis):
  """BlockSpec of the W tile; tile_axis = which grid axis indexes the vocab tile."""
  if transposed:
    return pl.BlockSpec((bv, d), lambda *g: (g[tile_axis], 0))
  return pl.BlockSpec((d, bv), lambda *g: (0, g[tile_axis]))


def _clean_w(w, j, *, v, bv, transposed):
  """Zeroes W columns >= V (an edge tile) so undefined padding never meets a matmul."""
  if v % bv == 0:
    return w
  if transposed:
    ok = j * bv + lax.broadcasted_iota(jnp.int32, (bv, 1), 0) < v
  else:
    ok = j * bv + lax.broadcasted_iota(jnp.int32, (1, bv), 1) < v
  return jnp.where(ok, w, jnp.zeros_like(w))


def _z(h, w, j, *, inv_tau, v, bv, transposed, precision):
  z = _dot(h, w, 1, 1 if transposed else 0, precision) * inv_tau
  cols = j * bv + lax.broadcasted_iota(jnp.int32, z.shape, 1)
  if v % bv:
    z = jnp.where(cols < v, z, NEG)
  return z, cols


def _fwd_kernel(h_ref, w_ref, y_ref, m_ref, r_ref, a_ref, zy_ref, *, inv_tau, v, bv,
                transposed, precision):
  """Online softmax state of row block i over vocab tiles j; the [bn, 1] output blocks stay
  resident across j (same block index), so they double as the accumulators."""
  j = pl.program_id(1)

  @pl.when(j == 0)
  def _init():
    m0, r0, a0 = online_softmax.init(m_ref.shape)
    m_ref[...] = m0
    r_ref[...] = r0
    a_ref[...] = a0
    zy_ref[...] = jnp.zeros(zy_ref.shape, jnp.float32)

  z, cols = _z(h_ref[...], w_ref[...], j, inv_tau=inv_tau, v=v, bv=bv, transposed=transposed,
               precision=precision)
  m, r, a = online_softmax.update(m_ref[...], r_ref[...], a_ref[...], z, keepdims=True)
  m_ref[...] = m
  r_ref[...] = r
  a_ref[...] = a
  zy_ref[...] += jnp.sum(jnp.where(cols == y_ref[...], z, 0.0), axis=1, keepdims=True)


def _params(bs, semantics):
  return pltpu.CompilerParams(dimension_semantics=semantics,
                              vmem_limit_bytes=bs.vmem_limit_bytes)


def _sizes(h, w, transposed, bs):
  n, d = h.shape
  v = w.shape[0] if transposed else w.shape[1]
  return n, d, v, min(bs.block_n, n), min(bs.block_v, v)


@functools.partial(jax.jit, static_argnames=("inv_tau", "transposed", "bs", "interpret"))
def forward(h, w, y, *, inv_tau: float, transposed: bool, bs: BlockSizes, interpret: bool = False):
  """(logp, lse, entropy) fp32 [N]."""
  n, d, v, bn, bv = _sizes(h, w, transposed, bs)
  kernel = functools.partial(_fwd_kernel, inv_tau=inv_tau, v=v, bv=bv, transposed=transposed,
                             precision=_precision(h.dtype))
  row = pl.BlockSpec((bn, 1), lambda i, j: (i, 0))
  out = jax.ShapeDtypeStruct((n, 1), jnp.float32)
  m, r, a, zy = pl.pallas_call(
      kernel,
      grid=(_cdiv(n, bn), _cdiv(v, bv)),
      in_specs=[pl.BlockSpec((bn, d), lambda i, j: (i, 0)), _w_spec(d, bv, transposed, 1), row],
      out_specs=[row] * 4,
      out_shape=[out] * 4,
      compiler_params=_params(bs, ("parallel", "arbitrary")),
      interpret=interpret,
      name="lm_head_logprob_fwd_tpu",
  )(h, w, y.astype(jnp.int32)[:, None])
  return online_softmax.finalize(m[:, 0], r[:, 0], a[:, 0], zy[:, 0])


def _dz(h, w, y, rc, j, *, inv_tau, v, bv, transposed, precision):
  """dL/d(h W) tile [bn, bv] (already divided by tau); rc = [lse, g, a, b] as [bn, 4]."""
  z, cols = _z(h, w, j, inv_tau=inv_tau, v=v, bv=bv, transposed=transposed, precision=precision)
  lse, g, a, b = (rc[:, k:k + 1] for k in range(4))
  zc = z - lse
  dz = jnp.where(cols == y, g, 0.0) - jnp.exp(zc) * (a + b * zc)
  if v % bv:
    dz = jnp.where(cols < v, dz, 0.0)
  return dz * inv_tau


def _dh_kernel(h_ref, w_ref, y_ref, rc_ref, dh_ref, acc_sc, *, inv_tau, v, bv, transposed,
               precision):
  j = pl.program_id(1)

  @pl.when(j == 0)
  def _init():
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  w = _clean_w(w_ref[...], j, v=v, bv=bv, transposed=transposed)
  dz = _dz(h_ref[...], w, y_ref[...], rc_ref[...], j, inv_tau=inv_tau, v=v, bv=bv,
           transposed=transposed, precision=precision)
  acc_sc[...] += _dot(dz.astype(w.dtype), w, 1, 0 if transposed else 1, precision)

  @pl.when(j == pl.num_programs(1) - 1)
  def _finish():
    dh_ref[...] = acc_sc[...]


def _dw_kernel(h_ref, w_ref, y_ref, rc_ref, dw_ref, acc_sc, *, inv_tau, n, bn, v, bv,
               transposed, precision):
  j, i = pl.program_id(0), pl.program_id(1)

  @pl.when(i == 0)
  def _init():
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  h = h_ref[...]
  if n % bn:
    row_ok = i * bn + lax.broadcasted_iota(jnp.int32, (h.shape[0], 1), 0) < n
    h = jnp.where(row_ok, h, jnp.zeros_like(h))
  dz = _dz(h, w_ref[...], y_ref[...], rc_ref[...], j, inv_tau=inv_tau, v=v, bv=bv,
           transposed=transposed, precision=precision)
  if n % bn:
    dz = jnp.where(row_ok, dz, 0.0)
  dzh = dz.astype(h.dtype)
  acc_sc[...] += _dot(dzh, h, 0, 0, precision) if transposed else _dot(h, dzh, 0, 0, precision)

  @pl.when(i == pl.num_programs(1) - 1)
  def _finish():
    dw_ref[...] = acc_sc[...]


@functools.partial(jax.jit, static_argnames=("inv_tau", "transposed", "bs", "interpret"))
def backward(h, w, y, lse, g, coef_a, coef_b, *, inv_tau: float, transposed: bool,
             bs: BlockSizes, interpret: bool = False):
  """fp32 (dh, dW) for dz = g [v = y] - p (a + b (z - lse))."""
  n, d, v, bn, bv = _sizes(h, w, transposed, bs)
  y2 = y.astype(jnp.int32)[:, None]
  rc = jnp.stack([x.astype(jnp.float32) for x in (lse, g, coef_a, coef_b)], axis=1)
  kw = dict(inv_tau=inv_tau, v=v, bv=bv, transposed=transposed, precision=_precision(h.dtype))
  nb, nv = _cdiv(n, bn), _cdiv(v, bv)

  dh = pl.pallas_call(
      functools.partial(_dh_kernel, **kw),
      grid=(nb, nv),
      in_specs=[pl.BlockSpec((bn, d), lambda i, j: (i, 0)), _w_spec(d, bv, transposed, 1),
                pl.BlockSpec((bn, 1), lambda i, j: (i, 0)),
                pl.BlockSpec((bn, 4), lambda i, j: (i, 0))],
      out_specs=pl.BlockSpec((bn, d), lambda i, j: (i, 0)),
      out_shape=jax.ShapeDtypeStruct((n, d), jnp.float32),
      scratch_shapes=[pltpu.VMEM((bn, d), jnp.float32)],
      compiler_params=_params(bs, ("parallel", "arbitrary")),
      interpret=interpret,
      name="lm_head_logprob_dh_tpu",
  )(h, w, y2, rc)

  dw_block = (bv, d) if transposed else (d, bv)
  dw = pl.pallas_call(
      functools.partial(_dw_kernel, n=n, bn=bn, **kw),
      grid=(nv, nb),
      in_specs=[pl.BlockSpec((bn, d), lambda j, i: (i, 0)), _w_spec(d, bv, transposed, 0),
                pl.BlockSpec((bn, 1), lambda j, i: (i, 0)),
                pl.BlockSpec((bn, 4), lambda j, i: (i, 0))],
      out_specs=pl.BlockSpec(dw_block, (lambda j, i: (j, 0)) if transposed
                             else (lambda j, i: (0, j))),
      out_shape=jax.ShapeDtypeStruct(w.shape, jnp.float32),
      scratch_shapes=[pltpu.VMEM(dw_block, jnp.float32)],
      compiler_params=_params(bs, ("parallel", "arbitrary")),
      interpret=interpret,
      name="lm_head_logprob_dw_tpu",
  )(h, w, y2, rc)
  return dh, dw
