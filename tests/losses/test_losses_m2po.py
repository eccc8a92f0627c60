"""M2PO (Zheng et al. 2025): the second-moment mask *instead of* the PPO ε-clip (loss "m2po"),
against the hybrid that keeps the clip (grpo with correction "m2po_mask")."""
import jax
import numpy as np
import pytest

from tests.support.losses import (Seq, check_invariances, check_separable, from_bt, layout,
                                loss_value_and_grad, one_per_row, random_seqs, ref_correction,
                                ref_m2po, to_bt)
from posttrain_jax.losses import GRPOConfig, M2POConfig, M2POMaskConfig


def _seq(rho, ratio, adv):
  """Sampled tokens with ρ = π_old/μ and r = π_θ/π_old."""
  rho, ratio = np.asarray(rho, float), np.asarray(ratio, float)
  logp = -1.0 - 0.1 * np.arange(len(rho))
  old = logp - np.log(ratio)
  return Seq(np.ones(len(rho)), logp, old, old - np.log(rho), logp.copy(), logp.copy(),
             float(adv))


def _run(name, cfg, seqs):
  lay = layout(seqs, one_per_row(seqs))
  loss, metrics, grad = loss_value_and_grad(name, cfg, lay, to_bt(lay, [s.logp for s in seqs]))
  return float(loss), metrics, from_bt(lay, grad, seqs)


# ρ = 1, 3, 1.1 (A = +1) | 0.9, 0.2 (A = −1); r = π_θ/π_old = 1.5, 1, 1 | 0.5, 1.
# d = (log ρ)² = 0, 1.20695, 0.00908 | 0.01110, 2.59029: mean 0.763 ≥ τ = 0.04 → drop 2.59029
# (rest mean 0.307) → drop 1.20695 (rest mean 0.00673 < τ): kept ρ = 1, 1.1 | 0.9.
HAND = [_seq([1.0, 3.0, 1.1], [1.5, 1.0, 1.0], 1.0), _seq([0.9, 0.2], [0.5, 1.0], -1.0)]
D = np.log([1.0, 3.0, 1.1, 0.9, 0.2]) ** 2


def test_m2po_hand():
  # r^μ = π_θ/μ = r·ρ = 1.5, 3, 1.1 | 0.45, 0.2. ℓ = −M·r^μ·A, no clip:
  #   −1.5, 0 (dropped), −1.1 | +0.45, 0 (dropped); token mean over 5: −2.15 / 5 = −0.43.
  # dℓ/dlogp = −M·r^μ·A / 5: the r = 1.5 token keeps its gradient (PPO would clip it at 1.28).
  loss, metrics, grad = _run("m2po", M2POConfig(), HAND)
  assert loss == pytest.approx(-0.43, abs=1e-6)
  np.testing.assert_allclose(grad[0], [-0.3, 0.0, -0.22], atol=1e-6)
  np.testing.assert_allclose(grad[1], [0.09, 0.0], atol=1e-6)
  np.testing.assert_allclose(metrics["loss"], (-2.15, 5.0), rtol=1e-5)
  np.testing.assert_allclose(metrics["ratio_mean"], (6.25, 5.0), rtol=1e-5)
  np.testing.assert_allclose(metrics["correction/mask_frac"], (2.0, 5.0))
  np.testing.assert_allclose(metrics["m2po/second_moment"], (D.sum(), 5.0), rtol=1e-5)
  np.testing.assert_allclose(metrics["m2po/second_moment_kept"], (D[[0, 2, 3]].sum(), 3.0),
                             rtol=1e-4)


def test_m2po_ratio_against_old():
  # r = π_θ/π_old: −1.5, 0, −1 | +0.5, 0 → −2 / 5; gradients −M·r·A / 5.
  loss, _, grad = _run("m2po", M2POConfig(ratio_base="old"), HAND)
  assert loss == pytest.approx(-0.4, abs=1e-6)
  np.testing.assert_allclose(np.concatenate(grad), [-0.3, 0.0, -0.2, 0.1, 0.0], atol=1e-6)


def test_the_hybrid_keeps_the_clip():
  # grpo + m2po_mask: ℓ = −M·min(rA, clip(r, 0.8, 1.28)A): r = 1.5 (A > 0) is clipped at
  # −1.28 and r = 0.5 (A < 0) at 0.8, both without gradient; r = 1 gives −1.
  # (−1.28 − 1 + 0.8) / 5 = −0.296.
  loss, _, grad = _run("grpo", GRPOConfig(correction="m2po_mask"), HAND)
  assert loss == pytest.approx(-0.296, abs=1e-6)
  np.testing.assert_allclose(np.concatenate(grad), [0.0, 0.0, -0.2, 0.0, 0.0], atol=1e-6)


CASES = [
    dict(),
    dict(tau=0.02, aggregation="seq_mean_token_mean"),
    dict(ratio_base="old", aggregation="seq_mean_token_sum_norm", max_len=8, kl_coef=0.2,
         kl_estimator="k2"),
    dict(tau=0.06, kl_coef=0.1),
]


@pytest.mark.parametrize("kw", CASES)
def test_m2po_matches_numpy_reference(kw):
  seqs = random_seqs(np.random.default_rng(60), spread=0.3)
  keep = np.concatenate(ref_correction(seqs, "m2po_mask", tau=kw.get("tau", 0.04)))
  live = np.concatenate([s.mask for s in seqs]) > 0
  assert 0 < keep[live].sum() < live.sum(), "the mask should drop some tokens, not all"
  want, want_grad = ref_m2po(seqs, **kw)
  with jax.enable_x64(True):
    lay = layout(seqs, one_per_row(seqs), dtype=np.float64)
    loss, metrics, grad = loss_value_and_grad(
        "m2po", M2POConfig(**kw), lay, to_bt(lay, [s.logp for s in seqs], dtype=np.float64))
  np.testing.assert_allclose(float(loss), want, rtol=1e-10)
  for g, w in zip(from_bt(lay, grad, seqs), want_grad):
    np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-14)
  np.testing.assert_allclose(metrics["correction/mask_frac"],
                             (live.sum() - keep[live].sum(), live.sum()))


@pytest.mark.parametrize("kw", CASES[:3])
def test_m2po_separable_and_packed(kw):
  """Separable form vs the reference; packed == unpacked. The mask is a statistic of the call,
  so micro-batched ≠ full by design (losses/off_policy.py) and is not checked."""
  seqs = random_seqs(np.random.default_rng(61), spread=0.3)
  check_separable("m2po", M2POConfig(**kw), seqs)
  check_invariances("m2po", M2POConfig(**kw), seqs, microbatch=False)


def test_m2po_config_errors():
  with pytest.raises(ValueError, match="M2POConfig.tau"):
    M2POConfig(tau=0.0)
  with pytest.raises(ValueError, match="ratio_base"):
    M2POConfig(ratio_base="ref")
  with pytest.raises(ValueError, match="max_len"):
    M2POConfig(aggregation="seq_mean_token_sum_norm")
  with pytest.raises(ValueError, match="M2POMaskConfig.tau"):
    M2POMaskConfig(tau=-1.0)
