"""Online softmax statistics per row, accurate for peaked distributions (used by every kernel).

State per row after some logit tiles: m = running max, r = sum_v exp(z_v - m) - 1, and
a = sum_v exp(z_v - m) (z_v - m). Keeping r = l - 1 instead of l = sum exp(z - m) matters when
one logit dominates: l = 1 + eps would be rounded to fp32 and log l = log(1 + eps) would lose
all relative accuracy, so the log-prob of a confident token and a small entropy would be off by
~1e-5 relative; with r, log l = log1p(r) keeps full precision. The element(s) equal to the
running max contribute exactly 1 each, so r is accumulated as
    r = sum_{z_v < m} exp(z_v - m) + (#{z_v = m} - 1)
(no cancellation), rescaled when the max grows. Then

    lse = m + log1p(r),   logp_y = (z_y - m) - log1p(r),   H = log1p(r) - a / (1 + r).

Pure jnp on arrays, so the same code runs inside Triton and Mosaic kernel bodies; `keepdims`
selects [n] (False) or [n, 1] (True, TPU layout) row vectors. Padded columns must hold NEG.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

NEG = -1e30  # finite "minus infinity": exp(NEG - m) == 0 and (NEG - m) * 0 == 0, no NaN


def init(shape):
  """(m, r, a) before any tile: with m = NEG the first update discards r and a."""
  return (jnp.full(shape, NEG, jnp.float32), jnp.zeros(shape, jnp.float32),
          jnp.zeros(shape, jnp.float32))


def update(m, r, a, z, *, keepdims: bool = False, entropy: bool = True,
           separate_reductions: bool = False):
  """State after one more fp32 logit tile z [n, w] (each row with >= 1 entry > NEG).

  Only plain sums of exp-expressions are used (no compare/select inside a reduction): the
  "below the max" mask is arithmetic, min((m - z) * 1e30, 1), and the number of ties with the
  max is round(sum e - sum e * mask), exact since it is a small integer. entropy=False skips
  the `a` sum (a is then returned unchanged). separate_reductions=True puts optimization
  barriers between the sums: XLA:CPU otherwise fuses sibling reductions into one loop that it
  does not vectorise (3-4x slower); not for use inside Pallas kernels.
  """
  red = lambda x: jnp.sum(x, axis=1, keepdims=keepdims)
  col = lambda x: x if keepdims else x[:, None]
  m_new = jnp.maximum(m, jnp.max(z, axis=1, keepdims=keepdims))
  c = jnp.exp(m - m_new)

  def barrier(*xs):
    return lax.optimization_barrier(xs) if separate_reductions else xs

  zz, mm = barrier(z, m_new)
  l_tile = red(jnp.exp(zz - col(mm)))
  zz, mm, _ = barrier(z, m_new, l_tile)
  below = jnp.minimum((col(mm) - zz) * 1e30, 1.0)  # 0 at the max, 1 below it
  s0 = red(jnp.exp(zz - col(mm)) * below)
  ties = (l_tile - s0 + 0.5).astype(jnp.int32).astype(jnp.float32)  # round (Triton has no round)
  l = 1.0 + r
  r_new = jnp.where(m_new > m, c * l + s0 + (ties - 1.0), r + s0 + ties)
  if not entropy:
    return m_new, r_new, a
  zz, mm, _ = barrier(z, m_new, s0)
  zc = zz - col(mm)
  a_new = c * (a + (m - m_new) * l) + red(jnp.exp(zc) * zc)
  return m_new, r_new, a_new


def merge(m, r, a, axis: int = 0):
  """Merges partial states stacked along `axis` (e.g. vocabulary splits) into one."""
  mm = jnp.max(m, axis=axis, keepdims=True)
  c = jnp.exp(m - mm)
  top = m == mm
  l = 1.0 + r
  ties_minus_1 = jnp.sum(top.astype(jnp.float32), axis=axis) - 1.0  # exact; never add 1 to r
  rr = jnp.sum(jnp.where(top, r, c * l), axis=axis) + ties_minus_1
  aa = jnp.sum(c * (a + (m - mm) * l), axis=axis)
  return jnp.squeeze(mm, axis), rr, aa


def finalize(m, r, a, zy):
  """(logp_y, lse, entropy) from a final state and the target's logit z_y."""
  log_l = jnp.log1p(r)
  return (zy - m) - log_l, m + log_l, log_l - a / (1.0 + r)


def block_stats(z):
  """(m, r, a) of a whole fp32 logit block z [n, V] in one go (no tiling)."""
  return update(*init(z.shape[:1]), z)
