"""One decode step's draw with every sampling value traced: one compiled program serves them all.

Row b of a batch, with logits z, temperature tau, top-k k and nucleus mass p (arrays of shape
[B], so rows may differ):

    tau = 0 (greedy):  y = argmax z                              logp = log softmax(z)
    tau > 0:           s = z / tau                               logp = log softmax(s)
                       K = {v : s_v >= s_(k)}      s_(k) the k-th largest (k = 0: every v)
                       N = {v in K : mass of K's tokens more likely than v < p}  (p = 1: K)
                       y ~ softmax(s restricted to N)            (Gumbel-max: jax.random.categorical)

and the log-prob returned for y is logp[y]: the temperature-scaled distribution *before* top-k /
top-p truncation, what the learner computes at the same temperature. `top_logprobs` = the k_top
largest entries of logp (ids, values); k_top is the one static number (it is a shape).

Compared with compiling tau, k, p in (a program per value): the ops are the same on the same
values, so the same tokens are drawn, and the log-probs agree to float32 rounding (XLA fuses the
two graphs differently: at most 2.4e-7 apart, measured; tests/engines/test_jax_sampler_compiles.py
keeps the static version as the reference). What makes one program serve every value:
  * greedy rows are picked with `jnp.where` after the draw; the batch's one key draws every
    row's Gumbel noise whatever the rows ask, so rows never change each other's draws (an
    all-greedy batch skips the draw under `lax.cond`; its key is split all the same);
  * the k-th largest value is read at a traced index (k - 1) of the row's values sorted, or,
    when no row asks for top-p and every k <= 64, of `lax.top_k(s, 64)` (k static there); ties
    with it are kept, as before;
  * truncation runs under `lax.switch`, only when some row truncates: plain sampling (k = 0,
    p = 1) pays nothing for it, top-k alone no sort; top-p sorts the vocabulary, as before.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def top_entries(logp_bv: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """The k largest log-probs of each row and their ids: (ids_bk int32, logps_bk); k = 0: empty."""
  if k == 0:
    b = logp_bv.shape[0]
    return jnp.zeros((b, 0), jnp.int32), jnp.zeros((b, 0), jnp.float32)
  vals, ids = jax.lax.top_k(logp_bv, k)
  return ids.astype(jnp.int32), vals


_CANDIDATES = 64   # top-k alone, every k at most this: `lax.top_k` of this many, no sort


def _top_k_only(s_bv: jax.Array, top_p_b: jax.Array, top_k_b: jax.Array) -> jax.Array:
  """`_truncate` when no row asks for top-p and every top_k <= _CANDIDATES."""
  del top_p_b
  vals_bc = jax.lax.top_k(s_bv, min(_CANDIDATES, s_bv.shape[-1]))[0]
  kth_b1 = jnp.take_along_axis(vals_bc, jnp.clip(top_k_b - 1, 0, vals_bc.shape[-1] - 1)[:, None],
                               -1)
  return jnp.where((top_k_b > 0)[:, None] & (s_bv < kth_b1), -jnp.inf, s_bv)


def _order_keys(x: jax.Array) -> jax.Array:
  """int32 keys in the order of the float32 values (-inf lowest; -0.0 and 0.0 one key, as they
  compare equal): for x >= 0 its bits, for x < 0 its bits with all but the sign flipped."""
  x = x.astype(jnp.float32)
  bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, jnp.float32(0), x), jnp.int32)
  return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def _nucleus_key(s_bv: jax.Array, top_p_b: jax.Array) -> jax.Array:
  """K[b] = the key of the least likely token of row b's nucleus: the smallest key K with
  mass(key > K) < p (found by bisection over the int32 keys, 32 halvings of a masked sum; no
  sort). A token v is in the nucleus iff the mass of tokens more likely than it is < p, iff
  key(s_v) >= K: the mass above is non-increasing in the key and changes only at a token's."""
  keys_bv = _order_keys(s_bv)
  probs_bv = jax.nn.softmax(s_bv, axis=-1)
  b = s_bv.shape[0]
  lo = jnp.full((b,), jnp.iinfo(jnp.int32).min, jnp.int32)   # mass(key > lo) = 1 >= p
  hi = jnp.full((b,), jnp.iinfo(jnp.int32).max, jnp.int32)   # mass(key > hi) = 0 < p

  def halve(_, bounds):
    lo, hi = bounds
    mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)              # no int32 overflow
    above = jnp.sum(jnp.where(keys_bv > mid[:, None], probs_bv, 0.0), axis=-1)
    small = above < top_p_b
    return jnp.where(small, lo, mid), jnp.where(small, mid, hi)
  return jax.lax.fori_loop(0, 32, halve, (lo, hi))[1]


