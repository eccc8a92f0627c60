"""Materialised plain-`jnp` references for the LM-head kernels (they build the [N, V] logits).

    z = (h @ W) / tau                                   [N, V], fp32 accumulation
    lse_n = logsumexp_v z_nv
    logp_n = z_{n, y_n} - lse_n
    entropy_n = -sum_v p_nv log p_nv,  p = softmax(z)

Masked tokens (mask == 0) output 0 for every per-token quantity, and so get zero gradient.
Gradients come from plain autodiff; these functions are the ground truth for the tests and the
"materialised" baseline of benchmarks/loss_kernel.py. `transposed=True` means `w` is [V, D]
(a tied embedding table) instead of [D, V].
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp


def logits(h_nd: jax.Array, w: jax.Array, *, temperature: float = 1.0,
           transposed: bool = False) -> jax.Array:
  """[N, V] fp32 logits (h @ W) / tau with fp32 accumulation; `w` is [D, V] or, transposed, [V, D]."""
  dims = (((1,), (1,)), ((), ())) if transposed else (((1,), (0,)), ((), ()))
  z = jax.lax.dot_general(h_nd, w, dims, preferred_element_type=jnp.float32)
  return z / jnp.float32(temperature)


def log_softmax(z):
  """(log_softmax(z), logsumexp(z)) over the last axis, accurate when one logit dominates.

  log l is computed as log1p(sum_v exp(z_v - m) - 1) with the max element's 1 removed exactly
  (expm1(0) = 0 keeps its derivative), so log p of a confident token and a small entropy keep
  full fp32 relative precision (jax.nn.log_softmax rounds l = 1 + eps first).
  """
  mx = jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
  zc = z - mx
  at_max = zc == 0.0
  ties_minus_1 = jnp.sum(at_max, axis=-1, keepdims=True).astype(z.dtype) - 1.0  # exact
  r = jnp.sum(jnp.where(at_max, jnp.expm1(zc), jnp.exp(zc)), axis=-1, keepdims=True) + ties_minus_1
  log_l = jnp.log1p(r)
  return zc - log_l, (mx + log_l)[..., 0]


def _mask(mask_n, n):
  return jnp.ones((n,), bool) if mask_n is None else jnp.asarray(mask_n).astype(bool)


def token_logprobs(h_nd, w, y_n, *, temperature: float = 1.0, mask_n=None, transposed: bool = False):
  """(logp_n, lse_n, entropy_n), all fp32 [N]; masked tokens give 0."""
  m = _mask(mask_n, h_nd.shape[0])
  z = logits(h_nd, w, temperature=temperature, transposed=transposed)
  logp_all, lse = log_softmax(z)
  yc = jnp.clip(y_n, 0, z.shape[1] - 1)
  logp = jnp.take_along_axis(logp_all, yc[:, None], axis=1)[:, 0]
  ent = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
  zero = jnp.zeros_like(logp)
  return jnp.where(m, logp, zero), jnp.where(m, lse, zero), jnp.where(m, ent, zero)


def fused_logprob_loss(h_nd, w, y_n, token_loss_fn: Callable[[jax.Array, Any], jax.Array], aux,
                       *, temperature: float = 1.0, mask_n=None, transposed: bool = False):
  """(loss, logp_n): loss = sum_n mask_n * token_loss_fn(logp_n, aux_n), differentiated by autodiff."""
  m = _mask(mask_n, h_nd.shape[0])
  logp, _, _ = token_logprobs(h_nd, w, y_n, temperature=temperature, mask_n=m, transposed=transposed)
  ell = token_loss_fn(logp, aux)
  return jnp.sum(jnp.where(m, ell, 0.0)), jax.lax.stop_gradient(logp)


class TopK(NamedTuple):
  """Student top-k ids with both models' log-probs there, and each model's tail bucket.

  tail = log(1 - sum_k p_k) (the log-mass outside the student's top-k ids)."""
  ids_nk: jax.Array
  student_logp_nk: jax.Array
  teacher_logp_nk: jax.Array
  student_tail_n: jax.Array
  teacher_tail_n: jax.Array


def log1m_sum_exp(logp_nk: jax.Array) -> jax.Array:
  """log(1 - sum_k exp(logp_k)), stable; floored at log(tiny) when the top-k hold all the mass."""
  s = jax.nn.logsumexp(logp_nk, axis=-1)
  return jnp.log(jnp.maximum(-jnp.expm1(jnp.minimum(s, 0.0)), jnp.finfo(jnp.float32).tiny))


def topk_logprobs(h_nd, w, ht_nd, wt, *, k: int, temperature: float = 1.0, mask_n=None,
                  transposed: bool = False, teacher_transposed: bool = False) -> TopK:
  m = _mask(mask_n, h_nd.shape[0])
  zs = log_softmax(logits(h_nd, w, temperature=temperature, transposed=transposed))[0]
  zt = log_softmax(logits(jax.lax.stop_gradient(ht_nd), jax.lax.stop_gradient(wt),
                          temperature=temperature, transposed=teacher_transposed))[0]
  _, ids = jax.lax.top_k(jax.lax.stop_gradient(zs), k)
  s = jnp.take_along_axis(zs, ids, axis=1)
  t = jnp.take_along_axis(zt, ids, axis=1)
  mk = m[:, None]
  s, t = jnp.where(mk, s, 0.0), jnp.where(mk, t, 0.0)
  return TopK(jnp.where(mk, ids, 0), s, t, jnp.where(m, log1m_sum_exp(s), 0.0),
              jnp.where(m, log1m_sum_exp(t), 0.0))


def divergence(ls, lt, kind: str, beta: float = 0.5):
  """D over the last axis of student / teacher log-probabilities of the same buckets (the whole
  vocabulary, or top-k + tail): forward_kl KL(T||S), reverse_kl KL(S||T), jsd JSD_beta."""
  if kind == "forward_kl":
    return jnp.sum(jnp.exp(lt) * (lt - ls), -1)
  if kind == "reverse_kl":
    return jnp.sum(jnp.exp(ls) * (ls - lt), -1)
  if kind == "jsd":
    lm = jnp.logaddexp(jnp.log(beta) + lt, jnp.log1p(-beta) + ls)
    return beta * jnp.sum(jnp.exp(lt) * (lt - lm), -1) + (1 - beta) * jnp.sum(jnp.exp(ls) * (ls - lm), -1)
  raise ValueError(f"unknown divergence kind {kind!r}; valid: 'jsd', 'forward_kl', 'reverse_kl'")


def teacher_divergence(h_nd, w, ht_nd, wt, *, kind: str = "jsd", beta: float = 0.5,
                       temperature: float = 1.0, mask_n=None, transposed: bool = False,
                       teacher_transposed: bool = False):
  """Per-token divergence [N] between student S and (stop-gradient) teacher T; see teacher.py."""
  m = _mask(mask_n, h_nd.shape[0])
  ls = log_softmax(logits(h_nd, w, temperature=temperature, transposed=transposed))[0]
  lt = log_softmax(logits(jax.lax.stop_gradient(ht_nd), jax.lax.stop_gradient(wt),
                          temperature=temperature, transposed=teacher_transposed))[0]
  return jnp.where(m, divergence(ls, lt, kind, beta), 0.0)
