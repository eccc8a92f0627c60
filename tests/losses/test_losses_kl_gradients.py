"""Which KL the sampled-token estimators follow when used as a loss, by exact enumeration.

A categorical π_θ = softmax(θ) over V tokens and a fixed q. Used as a loss, k(x_y) with
x_y = log q(y) − log π_θ(y) is differentiated through log π_θ(y) only, for a sample y ~ π_θ,
so the expected gradient is Σ_y π_θ(y) · dk/dlogp(y) · ∇_θ log π_θ(y), with
∇_θ log π_θ(y) = e_y − π_θ. That sum is computed exactly (float64 numpy, per-token dk/dlogp
taken from the library's losses) and compared with ∇_θ KL(π_θ‖q) and ∇_θ KL(q‖π_θ), which
are themselves checked against central finite differences. Claims (losses/kl.py):
k1 → 0 (no signal toward q), k2 → reverse KL(π_θ‖q), k3 → forward KL(q‖π_θ).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.support.losses import Seq, layout, loss_value_and_grad, one_per_row, to_bt
from posttrain_jax.losses import (CISPOConfig, GRPOConfig, GSPOConfig, KLConfig, M2POConfig,
                                  kl_estimate)

V = 7


def _softmax(z):
  e = np.exp(z - z.max())
  return e / e.sum()


def _kl(p, q):
  return float(np.sum(p * (np.log(p) - np.log(q))))


@pytest.fixture(params=[0, 1, 2])
def case(request):
  rng = np.random.default_rng(request.param)
  theta = rng.normal(0.0, 1.0, V)
  q = _softmax(rng.normal(0.0, 1.0, V))
  return theta, q


def _analytic(theta, q):
  """(∇_θ KL(π‖q), ∇_θ KL(q‖π)) in closed form, checked against finite differences."""
  pi = _softmax(theta)
  d = np.log(pi) - np.log(q)
  grad_rev = pi * (d - np.sum(pi * d))
  grad_fwd = pi - q
  h = 1e-6
  for i in range(V):
    e = np.zeros(V)
    e[i] = h
    fd_rev = (_kl(_softmax(theta + e), q) - _kl(_softmax(theta - e), q)) / (2 * h)
    fd_fwd = (_kl(q, _softmax(theta + e)) - _kl(q, _softmax(theta - e))) / (2 * h)
    assert fd_rev == pytest.approx(grad_rev[i], abs=1e-8)
    assert fd_fwd == pytest.approx(grad_fwd[i], abs=1e-8)
  return pi, grad_rev, grad_fwd


def _token_grads(name, cfg, logp, other):
  """dℓ/dlogp for every vocabulary token as its own one-token sequence, from the library loss
  (token_mean over V tokens, so × V gives the per-token derivative)."""
  seqs = [Seq(np.ones(1), np.array([lp]), np.array([other_t]), np.array([other_t]),
              np.array([other_t]), np.array([other_t]), 0.0) for lp, other_t in zip(logp, other)]
  with jax.enable_x64(True):
    lay = layout(seqs, one_per_row(seqs), dtype=np.float64)
    _, _, grad = loss_value_and_grad(name, cfg, lay, to_bt(lay, [s.logp for s in seqs],
                                                           dtype=np.float64))
  return V * np.asarray(grad)[:, 0]


def _estimator_grads(estimator, logp, other):
  """dk/dlogp of the registered estimator itself (k1 is refused as a loss, so this way)."""
  with jax.enable_x64(True):
    f = lambda lp: jnp.sum(kl_estimate(lp, jnp.asarray(other), estimator))
    return np.asarray(jax.grad(f)(jnp.asarray(logp)))


def _expected_grad(pi, dk_dlogp):
  score = np.eye(V) - pi[None, :]               # row y: ∇_θ log π(y)
  return np.sum(pi[:, None] * dk_dlogp[:, None] * score, axis=0)


def test_estimator_gradients_follow_the_documented_kl(case):
  theta, q = case
  pi, grad_rev, grad_fwd = _analytic(theta, q)
  logp, logq = np.log(pi), np.log(q)
  x = logq - logp
  closed_form = {"k1": np.ones(V), "k2": -x, "k3": 1.0 - np.exp(x)}   # dk/dlogp
  want = {"k1": np.zeros(V), "k2": grad_rev, "k3": grad_fwd}
  assert np.abs(grad_rev - grad_fwd).max() > 1e-2, "the two KLs must be told apart"
  for est in ("k1", "k2", "k3"):
    dk = _estimator_grads(est, logp, logq)
    np.testing.assert_allclose(dk, closed_form[est], rtol=1e-12, atol=1e-14, err_msg=est)
    np.testing.assert_allclose(_expected_grad(pi, dk), want[est], rtol=1e-10, atol=1e-13,
                               err_msg=est)
  # k1's expected gradient is 0 whatever q is; k2's is not the forward, k3's not the reverse.
  assert np.abs(_expected_grad(pi, closed_form["k2"]) - grad_fwd).max() > 1e-2
  assert np.abs(_expected_grad(pi, closed_form["k3"]) - grad_rev).max() > 1e-2


def test_the_losses_kl_terms_follow_the_same_kls(case):
  """Through the registered losses: 'kl' and grpo's β·k term (A = 0, so only the KL acts)."""
  theta, q = case
  pi, grad_rev, grad_fwd = _analytic(theta, q)
  logp, logq = np.log(pi), np.log(q)
  want = {"k2": grad_rev, "k3": grad_fwd}
  for est in ("k2", "k3"):
    for name, cfg in (("kl", KLConfig(estimator=est)),
                      ("grpo", GRPOConfig(kl_coef=1.0, kl_estimator=est))):
      got = _expected_grad(pi, _token_grads(name, cfg, logp, logq))
      np.testing.assert_allclose(got, want[est], rtol=1e-10, atol=1e-13, err_msg=f"{name} {est}")


