"""Teacher-side LM-head terms for distillation, streamed over vocabulary tiles of both heads.

S = softmax(h W / tau) is the student (differentiable), T = softmax(h_T W_T / tau) the teacher
(always stop-gradient; its hidden size D_T may differ, the vocabulary V must match). One
temperature tau applies to both. Per token n:

(a) teacher_token_logprobs: log T(y_n), the teacher's log-prob of the student's sampled token
    (the per-token advantage of on-policy distillation is log T(y) - log S(y)).
(b) topk_logprobs: the student's top-k ids, log S and log T at those ids, and each model's
    tail bucket log(1 - sum_k p_k) (the mass outside the student's top-k), so a divergence over
    k + 1 buckets can be formed; gradients flow to the student's top-k log-probs and tail.
(c) teacher_divergence, full vocabulary:
      forward_kl  KL(T || S) = sum_v T_v (log T_v - log S_v)      (mode covering)
      reverse_kl  KL(S || T) = sum_v S_v (log S_v - log T_v)      (mode seeking)
      jsd         JSD_beta = beta KL(T || M) + (1 - beta) KL(S || M),  M = beta T + (1 - beta) S
    for 0 < beta < 1. Which end is which (ours; TRL and GKD agree): beta -> 0 gives
    JSD_beta / beta -> KL(T || S), forward-KL-like; beta -> 1 gives JSD_beta / (1 - beta) ->
    KL(S || T), reverse-KL-like. At beta = 0 or 1 JSD_beta is identically 0, so those values
    are rejected: use kind="forward_kl" / "reverse_kl". GKD defaults: beta 0.5, tau 0.9.

Gradients w.r.t. the student logits z (derived in lm_head.py's notation, s = S, t = T):
    d KL(T||S)/dz = s - t,   d KL(S||T)/dz = s (log s - log t - KL(S||T)),
    d JSD_beta/dz = (1 - beta) s (log s - log m - KL(S||M))
(dJSD/ds_v = (1 - beta) log(s_v / m_v): the other terms cancel). The chunked implementation
makes two passes over the tiles in the forward (log-sum-exp of both heads, then the
divergence: 4 head-matmuls) and one in the backward (2 recomputes + dh + dW), never holding more
than [token_chunk, vocab_tile] of either head. Top-k keeps a running top-k per row, merged tile
by tile with the teacher logit carried along.

Implementations: "reference" (materialised) and "chunked" (XLA, any backend; "auto"). Pallas
kernels for (b) and (c) are not written yet; (a) takes every impl of token_logprobs.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from . import lm_head
from . import lm_head_chunked as chunked_lib
from . import online_softmax
from . import reference as ref_lib
from .reference import TopK, log1m_sum_exp

TEACHER_IMPLS = ("reference", "chunked")
DIVERGENCES = ("jsd", "forward_kl", "reverse_kl")


def _resolve(impl: str) -> str:
  if impl == "auto":
    return "chunked"
  if impl not in TEACHER_IMPLS:
    raise ValueError(f"unknown teacher-term impl {impl!r}; valid: 'auto', "
                     + ", ".join(repr(i) for i in TEACHER_IMPLS)
                     + " (no Pallas kernel for top-k / divergences yet)")
  return impl


def _bs(block_sizes):
  if block_sizes is None:
    return chunked_lib.BlockSizes.get_default(jax.default_backend())
  if not isinstance(block_sizes, chunked_lib.BlockSizes):
    raise TypeError(f"teacher terms take lm_head_chunked.BlockSizes, got {type(block_sizes).__name__}")
  return block_sizes


def _check_pair(h, w, ht, wt, transposed, teacher_transposed):
  v_s = w.shape[0 if transposed else 1]
  v_t = wt.shape[0 if teacher_transposed else 1]
  d_s = w.shape[1 if transposed else 0]
  d_t = wt.shape[1 if teacher_transposed else 0]
  if (h.ndim, ht.ndim) != (2, 2) or h.shape[0] != ht.shape[0]:
    raise ValueError(f"student h {h.shape} and teacher h_T {ht.shape} must be [N, D] with the same N")
  if d_s != h.shape[1] or d_t != ht.shape[1]:
    raise ValueError(f"hidden size mismatch: h {h.shape} vs w {w.shape}, h_T {ht.shape} vs w_T "
                     f"{wt.shape} (transposed={transposed}, teacher_transposed={teacher_transposed})")
  if v_s != v_t:
    raise ValueError(f"student vocabulary {v_s} != teacher vocabulary {v_t}")


def _mask(mask, n):
  return jnp.ones((n,), bool) if mask is None else jnp.asarray(mask).astype(bool)


def teacher_token_logprobs(ht, wt, y, *, temperature: float = 1.0, mask=None,
                           transposed: bool = False, impl: str = "auto", block_sizes=None,
                           interpret: Optional[bool] = None):
  """(a) log T(y_n) [N], stop-gradient (masked tokens 0). Any lm_head impl."""
  ht, wt = lax.stop_gradient(ht), lax.stop_gradient(wt)
  logp, _ = lm_head.token_logprobs(ht, wt, y, temperature=temperature, mask=mask,
                                   transposed=transposed, impl=impl, block_sizes=block_sizes,
                                   interpret=interpret)
  return lax.stop_gradient(logp)


# ----------------------------------------------------------------------------- (b) top-k


def _stats_state(n):
  return online_softmax.init((n,))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _topk(k, inv_tau, transposed, teacher_transposed, bs, h, w, ht, wt, mask):
  return _topk_fwd(k, inv_tau, transposed, teacher_transposed, bs, h, w, ht, wt, mask)[0]


def _topk_fwd(k, inv_tau, transposed, teacher_transposed, bs, h, w, ht, wt, mask):
  n = h.shape[0]
  heads = (chunked_lib.Head(h, w, transposed), chunked_lib.Head(ht, wt, teacher_transposed))
  kinit = lambda v, dt: jnp.full((n, k), v, dt)
  state = (*_stats_state(n), *_stats_state(n), kinit(online_softmax.NEG, jnp.float32),
           kinit(0, jnp.int32), kinit(0.0, jnp.float32))

  def tile_fn(zs, _, st, start, width):
    z_s, z_t = zs
    ms, rs, as_, mt, rt, at, vals, ids, tvals = st
    kk = min(k, width)
    tv, ti = lax.top_k(z_s, kk)
    tt = jnp.take_along_axis(z_t, ti, axis=1)
    cat_v = jnp.concatenate([vals, tv], axis=1)  # running entries first: ties keep lower ids
    cat_i = jnp.concatenate([ids, ti.astype(jnp.int32) + start], axis=1)
    cat_t = jnp.concatenate([tvals, tt], axis=1)
    vals, sel = lax.top_k(cat_v, k)
    return (*online_softmax.update(ms, rs, as_, z_s, entropy=False, separate_reductions=True),
            *online_softmax.update(mt, rt, at, z_t, entropy=False, separate_reductions=True),
            vals, jnp.take_along_axis(cat_i, sel, axis=1), jnp.take_along_axis(cat_t, sel, axis=1))

  ms, rs, _, mt, rt, _, vals, ids, tvals = chunked_lib.tiled_pass(
      heads, (), state, tile_fn, inv_tau=inv_tau, bs=bs)
  s_logp = (vals - ms[:, None]) - jnp.log1p(rs)[:, None]
  t_logp = (tvals - mt[:, None]) - jnp.log1p(rt)[:, None]
  mk = mask[:, None]
  out = (jnp.where(mk, ids, 0), jnp.where(mk, s_logp, 0.0), jnp.where(mk, t_logp, 0.0))
  return out, (h, w, ids, mask, ms + jnp.log1p(rs))


def _topk_bwd(k, inv_tau, transposed, teacher_transposed, bs, res, cts):
  h, w, ids, mask, lse = res
  g = jnp.where(mask[:, None], cts[1], 0.0).astype(jnp.float32)  # teacher output: stop-gradient
  dh, dw = chunked_lib.backward(h, w, ids, g, lse, jnp.sum(g, axis=1), jnp.zeros_like(lse),
                                inv_tau=inv_tau, transposed=transposed, bs=bs)
  return dh.astype(h.dtype), dw.astype(w.dtype), None, None, None


_topk.defvjp(_topk_fwd, _topk_bwd)


@functools.partial(jax.jit, static_argnames=("k", "temperature", "transposed",
                                             "teacher_transposed", "impl", "block_sizes"))
def topk_logprobs(h, w, ht, wt, *, k: int, temperature: float = 1.0, mask=None,
                  transposed: bool = False, teacher_transposed: bool = False, impl: str = "auto",
                  block_sizes=None) -> TopK:
  """(b) TopK(ids [N,k], student_logp [N,k], teacher_logp [N,k], student_tail [N], teacher_tail [N]).

  ids are the student's top-k (descending); tail = log(1 - sum_k p_k) per model, floored at
  log(float32 tiny). Student log-probs and tail are differentiable; teacher outputs are not.
  Masked tokens give zeros everywhere.
  """
  _check_pair(h, w, ht, wt, transposed, teacher_transposed)
  vocab = w.shape[0 if transposed else 1]
  if not 1 <= k <= vocab:
    raise ValueError(f"k must be in [1, V={vocab}], got {k}")
  mask = _mask(mask, h.shape[0])
  impl = _resolve(impl)
  if impl == "reference":
    return ref_lib.topk_logprobs(h, w, ht, wt, k=k, temperature=temperature, mask_n=mask,
                                 transposed=transposed, teacher_transposed=teacher_transposed)
  ht, wt = lax.stop_gradient(ht), lax.stop_gradient(wt)
  ids, s, t = _topk(k, 1.0 / temperature, transposed, teacher_transposed, _bs(block_sizes),
                    h, w, ht, wt, mask)
  t = lax.stop_gradient(t)
  return TopK(ids, s, t, jnp.where(mask, log1m_sum_exp(s), 0.0),
              jnp.where(mask, log1m_sum_exp(t), 0.0))


# ----------------------------------------------------------------------------- (c) divergences


def _div_terms(kind, beta, z_s, z_t, lse_s, lse_t):
  """Per-element log s, log t, (log m) for one tile pair."""
  ls = z_s - lse_s[:, None]
  lt = z_t - lse_t[:, None]
  lm = None
  if kind == "jsd":
    lm = jnp.logaddexp(jnp.log(beta) + lt, jnp.log1p(-beta) + ls)
  return ls, lt, lm


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4, 5))
def _divergence(kind, beta, inv_tau, transposed, teacher_transposed, bs, h, w, ht, wt, mask):
  return _divergence_fwd(kind, beta, inv_tau, transposed, teacher_transposed, bs,
                         h, w, ht, wt, mask)[0]


def _divergence_fwd(kind, beta, inv_tau, transposed, teacher_transposed, bs, h, w, ht, wt, mask):
  n = h.shape[0]
  heads = (chunked_lib.Head(h, w, transposed), chunked_lib.Head(ht, wt, teacher_transposed))

  def stats_fn(zs, _, st, start, width):
    kw = dict(entropy=False, separate_reductions=True)
    return (*online_softmax.update(*st[:3], zs[0], **kw), *online_softmax.update(*st[3:], zs[1], **kw))

  st = chunked_lib.tiled_pass(heads, (), (*_stats_state(n), *_stats_state(n)), stats_fn,
                              inv_tau=inv_tau, bs=bs)
  lse_s = st[0] + jnp.log1p(st[1])
  lse_t = st[3] + jnp.log1p(st[4])

  def div_fn(zs, rows, acc, start, width):
    ls, lt, lm = _div_terms(kind, beta, *zs, *rows)
    acc_1, acc_2 = acc
    if kind == "forward_kl":
      return acc_1 + jnp.sum(jnp.exp(lt) * (lt - ls), axis=1), acc_2
    if kind == "reverse_kl":
      return acc_1 + jnp.sum(jnp.exp(ls) * (ls - lt), axis=1), acc_2
    return (acc_1 + jnp.sum(jnp.exp(lt) * (lt - lm), axis=1),
            acc_2 + jnp.sum(jnp.exp(ls) * (ls - lm), axis=1))

  zero = jnp.zeros((n,), jnp.float32)
  kl_1, kl_2 = chunked_lib.tiled_pass(heads, (lse_s, lse_t), (zero, zero), div_fn,
                                      inv_tau=inv_tau, bs=bs)
  if kind == "jsd":
    d, r = beta * kl_1 + (1.0 - beta) * kl_2, kl_2  # r = KL(S || M)
  else:
    d, r = kl_1, kl_1
  return jnp.where(mask, d, 0.0), (h, w, ht, wt, mask, lse_s, lse_t, r)


def _divergence_bwd(kind, beta, inv_tau, transposed, teacher_transposed, bs, res, ct):
  h, w, ht, wt, mask, lse_s, lse_t, r = res
  g = jnp.where(mask, ct, 0.0).astype(jnp.float32)
  heads = (chunked_lib.Head(h, w, transposed), chunked_lib.Head(ht, wt, teacher_transposed))

  def dz_fn(zs, rows, start, width):
    lse_s_c, lse_t_c, r_c, g_c = rows
    ls, lt, lm = _div_terms(kind, beta, *zs, lse_s_c, lse_t_c)
    s = jnp.exp(ls)
    if kind == "forward_kl":
      dz = s - jnp.exp(lt)
    elif kind == "reverse_kl":
      dz = s * (ls - lt - r_c[:, None])
    else:
      dz = (1.0 - beta) * s * (ls - lm - r_c[:, None])
    return g_c[:, None] * dz

  dh, dw = chunked_lib.tiled_grad(heads, (lse_s, lse_t, r, g), dz_fn, inv_tau=inv_tau, bs=bs)
  return dh.astype(h.dtype), dw.astype(w.dtype), None, None, None


_divergence.defvjp(_divergence_fwd, _divergence_bwd)


@functools.partial(jax.jit, static_argnames=("kind", "beta", "temperature", "transposed",
                                             "teacher_transposed", "impl", "block_sizes"))
def teacher_divergence(h, w, ht, wt, *, kind: str = "jsd", beta: float = 0.5,
                       temperature: float = 1.0, mask=None, transposed: bool = False,
                       teacher_transposed: bool = False, impl: str = "auto", block_sizes=None):
  """(c) Per-token full-vocabulary divergence [N] between student and teacher (see module doc).

  kind: 'jsd' (generalised JSD_beta, 0 < beta < 1), 'forward_kl' = KL(T||S), 'reverse_kl' =
  KL(S||T). Differentiable w.r.t. the student's h and w only; masked tokens give 0.
  """
  if kind not in DIVERGENCES:
    raise ValueError(f"unknown divergence kind {kind!r}; valid: " + ", ".join(map(repr, DIVERGENCES)))
  if kind == "jsd" and not 0.0 < beta < 1.0:
    raise ValueError(f"jsd needs 0 < beta < 1 (JSD_beta is 0 at the ends), got {beta}; "
                     "use kind='forward_kl' (the beta -> 0 end) or 'reverse_kl' (beta -> 1)")
  _check_pair(h, w, ht, wt, transposed, teacher_transposed)
  mask = _mask(mask, h.shape[0])
  impl = _resolve(impl)
  if impl == "reference":
    return ref_lib.teacher_divergence(h, w, ht, wt, kind=kind, beta=beta, temperature=temperature,
                                      mask_n=mask, transposed=transposed,
                                      teacher_transposed=teacher_transposed)
  ht, wt = lax.stop_gradient(ht), lax.stop_gradient(wt)
  return _divergence(kind, float(beta), 1.0 / temperature, transposed, teacher_transposed,
                     _bs(block_sizes), h, w, ht, wt, mask)
