"""Fused LM-head log-probs: per-token log p(y), log-sum-exp and entropy without [N, V] logits.

Math (h [N, D] hidden states, W [D, V] LM head, y [N] targets, tau temperature):

    z_nv = (h W)_nv / tau
    lse_n = log sum_v exp z_nv                 (online over vocabulary tiles, fp32)
    logp_n = z_{n,y_n} - lse_n
    H_n = -sum_v p_nv log p_nv = lse_n - sum_v p_nv z_nv,     p = softmax(z)

Backward, for cotangents (g, g_lse, g_H) of (logp, lse, H), per row:

    dL/dz_v = g [v = y] - p_v (a + b (z_v - lse)),   a = g - g_lse + g_H H,   b = g_H
    dh = (dL/dz) W^T / tau,   dW = h^T (dL/dz) / tau

(dH/dz_v = -p_v (log p_v + H)). The generic op recomputes the logit tiles in the backward:
2·N·D·V FLOPs forward + 6·N·D·V backward = 8·N·D·V. The fused-loss path
(`fused_logprob_loss`) takes a separable loss, loss = sum_n ell(logp_n, aux_n), evaluates
g_n = d ell_n / d logp_n as soon as a token chunk's log-probs are known and accumulates dh, dW
during the forward; its backward only scales them by the incoming cotangent: 6·N·D·V FLOPs,
like the materialised version, with [chunk, V] fp32 temporaries instead of [N, V].

Prior art: Liger Kernel's fused linear cross-entropy (token chunks, gradients in the forward,
arXiv:2410.10989) and Apple's Cut Cross-Entropy (vocabulary-tiled logits recomputed in SRAM,
the backward recomputes them; arXiv:2411.09009). Simplified here: no gradient filtering /
vocabulary sorting of CCE, no z-loss or label smoothing, a single temperature; the Pallas
paths of the fused loss run forward kernel + backward kernel inside the forward (8·N·D·V on
GPU, 10·N·D·V on TPU, whose backward has no atomics), only the XLA chunked fused path is the
6·N·D·V single pass.

Layout: `w` is [D, V] (an untied LM head as stored by Flax), or [V, D] with `transposed=True`
(a tied embedding table passed as is; no transpose copy is made). dW comes back in w's layout.

Masked tokens (mask == 0) output 0 for logp, lse and entropy and get zero gradient; their
target id may be anything (it is clipped). Inputs may be fp32 or bf16; logits, softmax and all
accumulations are fp32; dh / dW are returned in h's / w's dtype.

Implementations (`impl`): "reference" (materialised jnp, plain autodiff), "chunked" (XLA token
chunks x vocab tiles), "pallas_gpu" (Pallas Triton), "pallas_tpu" (Pallas Mosaic TPU), and
"auto" = DEFAULT_IMPL[backend]. Pallas kernels run on CPU with interpret=True.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from . import lm_head_chunked as chunked_lib
from . import lm_head_pallas_gpu as gpu_lib
from . import lm_head_pallas_tpu as tpu_lib
from . import reference as ref_lib

IMPLS = ("reference", "chunked", "pallas_gpu", "pallas_tpu")
# The Pallas kernels are verified in interpret mode only; they become the GPU / TPU default once
# benchmarks/loss_kernel_gpu_check.py (and a TPU equivalent) pass on hardware.
DEFAULT_IMPL = {"cpu": "chunked", "gpu": "chunked", "tpu": "chunked"}
_BLOCK_SIZES = {"chunked": chunked_lib.BlockSizes, "pallas_gpu": gpu_lib.BlockSizes,
                "pallas_tpu": tpu_lib.BlockSizes}


def resolve_impl(impl: str) -> str:
  """'auto' -> the backend default; anything else is validated against IMPLS."""
  if impl == "auto":
    return DEFAULT_IMPL.get(jax.default_backend(), "chunked")
  if impl not in IMPLS:
    raise ValueError(f"unknown LM-head kernel impl {impl!r}; valid: 'auto', "
                     + ", ".join(repr(i) for i in IMPLS))
  return impl


def default_block_sizes(impl: str):
  impl = resolve_impl(impl)
  if impl == "reference":
    return None
  return _BLOCK_SIZES[impl].get_default(jax.default_backend())


@dataclasses.dataclass(frozen=True)
class _Cfg:
  impl: str
  inv_tau: float
  transposed: bool
  block_sizes: Any
  interpret: bool


def _make_cfg(impl, temperature, transposed, block_sizes, interpret) -> _Cfg:
  impl = resolve_impl(impl)
  if not temperature > 0:
    raise ValueError(f"temperature must be > 0, got {temperature}")
  if block_sizes is None and impl != "reference":
    block_sizes = _BLOCK_SIZES[impl].get_default(jax.default_backend())
  if impl != "reference" and not isinstance(block_sizes, _BLOCK_SIZES[impl]):
    raise TypeError(f"impl {impl!r} takes {_BLOCK_SIZES[impl].__module__}.BlockSizes, "
                    f"got {type(block_sizes).__name__}")
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  return _Cfg(impl, 1.0 / float(temperature), bool(transposed), block_sizes, bool(interpret))


def _check(h, w, y, transposed):
  if h.ndim != 2 or w.ndim != 2 or y.ndim != 1 or y.shape[0] != h.shape[0]:
    raise ValueError(f"expected h [N, D], w [D, V] (or [V, D] transposed), y [N]; got "
                     f"h {h.shape}, w {w.shape}, y {y.shape}")
  d_w = w.shape[1] if transposed else w.shape[0]
  if d_w != h.shape[1]:
    raise ValueError(f"hidden size mismatch: h has D={h.shape[1]}, w {w.shape} "
                     f"({'[V, D]' if transposed else '[D, V]'}) has D={d_w}")


def _fwd_impl(cfg: _Cfg, h, w, y):
  kw = dict(inv_tau=cfg.inv_tau, transposed=cfg.transposed, bs=cfg.block_sizes)
  if cfg.impl == "chunked":
    return chunked_lib.forward(h, w, y, **kw)
  lib = gpu_lib if cfg.impl == "pallas_gpu" else tpu_lib
  return lib.forward(h, w, y, interpret=cfg.interpret, **kw)


def _bwd_impl(cfg: _Cfg, h, w, y, lse, g, a, b):
  """fp32 (dh, dW) for dz = g [v = y] - p (a + b (z - lse))."""
  kw = dict(inv_tau=cfg.inv_tau, transposed=cfg.transposed, bs=cfg.block_sizes)
  if cfg.impl == "chunked":
    return chunked_lib.backward(h, w, y[:, None], g[:, None], lse, a, b, **kw)
  lib = gpu_lib if cfg.impl == "pallas_gpu" else tpu_lib
  return lib.backward(h, w, y, lse, g, a, b, interpret=cfg.interpret, **kw)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _logprobs(cfg: _Cfg, h, w, y, mask):
  return _logprobs_fwd(cfg, h, w, y, mask)[0]


def _logprobs_fwd(cfg, h, w, y, mask):
  logp, lse, ent = _fwd_impl(cfg, h, w, y)
  z = jnp.zeros_like(logp)
  out = (jnp.where(mask, logp, z), jnp.where(mask, lse, z), jnp.where(mask, ent, z))
  return out, (h, w, y, mask, lse, ent)


def _logprobs_bwd(cfg, res, cts):
  h, w, y, mask = res[:4]
  lse, ent = res[4:]
  g, g_lse, g_ent = (jnp.where(mask, c, 0.0).astype(jnp.float32) for c in cts)
  a = g - g_lse + g_ent * ent
  dh, dw = _bwd_impl(cfg, h, w, y, lse, g, a, g_ent)
  return dh.astype(h.dtype), dw.astype(w.dtype), None, None


_logprobs.defvjp(_logprobs_fwd, _logprobs_bwd)


@functools.partial(jax.jit, static_argnames=("temperature", "return_entropy", "transposed",
                                             "impl", "block_sizes", "interpret"))
def token_logprobs(h: jax.Array, w: jax.Array, y: jax.Array, *, temperature: float = 1.0,
                   mask: Optional[jax.Array] = None, return_entropy: bool = False,
                   transposed: bool = False, impl: str = "auto", block_sizes=None,
                   interpret: Optional[bool] = None):
  """Per-token log p(y) and log-sum-exp (and entropy) of softmax((h @ W) / temperature).

  Args:
    h: [N, D] hidden states (fp32 or bf16).
    w: [D, V] LM head, or [V, D] with transposed=True (tied embedding).
    y: [N] int target ids.
    temperature: tau > 0 (static).
    mask: optional [N] bool / 0-1; 0 = ignored token (outputs 0, zero gradient).
    return_entropy: also return the entropy of softmax(z) (differentiable).
    impl: 'auto' | 'reference' | 'chunked' | 'pallas_gpu' | 'pallas_tpu'.
    block_sizes: the impl's BlockSizes (frozen dataclass), default per backend.
    interpret: Pallas interpret mode; default True on CPU.
  Returns:
    (logp [N], lse [N]) or (logp, lse, entropy), fp32, all differentiable w.r.t. h and w.
  """
  _check(h, w, y, transposed)
  mask = jnp.ones(y.shape, bool) if mask is None else mask.astype(bool)
  y = jnp.clip(y.astype(jnp.int32), 0, w.shape[0 if transposed else 1] - 1)
  cfg = _make_cfg(impl, temperature, transposed, block_sizes, interpret)
  if cfg.impl == "reference":
    out = ref_lib.token_logprobs(h, w, y, temperature=temperature, mask_n=mask,
                                 transposed=transposed)
  else:
    out = _logprobs(cfg, h, w, y, mask)
  return out if return_entropy else out[:2]


# ----------------------------------------------------------------------------- fused loss


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fused(cfg: _Cfg, token_loss_fn, h, w, y, mask, aux):
  return _fused_fwd(cfg, token_loss_fn, h, w, y, mask, aux)[0]


def _fused_fwd(cfg, token_loss_fn, h, w, y, mask, aux):
  if cfg.impl == "chunked":
    loss, logp, dh, dw = chunked_lib.fused_loss(
        h, w, y, mask, token_loss_fn, aux, inv_tau=cfg.inv_tau, transposed=cfg.transposed,
        bs=cfg.block_sizes)
  else:  # Pallas: forward kernel, g, backward kernel, all inside this forward (8·N·D·V)
    logp, lse, _ = _fwd_impl(cfg, h, w, y)
    logp = jnp.where(mask, logp, 0.0)
    ell, vjp = jax.vjp(lambda lp: token_loss_fn(lp, aux), logp)
    (g,) = vjp(jnp.ones_like(ell))
    g = jnp.where(mask, g, 0.0).astype(jnp.float32)
    loss = jnp.sum(jnp.where(mask, ell, 0.0).astype(jnp.float32))
    dh, dw = _bwd_impl(cfg, h, w, y, lse, g, g, jnp.zeros_like(g))
  return (loss, logp), (dh.astype(h.dtype), dw.astype(w.dtype), aux)


def _fused_bwd(cfg, token_loss_fn, res, cts):
  dh, dw, aux = res
  ct = cts[0]  # the logp output is stop-gradient (see fused_logprob_loss)
  zeros_aux = jax.tree.map(
      lambda x: jnp.zeros(jnp.shape(x), jax.dtypes.float0)
      if not jnp.issubdtype(jnp.result_type(x), jnp.inexact) else jnp.zeros_like(x), aux)
  return ((ct * dh).astype(dh.dtype), (ct * dw).astype(dw.dtype), None, None, zeros_aux)


_fused.defvjp(_fused_fwd, _fused_bwd)


@functools.partial(jax.jit, static_argnames=("token_loss_fn", "temperature", "transposed",
                                             "impl", "block_sizes", "interpret"))
def fused_logprob_loss(h: jax.Array, w: jax.Array, y: jax.Array,
                       token_loss_fn: Callable[[jax.Array, Any], jax.Array], aux: Any, *,
                       temperature: float = 1.0, mask: Optional[jax.Array] = None,
                       transposed: bool = False, impl: str = "auto", block_sizes=None,
                       interpret: Optional[bool] = None):
  """(loss, logp_n) for a separable loss, with dh / dW computed during the forward pass.

  loss = sum_n mask_n * token_loss_fn(logp_n, aux_n), where token_loss_fn is elementwise in
  logp (the separable form of posttrain_jax.losses.base: `functools.partial(spec.token_loss,
  cfg=cfg)` with aux = spec.token_terms(batch, cfg), flattened to [N]). aux is a pytree of
  arrays with leading axis N (0-d leaves are broadcast); it gets no gradient. Differentiate
  `loss` only: the returned logp_n is stop-gradient (for metrics). token_loss_fn is a static
  argument: pass a module-level function or one stable partial (each new object retraces when
  this is called outside an enclosing jit).
  """
  _check(h, w, y, transposed)
  mask = jnp.ones(y.shape, bool) if mask is None else mask.astype(bool)
  y = jnp.clip(y.astype(jnp.int32), 0, w.shape[0 if transposed else 1] - 1)
  cfg = _make_cfg(impl, temperature, transposed, block_sizes, interpret)
  if cfg.impl == "reference":
    return ref_lib.fused_logprob_loss(h, w, y, token_loss_fn, aux, temperature=temperature,
                                      mask_n=mask, transposed=transposed)
  loss, logp = _fused(cfg, token_loss_fn, h, w, y, mask, aux)
  return loss, jax.lax.stop_gradient(logp)
