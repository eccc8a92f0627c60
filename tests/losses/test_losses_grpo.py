"""grpo (PPO-clip, dual-clip, aggregations, KL term), cispo and gspo."""

import jax
import numpy as np
import pytest

from tests.support.losses import (Seq, check_invariances, check_separable, from_bt, layout,
                                loss_value_and_grad, one_per_row, random_seqs, ref_gspo,
                                ref_loss, to_bt)
from posttrain_jax.losses import CISPOConfig, GRPOConfig, GSPOConfig, TISConfig


def _seq(mask, logp, ratio, adv, ref=None):
  """A sequence with log π_old = logp − log(ratio) and μ = π_old."""
  mask, logp = np.asarray(mask, float), np.asarray(logp, float)
  old = logp - np.log(np.asarray(ratio, float))
  beh = old
  ref = logp.copy() if ref is None else np.asarray(ref, float)
  return Seq(mask, logp, old, np.where(mask > 0, beh, 0.0), ref, ref.copy(), float(adv))


def _run(name, cfg, seqs, **kw):
  lay = layout(seqs, one_per_row(seqs), **kw)
  loss, metrics, grad = loss_value_and_grad(name, cfg, lay, to_bt(lay, [s.logp for s in seqs]))
  return float(loss), metrics, from_bt(lay, grad, seqs)


# A = +1 with ratios 1, 1.5, 0.5; A = −1 with a prompt token and ratios 1.5, 0.5.
HAND = [_seq([1, 1, 1], [-1.0, -1.0, -1.0], [1.0, 1.5, 0.5], +1.0),
        _seq([0, 1, 1], [-2.0, -1.0, -1.0], [1.0, 1.5, 0.5], -1.0)]
# ε = 0.2 / 0.28 → clip(r) = 1, 1.28, 0.8.  ℓ = −min(rA, clip(r)A):
#   A = +1: −1, −1.28 (clipped, no gradient), −0.5            Σ = −2.78
#   A = −1:  1.5, 0.8 (clipped, no gradient)                  Σ = 2.3
# d ℓ/d logp = −A r where unclipped: −1, 0, −0.5 | 1.5, 0.


