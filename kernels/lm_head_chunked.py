"""XLA chunked LM-head passes: token chunks x vocabulary tiles, never an [N, V] array.

Two loop orders, chosen for what each pass must keep:

* generic passes (`forward`, `backward`, and the teacher passes): vocabulary tiles outside,
  token chunks inside. Per-row state (online max / sum / ...) is [N]-sized, each W tile is
  sliced once, dW tile j is accumulated locally ([D, tile]) and written once, dh ([N, D] fp32)
  is updated in place. Temporaries: a few [token_chunk, vocab_tile] fp32 tiles.
* the fused-loss pass (`fused_loss`): token chunks outside. A chunk's logit row block
  [fused_token_chunk, V] is computed by one matmul and kept; its softmax statistics are taken
  tile by tile, then log-probs and g = dloss/dlogp are known, and dh / dW are accumulated from
  the kept block in vocabulary tiles (Liger-style): 6·N·D·V FLOPs, temporaries [chunk, V]
  fp32 plus tiles, dW accumulated in place in an fp32 [D, V] carry.

V need not be a multiple of the tile: the last, narrower tile is a second static loop body.
N is padded to a multiple of the token chunk with zero rows (sliced off afterwards).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from . import online_softmax


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Chunk sizes of the XLA chunked path (CPU defaults; keep matmuls large).

  token_chunk: rows per inner step of the generic passes.
  vocab_tile: vocabulary columns per tile (all passes); the dW tile [D, vocab_tile] fp32 is a
    temporary too, so at D = 2048 a 8192 tile costs 64 MiB per buffer.
  fused_token_chunk: rows per chunk of the fused-loss pass; it keeps [chunk, V] fp32 logits
    (512 x 151,936 x 4 B = 311 MB).
  On a shared 2-core CPU at V = 151,936, N = 1024, D = 1024, one measurement had 1024 / 8192 /
  512 ~10% faster than 512 / 16384 / 256; at N = 8192, D = 2048 these defaults keep the
  fused path's temporaries ~30x below the materialised version (benchmarks/loss_kernel.py).
  """
  token_chunk: int = 1024
  vocab_tile: int = 8192
  fused_token_chunk: int = 512

  @classmethod
  def get_default(cls, backend: str | None = None) -> "BlockSizes":
    del backend  # same defaults everywhere for now; tune per backend here
    return cls()


# ----------------------------------------------------------------------------- helpers


def _dims_logits(transposed):  # h[n, d] x w -> [n, v]
  return (((1,), (1,)), ((), ())) if transposed else (((1,), (0,)), ((), ()))


def logits_tile(h, wt, transposed):
  """fp32 [n, width] = h @ W_tile (W_tile [D, width], or [width, D] when transposed)."""
  return lax.dot_general(h, wt, _dims_logits(transposed), preferred_element_type=jnp.float32)


def dh_tile(s, wt, transposed):
  """fp32 [n, D] = s @ W_tile^T."""
  dims = (((1,), (0,)), ((), ())) if transposed else (((1,), (1,)), ((), ()))
  return lax.dot_general(s.astype(wt.dtype), wt, dims, preferred_element_type=jnp.float32)


def dw_tile(h, s, transposed):
  """fp32 h^T @ s ([D, width]) or, transposed, s^T @ h ([width, D])."""
  if transposed:
    return lax.dot_general(s.astype(h.dtype), h, (((0,), (0,)), ((), ())),
                           preferred_element_type=jnp.float32)
  return lax.dot_general(h, s.astype(h.dtype), (((0,), (0,)), ((), ())),
                         preferred_element_type=jnp.float32)


def vocab_axis(transposed):
  return 0 if transposed else 1


def slice_vocab(w, start, width, transposed):
  return lax.dynamic_slice_in_dim(w, start, width, axis=vocab_axis(transposed))