def _truncate(s_bv: jax.Array, top_p_b: jax.Array, top_k_b: jax.Array) -> jax.Array:
  """s with the tokens outside each row's top-k, then outside its nucleus, set to -inf. The
  nucleus without sorting the vocabulary (`_nucleus_key`): XLA's CPU sort of a [8, 49152] row
  block took 58.7 ms a decode step (SmolLM2's vocabulary), and top-p calls through the proxy
  3.4x the latency of plain ones on the tiny model (benchmarks/README.md, --vary_only)."""
  if s_bv.shape[-1] > _CANDIDATES:   # the k-th value: a sort only for a k past the candidates
    v = s_bv.shape[-1]
    by_k = jnp.any(top_k_b > _CANDIDATES)
    kth_b1 = jax.lax.cond(
        by_k, lambda s: jnp.take_along_axis(jnp.sort(s, axis=-1)[:, ::-1],
                                            jnp.clip(top_k_b - 1, 0, v - 1)[:, None], -1),
        lambda s: jnp.take_along_axis(jax.lax.top_k(s, _CANDIDATES)[0],
                                      jnp.clip(top_k_b - 1, 0, _CANDIDATES - 1)[:, None], -1),
        s_bv)
  else:
    kth_b1 = jnp.take_along_axis(jax.lax.top_k(s_bv, s_bv.shape[-1])[0],
                                 jnp.clip(top_k_b - 1, 0, s_bv.shape[-1] - 1)[:, None], -1)
  masked_bv = jnp.where((top_k_b > 0)[:, None] & (s_bv < kth_b1), -jnp.inf, s_bv)
  cut_b1 = _nucleus_key(masked_bv, top_p_b)[:, None]
  return jnp.where((top_p_b < 1.0)[:, None] & (_order_keys(masked_bv) < cut_b1), -jnp.inf,
                   masked_bv)


def sample(logits_bv: jax.Array, rng: jax.Array, temperature_b: jax.Array, top_p_b: jax.Array,
           top_k_b: jax.Array, k_top: int):
  """(ids_b, logps_b, top_ids_bk, top_logps_bk) of one step (module docstring)."""
  logits_bv = logits_bv.astype(jnp.float32)
  greedy_b = temperature_b <= 0
  tau_b1 = jnp.where(greedy_b, 1.0, temperature_b).astype(jnp.float32)[:, None]
  s_bv = logits_bv / tau_b1            # greedy rows: z / 1 = z exactly
  logp_bv = jax.nn.log_softmax(s_bv)
  sampled_b = ~greedy_b
  top_p_b = jnp.where(sampled_b, top_p_b, 1.0)    # greedy rows truncate nothing
  top_k_b = jnp.where(sampled_b, top_k_b, 0)
  kind = jnp.where(jnp.all((top_k_b == 0) & (top_p_b >= 1.0)), 0,
                   jnp.where(jnp.all(top_p_b >= 1.0) & jnp.all(top_k_b <= _CANDIDATES), 1, 2))
  masked_bv = jax.lax.switch(kind, (lambda s, p, k: s, _top_k_only, _truncate), s_bv, top_p_b,
                             top_k_b)
  drawn_b = jax.lax.cond(jnp.any(sampled_b),
                         lambda m, key: jax.random.categorical(key, m, axis=-1).astype(jnp.int32),
                         lambda m, key: jnp.zeros(m.shape[:1], jnp.int32), masked_bv, rng)
  ids_b = jnp.where(greedy_b, jnp.argmax(logits_bv, axis=-1), drawn_b)
  logps_b = jnp.take_along_axis(logp_bv, ids_b[:, None], -1)[:, 0]
  return (ids_b, logps_b, *top_entries(logp_bv, k_top))


def length_bucket(max_tokens: int, smallest: int = 16) -> int:
  """The decode buffer length compiled for `max_tokens`: the next power of two (at least
  `smallest`), so every max_tokens up to it reuses one program; the loop still stops at
  max_tokens."""
  return max(smallest, 1 << max(int(max_tokens) - 1, 0).bit_length())