@pytest.mark.parametrize("aggregation, want, want_grad, count", [
    ("token_mean", -0.48 / 5, [[-0.2, 0, -0.1], [0, 0.3, 0]], 5.0),
    ("seq_mean_token_mean", (-2.78 / 3 + 2.3 / 2) / 2,
     [[-1 / 6, 0, -1 / 12], [0, 0.375, 0]], 2.0),
    ("seq_mean_token_sum_norm", -0.48 / 8, [[-0.125, 0, -0.0625], [0, 0.1875, 0]], 2.0),
])
def test_grpo_hand(aggregation, want, want_grad, count):
  cfg = GRPOConfig(aggregation=aggregation, max_len=4)
  loss, metrics, grad = _run("grpo", cfg, HAND)
  assert loss == pytest.approx(want, abs=1e-6)
  for g, w in zip(grad, want_grad):
    np.testing.assert_allclose(g, w, atol=1e-6)
  np.testing.assert_allclose(metrics["loss"], (want * count, count), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(metrics["clip_frac_high"], (1.0, 5.0))   # r = 1.5 with A > 0
  np.testing.assert_allclose(metrics["clip_frac_low"], (1.0, 5.0))    # r = 0.5 with A < 0
  np.testing.assert_allclose(metrics["ratio_mean"], (5.0, 5.0), rtol=1e-6)


def test_grpo_dual_clip_hand():
  # A = −1, r = 4: PPO gives max(4, 1.28) = 4; dual-clip c = 3 caps it at 3 (no gradient).
  # r = 2: 2 < 3 stays, gradient −A r = 2.  A = +1, r = 4: dual-clip does not apply → −1.28.
  seqs = [_seq([1, 1], [-1.0, -1.0], [4.0, 2.0], -1.0), _seq([1], [-1.0], [4.0], 1.0)]
  loss, metrics, grad = _run("grpo", GRPOConfig(dual_clip_c=3.0), seqs)
  assert loss == pytest.approx((3.0 + 2.0 - 1.28) / 3, abs=1e-6)
  np.testing.assert_allclose(np.concatenate(grad), [0.0, 2.0 / 3, 0.0], atol=1e-6)
  np.testing.assert_allclose(metrics["dual_clip_frac"], (1.0, 3.0))
  loss_plain, _, _ = _run("grpo", GRPOConfig(), seqs)
  assert loss_plain == pytest.approx((4.0 + 2.0 - 1.28) / 3, abs=1e-6)


def test_grpo_kl_term_hand():
  # On-policy (r = 1), A = 0.5; x = ref − logp = 0.5, −0.5; β = 0.1, k2 = x²/2 = 0.125 each.
  seqs = [_seq([1, 1], [-1.0, -1.0], [1.0, 1.0], 0.5, ref=[-0.5, -1.5])]
  loss, metrics, grad = _run("grpo", GRPOConfig(kl_coef=0.1, kl_estimator="k2"), seqs)
  assert loss == pytest.approx((-0.5 + 0.1 * 0.125) * 2 / 2, abs=1e-6)
  # d/dlogp: −A r + β·(−x) = −0.5 − 0.05 | −0.5 + 0.05, each / 2 tokens.
  np.testing.assert_allclose(grad[0], [-0.275, -0.225], atol=1e-6)
  np.testing.assert_allclose(metrics["kl"], (0.25, 2.0), rtol=1e-6)
  np.testing.assert_allclose(metrics["pg_loss"], (-1.0, 2.0), rtol=1e-6)


def test_grpo_without_old_logp_is_on_policy_reinforce():
  # old = stop_gradient(logp): r = 1, value −Σ A w, gradient −A w.
  seqs = [_seq([1, 1, 0], [-1.0, -2.0, -3.0], [1.7, 0.2, 1.0], 2.0)]
  loss, metrics, grad = _run("grpo", GRPOConfig(), seqs, fields=("beh", "ref"))
  assert loss == pytest.approx(-2.0, abs=1e-6)
  np.testing.assert_allclose(grad[0], [-1.0, -1.0, 0.0], atol=1e-6)
  np.testing.assert_allclose(metrics["ratio_mean"], (2.0, 2.0))
  # A correction needs log π_old: given as the learner's value before the update (= logp),
  # TIS weighs by ρ = π_θ/μ; missing, it is an error (no stop_gradient(logp) stand-in).
  seqs[0].beh = np.array([-1.0 - np.log(3.0), -2.0 + np.log(2.0), 0.0])    # ρ = 3, 0.5
  seqs[0].old = seqs[0].logp.copy()
  loss, _, grad = _run("grpo", GRPOConfig(correction="tis"), seqs, fields=("old", "beh"))
  assert loss == pytest.approx(-2.0 * (2.0 + 0.5) / 2, abs=1e-5)
  np.testing.assert_allclose(grad[0], [-2.0, -0.5, 0.0], atol=1e-5)
  with pytest.raises(ValueError, match="batch.old_logp"):
    _run("grpo", GRPOConfig(correction="tis"), seqs, fields=("beh",))


def test_cispo_hand():
  # A = 1, logp = −1, −2 with r = 1, 7 → sg(clip(r, 0, 6)) = 1, 6; ℓ = −A·w·logp = 1, 12.
  # A = −2, logp = −0.5 with r = 0.25 → w = 0.25; ℓ = −(−2)(0.25)(−0.5) = −0.25.
  seqs = [_seq([1, 1], [-1.0, -2.0], [1.0, 7.0], 1.0), _seq([1], [-0.5], [0.25], -2.0)]
  loss, metrics, grad = _run("cispo", CISPOConfig(), seqs)
  assert loss == pytest.approx((1 + 12 - 0.25) / 3, abs=1e-5)
  np.testing.assert_allclose(np.concatenate(grad), [-1 / 3, -2.0, 0.5 / 3], atol=1e-6)
  np.testing.assert_allclose(metrics["clip_frac_high"], (1.0, 3.0))


def test_cispo_ratio_against_behaviour():
  # The same r = 1, 7 against π_old, but μ = π_θ: against μ the ratio is 1 (no weight 6).
  seqs = [_seq([1, 1], [-1.0, -2.0], [1.0, 7.0], 1.0)]
  seqs[0].beh = seqs[0].logp.copy()
  loss, _, grad = _run("cispo", CISPOConfig(ratio_base="behaviour"), seqs)
  assert loss == pytest.approx((1 + 2) / 2, abs=1e-6)
  np.testing.assert_allclose(grad[0], [-0.5, -0.5], atol=1e-6)


def test_gspo_hand():
  # Sequence 1 (A = +1): log r = 1e-3, 1e-3 → s = e^1e-3 > 1 + 4e-4 → clipped: ℓ = −1.0004, no
  # gradient. Sequence 2 (A = −1): log r = +1e-4, −1e-4 → s = 1, ℓ = 1, dℓ/dlogp_t = −A s / 2.
  seqs = [_seq([1, 1], [-1.0, -1.0], np.exp([1e-3, 1e-3]), 1.0),
          _seq([0, 1, 1], [-1.0, -1.0, -1.0], np.exp([0.0, 1e-4, -1e-4]), -1.0)]
  loss, metrics, grad = _run("gspo", GSPOConfig(), seqs)
  assert loss == pytest.approx((-1.0004 + 1.0) / 2, abs=1e-6)
  np.testing.assert_allclose(grad[0], [0.0, 0.0], atol=1e-7)
  np.testing.assert_allclose(grad[1], [0.0, 0.25, 0.25], atol=1e-6)
  np.testing.assert_allclose(metrics["clip_frac_high"], (1.0, 2.0))
  np.testing.assert_allclose(metrics["loss"][1], 2.0)


@pytest.mark.parametrize("spread", [0.05, 0.5])
def test_gspo_correction_weights_each_sequence_by_its_tokens_mean_weight(spread):
  """Async GSPO is corrected (it had no slot): sequence i's term times c̄_i = mean_t min(ρ_t,
  cap), ρ_t = π_old/μ, computed here in numpy from the sequences alone; the gradient likewise."""
  seqs = random_seqs(np.random.default_rng(7), spread=spread)
  base = GSPOConfig(eps_low=0.2, eps_high=0.2)
  cap = 1.5
  corrected = GSPOConfig(eps_low=0.2, eps_high=0.2, correction="tis",
                         correction_cfg=TISConfig(cap=cap))
  n = len(seqs)
  want, want_grad = 0.0, []
  for s in seqs:   # each sequence alone: its own uncorrected loss and gradient, times c̄_i
    loss_i, _, grad_i = _run("gspo", base, [s])
    m = s.mask > 0
    c_bar = float(np.mean(np.minimum(np.exp(s.old[m] - s.beh[m]), cap)))
    want += c_bar * loss_i / n
    want_grad.append(c_bar * grad_i[0] / n)
  loss, metrics, grad = _run("gspo", corrected, seqs)
  assert loss == pytest.approx(want, rel=1e-5, abs=1e-7)
  for g, w in zip(grad, want_grad):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-7)
  assert "correction/is_weight_mean" in metrics
  uncorrected, _, _ = _run("gspo", base, seqs)
  assert uncorrected != pytest.approx(loss, rel=1e-3)   # the weights were not all 1