def test_estimator_values(case):
  """As values: E k1 = E k3 = KL(π‖q) (unbiased), E k2 is not."""
  theta, q = case
  pi = _softmax(theta)
  x = np.log(q) - np.log(pi)
  kl = _kl(pi, q)
  with jax.enable_x64(True):
    k = {e: np.asarray(kl_estimate(jnp.asarray(np.log(pi)), jnp.asarray(np.log(q)), e))
         for e in ("k1", "k2", "k3")}
  assert np.sum(pi * k["k1"]) == pytest.approx(kl, rel=1e-12)
  assert np.sum(pi * k["k3"]) == pytest.approx(kl, rel=1e-12)
  np.testing.assert_allclose(k["k2"], 0.5 * x * x, rtol=1e-12)
  assert np.sum(pi * k["k2"]) != pytest.approx(kl, rel=1e-6)   # biased


# ---------------------------------------------------------------- configs that follow from it


def test_k1_is_refused_as_a_loss_term():
  with pytest.raises(ValueError, match="KLConfig.estimator='k1' cannot be a loss term"):
    KLConfig(estimator="k1")
  for cls in (GRPOConfig, CISPOConfig, GSPOConfig, M2POConfig):
    with pytest.raises(ValueError, match=f"{cls.__name__}.kl_estimator.*'k1' cannot be a loss"):
      cls(kl_coef=0.1, kl_estimator="k1")
    cls(kl_estimator="k1")   # kl_coef = 0: only the `kl` metric uses it


def test_k1_stays_a_metric():
  pi = _softmax(np.random.default_rng(3).normal(size=3))
  seqs = [Seq(np.ones(3), np.log(pi), np.log(pi), np.log(pi), np.log(pi[::-1]),
              np.log(pi[::-1]), 1.0)]
  lay = layout(seqs, one_per_row(seqs))
  _, metrics, _ = loss_value_and_grad("grpo", GRPOConfig(kl_estimator="k1"), lay,
                                      to_bt(lay, [s.logp for s in seqs]))
  want = np.sum(np.log(pi) - np.log(pi[::-1]))    # Σ −x
  np.testing.assert_allclose(metrics["kl"], (want, 3.0), rtol=1e-5, atol=1e-6)


def test_default_estimators():
  assert KLConfig(against="teacher").resolved_estimator == "k2"   # reverse KL to the teacher
  assert KLConfig().resolved_estimator == "k3"                    # reference: as before
  assert KLConfig(against="old").resolved_estimator == "k3"
  assert KLConfig(estimator="k3", against="teacher").resolved_estimator == "k3"
  for cls in (GRPOConfig, CISPOConfig, GSPOConfig, M2POConfig):
    assert cls().kl_estimator == "k3"                             # GRPO's reference KL
