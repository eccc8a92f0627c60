"""engines/sampling.py's top-k + top-p truncation finds the nucleus by bisection over the logits'
order keys (no sort of the vocabulary); it must keep exactly the tokens the sort-based definition
keeps: v stays iff the mass of the tokens more likely than v is < p (ties kept together, -0.0
and 0.0 one value, -inf never kept unless p = 1)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain_jax.engines.sampling import _truncate


def _by_sorting(s_bv, top_p_b, top_k_b):
  """The definition, with a sort (what the sampler computed before)."""
  v = s_bv.shape[-1]
  desc_bv = jnp.sort(s_bv, axis=-1)[:, ::-1]
  kth_b1 = jnp.take_along_axis(desc_bv, jnp.clip(top_k_b - 1, 0, v - 1)[:, None], -1)
  by_k_b1 = (top_k_b > 0)[:, None]
  masked_bv = jnp.where(by_k_b1 & (s_bv < kth_b1), -jnp.inf, s_bv)
  sorted_bv = jnp.where(by_k_b1 & (desc_bv < kth_b1), -jnp.inf, desc_bv)
  probs_bv = jax.nn.softmax(sorted_bv, axis=-1)
  cum_before_bv = jnp.cumsum(probs_bv, axis=-1) - probs_bv
  cutoff_b1 = jnp.min(jnp.where(cum_before_bv < top_p_b[:, None], sorted_bv, jnp.inf), axis=-1,
                      keepdims=True)
  return jnp.where((top_p_b < 1.0)[:, None] & (masked_bv < cutoff_b1), -jnp.inf, masked_bv)


@pytest.mark.parametrize("vocab", [16, 64, 1000])
def test_the_nucleus_is_the_sorted_definitions(vocab):
  rng = np.random.default_rng(vocab)
  ours, theirs = jax.jit(_truncate), jax.jit(_by_sorting)
  kept = []
  for trial in range(60):
    s = rng.normal(size=(8, vocab)).astype(np.float32) * rng.choice([0.1, 1.0, 5.0])
    if trial % 3 == 0:
      s = np.round(s, 1)            # ties, and -0.0 beside 0.0
    if trial % 5 == 0:
      s[:, : vocab // 3] = -np.inf  # tokens a mask already took out
    p = rng.choice([0.05, 0.5, 0.9, 0.99, 1.0], size=8).astype(np.float32)
    k = rng.choice([0, 0, 1, 5, 40, 64, 65, 2000], size=8).astype(np.int32)
    a, b = np.asarray(ours(s, p, k)), np.asarray(theirs(s, p, k))
    np.testing.assert_array_equal(a, b, err_msg=f"trial {trial}: p={p} k={k}")
    kept.append(np.isfinite(a).sum(-1))
  kept = np.concatenate(kept)
  assert kept.min() >= 1 and kept.max() > 1   # rows kept one token and rows kept many