def test_async_gspo_gets_the_async_correction():
  from posttrain_jax.run_config import run_config_from_dict
  cfg = run_config_from_dict({"rl": {"mode": "async", "learner": {"loss": "gspo"}}})
  assert cfg.loss_config().correction == "tis"
  assert run_config_from_dict({"rl": {"learner": {"loss": "gspo"}}}).loss_config().correction \
      == "none"


# ---------------------------------------------------------------- float64 references

PG_CASES = [
    dict(aggregation="token_mean"),
    dict(aggregation="seq_mean_token_mean", dual_clip_c=1.5, kl_coef=0.2, kl_estimator="k2"),
    dict(aggregation="seq_mean_token_sum_norm", max_len=8, kl_coef=0.3, kl_estimator="k3"),
    dict(aggregation="token_mean", kl_coef=0.1, kl_estimator="k2", correction="tis"),
    dict(aggregation="seq_mean_token_mean", correction="mis"),
]


@pytest.mark.parametrize("kind, cls", [("grpo", GRPOConfig), ("cispo", CISPOConfig)])
@pytest.mark.parametrize("case", range(len(PG_CASES)))
def test_pg_matches_numpy_reference(kind, cls, case):
  kw = dict(PG_CASES[case])
  if cls is CISPOConfig:
    kw.pop("dual_clip_c", None)
  cfg = cls(**kw)
  seqs = random_seqs(np.random.default_rng(10 + case), spread=0.5)
  want, want_grad = ref_loss(kind, cfg, seqs)
  with jax.enable_x64(True):
    lay = layout(seqs, one_per_row(seqs), dtype=np.float64)
    loss, _, grad = loss_value_and_grad(kind, cfg, lay,
                                        to_bt(lay, [s.logp for s in seqs], dtype=np.float64))
  np.testing.assert_allclose(float(loss), want, rtol=1e-10)
  for g, w in zip(from_bt(lay, grad, seqs), want_grad):
    np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("kw, spread", [
    (dict(), 5e-4),
    (dict(kl_coef=0.2, kl_estimator="k3", eps_low=0.05, eps_high=0.05), 0.1)])
