"""Mixed precision and remat: bf16 compute stays close to fp32; remat changes nothing."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain_jax.models import hf_io
from tests.support.learner import CFG


def _logits_and_grad(cfg, seed=0):
  model = hf_io.init_model(cfg, seed)
  graphdef, params = nnx.split(model, nnx.Param)
  ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12)))
  pos = jnp.broadcast_to(jnp.arange(12), ids.shape)

  def f(p):
    m = nnx.merge(graphdef, p)
    logits = m.logits(m(ids, pos)[0])
    return jnp.mean(jax.nn.log_softmax(logits)[..., 0]), logits
  # jitted, as the learner runs it: one compile instead of hundreds of op-by-op ones
  (_, logits), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(params)
  return np.asarray(logits, np.float32), grads


@pytest.mark.slow  # > 30 s: CI's slow stage
def test_bf16_compute_close_to_fp32():
  ref, _ = _logits_and_grad(CFG)
  got, _ = _logits_and_grad(CFG.replace(compute_dtype="bfloat16"))
  scale = np.abs(ref).max()
  assert np.abs(got - ref).max() <= 0.05 * scale  # bf16 has 8 mantissa bits
  assert np.abs(got - ref).max() > 0  # really computed in bf16


def test_remat_same_values_and_grads():
  ref, g_ref = _logits_and_grad(CFG)
  got, g_got = _logits_and_grad(CFG.replace(remat=True))
  np.testing.assert_allclose(got, ref, atol=1e-6)
  for a, b in zip(jax.tree.leaves(g_ref), jax.tree.leaves(g_got)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