def for_each_tile(vocab: int, tile: int, fn: Callable[[Any, Any, int], Any], carry):
  """carry = fn(carry, start, width) over [0, vocab) in tiles; the remainder is a static call."""
  tile = min(tile, vocab)
  n_full, rem = divmod(vocab, tile)
  if n_full == 1:
    carry = fn(carry, 0, tile)
  elif n_full > 1:
    carry = lax.fori_loop(0, n_full, lambda j, c: fn(c, j * tile, tile), carry)
  if rem:
    carry = fn(carry, n_full * tile, rem)
  return carry


def pad_rows(x, n_pad):
  if x.shape[0] == n_pad:
    return x
  return jnp.pad(x, [(0, n_pad - x.shape[0])] + [(0, 0)] * (x.ndim - 1))


@dataclasses.dataclass(frozen=True)
class Head:
  """A (hidden, weight) pair; `transposed` means w is [V, D]."""
  h: jax.Array
  w: jax.Array
  transposed: bool

  @property
  def vocab(self):
    return self.w.shape[vocab_axis(self.transposed)]


def tiled_pass(heads: tuple[Head, ...], rows, state, tile_fn, *, inv_tau: float, bs: BlockSizes):
  """Runs state_c = tile_fn(zs, rows_c, state_c, start, width) over vocab tiles x token chunks.

  heads: one or two Heads with the same N and V (student, teacher); zs is the tuple of their
  fp32 [chunk, width] logits tiles, already divided by tau. rows / state are pytrees of arrays
  with a leading N axis (rows: read-only inputs, state: carried). Returns the final state.
  """
  n = heads[0].h.shape[0]
  nc = min(bs.token_chunk, n)
  n_chunks = -(-n // nc)
  npad = n_chunks * nc
  hs = [pad_rows(hd.h, npad) for hd in heads]
  rows = jax.tree.map(lambda x: pad_rows(x, npad), rows)
  state = jax.tree.map(lambda x: pad_rows(x, npad), state)
  vocab = heads[0].vocab

  def tile(state, start, width):
    wts = [slice_vocab(hd.w, start, width, hd.transposed) for hd in heads]

    def chunk(c, state):
      r0 = c * nc
      take = lambda x: lax.dynamic_slice_in_dim(x, r0, nc, axis=0)
      zs = tuple(logits_tile(take(h), wt, hd.transposed) * inv_tau
                 for h, wt, hd in zip(hs, wts, heads))
      new = tile_fn(zs, jax.tree.map(take, rows), jax.tree.map(take, state), start, width)
      return jax.tree.map(lambda s, v: lax.dynamic_update_slice_in_dim(s, v, r0, axis=0),
                          state, new)

    return chunk(0, state) if n_chunks == 1 else lax.fori_loop(0, n_chunks, chunk, state)

  state = for_each_tile(vocab, bs.vocab_tile, tile, state)
  return jax.tree.map(lambda x: x[:n], state)


def tiled_grad(heads: tuple[Head, ...], rows, dz_fn, *, inv_tau: float, bs: BlockSizes):
  """(dh, dW) of the first head, fp32, for dlogits = dz_fn(zs, rows_c, start, width) * inv_tau.

  dz_fn returns the gradient w.r.t. the tempered logits z = (h @ W) / tau of the first head
  ([chunk, width] fp32); it must be 0 on padded rows (their row inputs are zero-padded).
  """
  student = heads[0]
  n, d = student.h.shape
  nc = min(bs.token_chunk, n)
  n_chunks = -(-n // nc)
  npad = n_chunks * nc
  hs = [pad_rows(hd.h, npad) for hd in heads]
  rows = jax.tree.map(lambda x: pad_rows(x, npad), rows)
  vocab = student.vocab
  tr = student.transposed

  def tile(carry, start, width):
    dh, dw = carry
    wts = [slice_vocab(hd.w, start, width, hd.transposed) for hd in heads]

    def chunk(c, carry):
      dh, dwt = carry
      r0 = c * nc
      take = lambda x: lax.dynamic_slice_in_dim(x, r0, nc, axis=0)
      hcs = [take(h) for h in hs]
      zs = tuple(logits_tile(hc, wt, hd.transposed) * inv_tau
                 for hc, wt, hd in zip(hcs, wts, heads))
      s = dz_fn(zs, jax.tree.map(take, rows), start, width) * inv_tau
      dh_c = take(dh) + dh_tile(s, wts[0], tr)
      dh = lax.dynamic_update_slice_in_dim(dh, dh_c, r0, axis=0)
      return dh, dwt + dw_tile(hcs[0], s, tr)

    dwt = jnp.zeros(wts[0].shape, jnp.float32)
    init = (dh, dwt)
    dh, dwt = chunk(0, init) if n_chunks == 1 else lax.fori_loop(0, n_chunks, chunk, init)
    dw = lax.dynamic_update_slice_in_dim(dw, dwt, start, axis=vocab_axis(tr))
    return dh, dw

  dh = jnp.zeros((npad, d), jnp.float32)
  dw = jnp.zeros(student.w.shape, jnp.float32)
  dh, dw = for_each_tile(vocab, bs.vocab_tile, tile, (dh, dw))
  return dh[:n], dw


def add_sparse(dense, ids_nk, coef_nk, start, width):
  """dense [n, width] + coef at (row, ids - start) for the ids inside this tile (a scatter-add:
  cheaper on CPU than comparing every element with the target id)."""
  n, k = ids_nk.shape
  local = ids_nk - start
  inside = (local >= 0) & (local < width)
  local = jnp.where(inside, local, width)  # out of range -> dropped
  rows = jnp.broadcast_to(jnp.arange(n)[:, None], (n, k))
  return dense.at[rows, local].add(coef_nk.astype(dense.dtype), mode="drop")


# ----------------------------------------------------------------------------- log-probs


def forward(h, w, y, *, inv_tau: float, transposed: bool, bs: BlockSizes):
  """(logp, lse, entropy) fp32 [N] via online softmax statistics over vocab tiles (2·N·D·V)."""
  n = h.shape[0]
  state = (*online_softmax.init((n,)), jnp.zeros((n,), jnp.float32))  # m, r, a, z_y

  def tile_fn(zs, y_c, st, start, width):
    (z,) = zs
    m, r, a, zy = st
    loc = y_c - start
    inside = (loc >= 0) & (loc < width)
    pick = jnp.take_along_axis(z, jnp.clip(loc, 0, width - 1)[:, None], axis=1)[:, 0]
    return (*online_softmax.update(m, r, a, z, separate_reductions=True),
            zy + jnp.where(inside, pick, 0.0))

  state = tiled_pass((Head(h, w, transposed),), y, state, tile_fn, inv_tau=inv_tau, bs=bs)
  return online_softmax.finalize(*state)


def backward(h, w, ids_nk, coef_nk, lse, coef_a, coef_b, *, inv_tau: float, transposed: bool,
             bs: BlockSizes):
  """(dh, dW) fp32 for dz = sparse(ids, coef) - p * (a + b * (z - lse)) (8·N·D·V in all).

  With ids = y[:, None], coef = g_logp, a = g_logp - g_lse + g_H * H, b = g_H this is the
  cotangent of (logp, lse, entropy); see lm_head.py for the derivation.
  """
  rows = (ids_nk, coef_nk, lse, coef_a, coef_b)

  def dz_fn(zs, r, start, width):
    (z,) = zs
    ids, coef, lse_c, a, b = r
    zc = z - lse_c[:, None]
    return add_sparse(-jnp.exp(zc) * (a[:, None] + b[:, None] * zc), ids, coef, start, width)

  return tiled_grad((Head(h, w, transposed),), rows, dz_fn, inv_tau=inv_tau, bs=bs)


def fused_loss(h, w, y, mask, token_loss_fn, aux, *, inv_tau: float, transposed: bool,
               bs: BlockSizes):
  """(loss, logp, dh fp32, dW fp32) with dh, dW accumulated during the pass (6·N·D·V FLOPs).

  loss = sum_n mask_n * token_loss_fn(logp_n, aux_n); g_n = mask_n * d ell_n / d logp_n.
  """
  n, d = h.shape
  vocab = w.shape[vocab_axis(transposed)]
  nc = min(bs.fused_token_chunk, n)
  n_chunks = -(-n // nc)
  npad = n_chunks * nc

  def chunked(x):
    x = pad_rows(x, npad)
    return x.reshape((n_chunks, nc) + x.shape[1:])

  aux_leaves, aux_def = jax.tree.flatten(aux)
  split = [jnp.ndim(x) > 0 and jnp.shape(x)[0] == n for x in aux_leaves]
  xs = (chunked(h), chunked(y), chunked(mask.astype(bool)),
        [chunked(x) for x, s in zip(aux_leaves, split) if s])
  tr = transposed

  def body(carry, x):
    dw, loss = carry
    hc, yc, mc, aux_split = x
    it = iter(aux_split)
    aux_c = jax.tree.unflatten(aux_def, [next(it) if s else a for a, s in zip(aux_leaves, split)])
    # The chunk's logits, one matmul: `raw` [nc, V] fp32 is the one kept block. Its softmax
    # statistics are then taken tile by tile (slices fuse into the reductions, no copies).
    # 1/tau is applied per tile, so a temperature costs no second [nc, V] buffer.
    raw = logits_tile(hc, w, tr)
    scaled = lambda x: x if inv_tau == 1.0 else x * inv_tau
    zy = scaled(jnp.take_along_axis(raw, jnp.clip(yc, 0, vocab - 1)[:, None], axis=1)[:, 0])

    def stats_tile(carry, start, width):
      zt = scaled(lax.dynamic_slice_in_dim(raw, start, width, axis=1))
      return online_softmax.update(*carry, zt, entropy=False, separate_reductions=True)

    m, r, a = for_each_tile(vocab, bs.vocab_tile, stats_tile, online_softmax.init((nc,)))
    logp, lse, _ = online_softmax.finalize(m, r, a, zy)
    logp = jnp.where(mc, logp, 0.0)
    ell, vjp = jax.vjp(lambda lp: token_loss_fn(lp, aux_c), logp)
    (g,) = vjp(jnp.ones_like(ell))
    g = jnp.where(mc, g, 0.0).astype(jnp.float32)
    loss = loss + jnp.sum(jnp.where(mc, ell, 0.0).astype(jnp.float32))

    def tile(carry, start, width):
      dh_c, dw = carry
      wt = slice_vocab(w, start, width, tr)
      zt = scaled(lax.dynamic_slice_in_dim(raw, start, width, axis=1))
      s = add_sparse(-jnp.exp(zt - lse[:, None]) * (g * inv_tau)[:, None], yc[:, None],
                     (g * inv_tau)[:, None], start, width)
      dh_c = dh_c + dh_tile(s, wt, tr)
      ax = vocab_axis(tr)
      dwt = lax.dynamic_slice_in_dim(dw, start, width, axis=ax) + dw_tile(hc, s, tr)
      return dh_c, lax.dynamic_update_slice_in_dim(dw, dwt, start, axis=ax)

    dh_c, dw = for_each_tile(vocab, bs.vocab_tile, tile, (jnp.zeros((nc, d), jnp.float32), dw))
    return (dw, loss), (dh_c, logp)

  init = (jnp.zeros(w.shape, jnp.float32), jnp.zeros((), jnp.float32))
  (dw, loss), (dh, logp) = lax.scan(body, init, xs)
  return loss, logp.reshape(npad)[:n], dh.reshape(npad, d)[:n], dw