def test_gspo_matches_numpy_reference(kw, spread):
  seqs = random_seqs(np.random.default_rng(39), spread=spread)
  cfg = GSPOConfig(**kw)
  want, want_grad = ref_gspo(seqs, **kw)
  with jax.enable_x64(True):
    lay = layout(seqs, one_per_row(seqs), dtype=np.float64)
    loss, metrics, grad = loss_value_and_grad(
        "gspo", cfg, lay, to_bt(lay, [s.logp for s in seqs], dtype=np.float64))
  # Which sequences the clip removes, counted independently from the sequences' own numbers:
  # clipped below if s_i < 1 − ε_low with A < 0, above if s_i > 1 + ε_high with A > 0. The
  # case (seed 39, both spreads) has one of each, and a sequence outside the range whose
  # advantage sign keeps its gradient (not counted), and sequences inside the range.
  ratio = np.array([np.exp(np.mean((s.logp - s.old)[s.mask > 0])) for s in seqs])
  adv = np.array([s.adv for s in seqs])
  low, high = ratio < 1 - cfg.eps_low, ratio > 1 + cfg.eps_high
  assert np.sum(low & (adv < 0)) == 1 and np.sum(high & (adv > 0)) == 1
  assert np.sum((low & (adv > 0)) | (high & (adv < 0))) >= 1 and np.sum(~low & ~high) >= 1
  np.testing.assert_array_equal(metrics["clip_frac_low"], (1.0, len(seqs)))
  np.testing.assert_array_equal(metrics["clip_frac_high"], (1.0, len(seqs)))
  np.testing.assert_allclose(float(loss), want, rtol=1e-10)
  for g, w in zip(from_bt(lay, grad, seqs), want_grad):
    np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-14)


# ---------------------------------------------------------------- invariances and separability

INV_CASES = [
    ("grpo", GRPOConfig()),
    ("grpo", GRPOConfig(aggregation="seq_mean_token_mean", dual_clip_c=2.0, kl_coef=0.1)),
    ("grpo", GRPOConfig(aggregation="seq_mean_token_sum_norm", max_len=9, kl_coef=0.1,
                        kl_estimator="k2", correction="seq_tis")),
    ("cispo", CISPOConfig(aggregation="seq_mean_token_mean", correction="tis",
                          correction_cfg=TISConfig(cap=1.5))),
    ("gspo", GSPOConfig(eps_low=0.05, eps_high=0.05, kl_coef=0.1)),
]


@pytest.mark.parametrize("name, cfg", INV_CASES)
def test_packed_equals_unpacked_and_microbatched_equals_full(name, cfg):
  seqs = random_seqs(np.random.default_rng(30), spread=0.3)
  check_invariances(name, cfg, seqs, split=4)


@pytest.mark.parametrize("name, cfg", [c for c in INV_CASES if c[0] != "gspo"])
def test_separable_form(name, cfg):
  check_separable(name, cfg, random_seqs(np.random.default_rng(32), spread=0.5))


def test_separable_form_on_policy():
  """old_logp None: token_terms leaves the base None and token_loss uses sg(logp)."""
  check_separable("grpo", GRPOConfig(kl_coef=0.1), random_seqs(np.random.default_rng(33)),
                  fields=("ref",))


def test_grpo_config_errors():
  with pytest.raises(KeyError, match="token_mean"):
    GRPOConfig(aggregation="sequence")
  with pytest.raises(ValueError, match="max_len"):
    GRPOConfig(aggregation="seq_mean_token_sum_norm")
  with pytest.raises(ValueError, match="dual_clip_c"):
    GRPOConfig(dual_clip_c=0.5)
  with pytest.raises(KeyError, match="k3"):
    CISPOConfig(kl_estimator="k5")
  with pytest.raises(ValueError, match="ratio_base"):
    CISPOConfig(ratio_base="ref")
  seqs = random_seqs(np.random.default_rng(34))
  with pytest.raises(ValueError, match="batch.ref_logp"):
    _run("grpo", GRPOConfig(kl_coef=0.1), seqs, fields=("old", "beh"))
