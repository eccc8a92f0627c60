"""Off-policy corrections, alone and composed with grpo / cispo."""
import jax
import numpy as np
import pytest

from tests.support.losses import (Seq, check_invariances, check_separable, from_bt, layout,
                                loss_value_and_grad, one_per_row, random_seqs, ref_correction,
                                ref_pg, to_bt)
from posttrain_jax.losses import (CORRECTIONS, CISPOConfig, DecoupledConfig, GeoMaskConfig,
                                  GRPOConfig, IcePopConfig, M2POMaskConfig, MISConfig,
                                  SeqTISConfig, TISConfig, get_loss)
from posttrain_jax.losses import off_policy


def _seq(rho, adv, ratio=None, prompt=0):
  """Sampled tokens with ρ = π_old/μ and r = π_θ/π_old (1 by default), after `prompt` tokens."""
  rho = np.asarray(rho, float)
  ratio = np.ones_like(rho) if ratio is None else np.asarray(ratio, float)
  mask = np.r_[np.zeros(prompt), np.ones(len(rho))]
  logp = np.r_[np.full(prompt, -3.0), -1.0 - 0.1 * np.arange(len(rho))]
  old = logp - np.r_[np.zeros(prompt), np.log(ratio)]
  beh = np.where(mask > 0, old - np.r_[np.zeros(prompt), np.log(rho)], 0.0)
  return Seq(mask, logp, old, beh, logp.copy(), logp.copy(), float(adv))


HAND = [_seq([0.3, 1.0, 3.0], +1.0), _seq([1.5, 0.4], -1.0, prompt=1)]


def _terms(name, cfg, seqs):
  lay = layout(seqs, one_per_row(seqs))
  terms = off_policy.correction_terms(name, cfg, lay.batch, "test")
  return [from_bt(lay, x, seqs) for x in (terms.weight_bt, terms.clipped_bt, terms.masked_bt)]


def _run(name, cfg, seqs, **kw):
  lay = layout(seqs, one_per_row(seqs), **kw)
  loss, metrics, grad = loss_value_and_grad(name, cfg, lay, to_bt(lay, [s.logp for s in seqs]))
  return float(loss), metrics, from_bt(lay, grad, seqs)


# ρ = 0.3, 1, 3 | (prompt) 1.5, 0.4.  Expected c_t, and which tokens are clipped / masked.
HAND_CASES = [
    ("none", None, [1, 1, 1, 1, 1], 0, 0),
    ("tis", TISConfig(cap=2.0), [0.3, 1, 2, 1.5, 0.4], 1, 0),
    # Π ρ = 0.9 (capped at 0.8) and 0.6.
    ("seq_tis", SeqTISConfig(cap=0.8), [0.8, 0.8, 0.8, 0.6, 0.6], 3, 0),
    ("mis", MISConfig(), [0, 1, 0, 1.5, 0], 0, 3),
    # ρ = 0.3 < veto drops all of sequence 1.
    ("mis", MISConfig(veto=0.35), [0, 0, 0, 1.5, 0], 0, 4),
    ("icepop", IcePopConfig(), [0, 1, 3, 1.5, 0], 0, 2),
    ("decoupled", DecoupledConfig(), [0.3, 1, 3, 1.5, 0.4], 0, 0),
    ("decoupled", DecoupledConfig(cap=2.5), [0.3, 1, 0, 1.5, 0.4], 0, 1),
    # d = (log ρ)² = 1.4496, 0, 1.2069 | 0.1644, 0.8396; mean 0.732 ≥ τ → drop 1.4496 (0.552),
    # 1.2069 (0.335), 0.8396 → rest {0, 0.1644} has mean 0.0822 < 0.1: stop.
    ("m2po_mask", M2POMaskConfig(tau=0.1), [0, 1, 0, 1, 0], 0, 3),
    # With τ = 0.04 one more goes: only ρ = 1 stays.
    ("m2po_mask", M2POMaskConfig(), [0, 1, 0, 0, 0], 0, 4),
]


@pytest.mark.parametrize("name, cfg, want, n_clipped, n_masked", HAND_CASES)
def test_correction_hand(name, cfg, want, n_clipped, n_masked):
  weight, clipped, masked = _terms(name, cfg, HAND)
  np.testing.assert_allclose(np.r_[weight[0], weight[1][1:]], want, rtol=1e-5)
  assert weight[1][0] == 0.0   # the prompt token
  assert np.concatenate(clipped).sum() == n_clipped
  assert np.concatenate(masked).sum() == n_masked
  # Through grpo with r = 1: ℓ_t = −A c_t, token mean over 5 tokens, gradient −A c_t / 5.
  loss, metrics, grad = _run("grpo", GRPOConfig(correction=name, correction_cfg=cfg), HAND)
  c = np.asarray(want, float)
  assert loss == pytest.approx((-c[:3].sum() + c[3:].sum()) / 5, abs=1e-6)
  np.testing.assert_allclose(np.r_[grad[0], grad[1][1:]], np.r_[-c[:3], c[3:]] / 5, atol=1e-6)
  if name != "none":
    np.testing.assert_allclose(metrics["correction/is_weight_mean"], (c.sum(), 5.0), rtol=1e-5)
    np.testing.assert_allclose(metrics["correction/is_weight_min"], (c.min(), 1.0), rtol=1e-5)
    np.testing.assert_allclose(metrics["correction/is_weight_max"], (c.max(), 1.0), rtol=1e-5)
    np.testing.assert_allclose(metrics["correction/clip_frac"], (n_clipped, 5.0))
    np.testing.assert_allclose(metrics["correction/mask_frac"], (n_masked, 5.0))
  else:
    assert "correction/is_weight_mean" not in metrics


def test_behaviour_metrics_hand():
  # log π_θ − log μ = log ρ (r = 1): |·| = 1.20397, 0, 1.09861, 0.40547, 0.91629 → Σ 3.62434;
  # k3 = ρ − 1 − log ρ = 0.50397, 0, 0.90139, 0.09453, 0.31629 → Σ 1.81619.
  for cfg in (GRPOConfig(), GRPOConfig(correction="tis")):
    _, metrics, _ = _run("grpo", cfg, HAND)
    np.testing.assert_allclose(metrics["correction/abs_logp_diff"], (3.62434, 5.0), rtol=1e-5)
    np.testing.assert_allclose(metrics["correction/kl_behaviour_k3"], (1.81619, 5.0), rtol=1e-5)


def test_geo_mask_hand():
  # Geometric means: sqrt(1.005) = 1.0025 kept; sqrt(1.05) = 1.0247 > 1.01 dropped;
  # 0.97^(1/3) = 0.98990 < 0.99 dropped.
  seqs = [_seq([1.005, 1.0], 1.0), _seq([1.05, 1.0], 1.0), _seq([0.97, 1.0, 1.0], 1.0)]
  weight, _, masked = _terms("geo_mask", GeoMaskConfig(), seqs)
  np.testing.assert_array_equal(np.concatenate(weight), [1, 1, 0, 0, 0, 0, 0])
  np.testing.assert_array_equal(np.concatenate(masked), [0, 0, 1, 1, 1, 1, 1])
  weight, _, _ = _terms("geo_mask", GeoMaskConfig(low=0.98, high=1.03), seqs)
  np.testing.assert_array_equal(np.concatenate(weight), [1] * 7)


def test_decoupled_ppo_hand():
  # AReaL: ℓ = −(π_prox/μ)·min(u A, clip(u, 0.8, 1.28) A), u = π_θ/π_prox, A = 1.
  # u = 1.5, ρ = 2: −2 · 1.28 = −2.56 (clipped, no gradient); u = 0.9, ρ = 0.5: −0.45, grad −0.45.
  seqs = [_seq([2.0, 0.5], 1.0, ratio=[1.5, 0.9])]
  loss, _, grad = _run("grpo", GRPOConfig(correction="decoupled"), seqs)
  assert loss == pytest.approx((-2.56 - 0.45) / 2, abs=1e-6)
  np.testing.assert_allclose(grad[0], [0.0, -0.225], atol=1e-6)
  # Naive PPO on the same data ignores ρ.
  assert _run("grpo", GRPOConfig(), seqs)[0] == pytest.approx((-1.28 - 0.9) / 2, abs=1e-6)


def test_cispo_with_correction_hand():
  # CISPO with r = 1: ℓ = −A·1·logp; TIS weights 0.3, 1, 2 | 1.5, 0.4;
  # logp = −1, −1.1, −1.2 | −1, −1.1.
  loss, _, grad = _run("cispo", CISPOConfig(correction="tis"), HAND)
  c = np.array([0.3, 1.0, 2.0, 1.5, 0.4])
  lp = np.array([-1.0, -1.1, -1.2, -1.0, -1.1])
  a = np.array([1, 1, 1, -1, -1.0])
  assert loss == pytest.approx(np.sum(-a * c * lp) / 5, abs=1e-6)
  np.testing.assert_allclose(np.r_[grad[0], grad[1][1:]], -a * c / 5, atol=1e-6)


# ---------------------------------------------------------------- references and invariances

REF_CASES = [
    ("tis", TISConfig(cap=1.3), dict(cap=1.3)),
    ("seq_tis", SeqTISConfig(cap=1.5), dict(cap=1.5)),
    ("mis", MISConfig(veto=0.6), dict(low=0.5, high=2.0, veto=0.6)),
    ("icepop", IcePopConfig(low=0.7, high=1.5), dict(low=0.7, high=1.5)),
    ("geo_mask", GeoMaskConfig(low=0.9, high=1.1), dict(low=0.9, high=1.1)),
    ("decoupled", DecoupledConfig(cap=1.5), dict(cap=1.5)),
    ("m2po_mask", M2POMaskConfig(tau=0.04), dict(tau=0.04)),
]


@pytest.mark.parametrize("name, cfg, params", REF_CASES)
def test_correction_matches_numpy_reference(name, cfg, params):
  seqs = random_seqs(np.random.default_rng(40), spread=0.3)
  want = ref_correction(seqs, name, **params)
  flat = np.concatenate(want)
  mask = np.concatenate([s.mask for s in seqs]) > 0
  rho = np.concatenate([np.exp(s.old - s.beh) for s in seqs])[mask]
  assert np.any(~np.isclose(flat[mask], rho)) and np.any(flat[mask] > 0), "rule never triggers"
  if name in ("geo_mask", "m2po_mask"):
    assert set(flat[mask]) == {0.0, 1.0}
  with jax.enable_x64(True):
    lay = layout(seqs, one_per_row(seqs), dtype=np.float64)
    got = from_bt(lay, off_policy.correction_terms(name, cfg, lay.batch, "test").weight_bt, seqs)
    loss, _, grad = loss_value_and_grad(
        "grpo", GRPOConfig(correction=name, correction_cfg=cfg, aggregation="seq_mean_token_mean"),
        lay, to_bt(lay, [s.logp for s in seqs], dtype=np.float64))
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-15)
  want_loss, want_grad = ref_pg(seqs, "grpo", eps_low=0.2, eps_high=0.28,
                                aggregation="seq_mean_token_mean", corr=want)
  np.testing.assert_allclose(float(loss), want_loss, rtol=1e-10)
  for g, w in zip(from_bt(lay, grad, seqs), want_grad):
    np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("name, cfg, params", REF_CASES)
def test_invariances_with_correction(name, cfg, params):
  """m2po_mask is a statistic of the whole call: packed == unpacked holds, micro-batching
  changes it by design (see losses/off_policy.py), so only the layout check runs for it."""
  seqs = random_seqs(np.random.default_rng(41), spread=0.3)
  check_invariances("grpo", GRPOConfig(correction=name, correction_cfg=cfg), seqs, split=3,
                    microbatch=name != "m2po_mask")


def test_m2po_mask_is_per_call():
  """Micro-batches each get their own second-moment mask (documented); here it differs."""
  seqs = random_seqs(np.random.default_rng(42), spread=0.3)
  full = np.concatenate(_terms("m2po_mask", M2POMaskConfig(), seqs)[0])
  parts = np.concatenate([np.concatenate(_terms("m2po_mask", M2POMaskConfig(), p)[0])
                          for p in (seqs[:3], seqs[3:])])
  assert not np.array_equal(full, parts)
  for p in (seqs[:3], seqs[3:], seqs):     # in every call the kept tokens meet the bound
    w = np.concatenate(_terms("m2po_mask", M2POMaskConfig(), p)[0])
    d = np.concatenate([(s.old - s.beh) ** 2 for s in p])[np.concatenate([s.mask for s in p]) > 0]
    kept = w[np.concatenate([s.mask for s in p]) > 0] > 0
    assert d[kept].mean() < 0.04 and (kept.sum() == 0 or d[~kept].min() >= d[kept].max())


@pytest.mark.parametrize("name, cfg, params", REF_CASES)
def test_separable_with_correction(name, cfg, params):
  seqs = random_seqs(np.random.default_rng(43), spread=0.3)
  check_separable("grpo", GRPOConfig(correction=name, correction_cfg=cfg, kl_coef=0.05), seqs)


# ---------------------------------------------------------------- errors


def test_unknown_correction_lists_registered_names():
  with pytest.raises(KeyError) as e:
    GRPOConfig(correction="tiss")
  for name in ["decoupled", "geo_mask", "icepop", "m2po_mask", "mis", "none", "seq_tis", "tis"]:
    assert name in str(e.value)
  assert {"decoupled", "geo_mask", "icepop", "m2po_mask", "mis", "none", "seq_tis",
          "tis"} <= set(CORRECTIONS.names())   # a correction added in a new file joins them


def test_old_correction_name_m2po_points_to_both_forms():
  with pytest.raises(ValueError, match="loss 'm2po'.*correction 'm2po_mask'"):
    GRPOConfig(correction="m2po")


def test_wrong_correction_config_type_is_named():
  with pytest.raises(TypeError, match="MISConfig"):
    GRPOConfig(correction="mis", correction_cfg=TISConfig())


def test_a_correction_needs_old_and_behaviour_logp_on_both_paths():
  """No stop_gradient(logp) stand-in for a missing old_logp, on the loss function either."""
  seqs = random_seqs(np.random.default_rng(44))
  lay = layout(seqs, one_per_row(seqs), fields=("beh",))
  with pytest.raises(ValueError, match="batch.old_logp"):
    get_loss("grpo").token_terms(lay.batch, GRPOConfig(correction="tis"))
  with pytest.raises(ValueError, match="batch.old_logp"):
    _run("grpo", GRPOConfig(correction="tis"), seqs, fields=("beh",))
  with pytest.raises(ValueError, match="batch.behaviour_logp"):
    _run("grpo", GRPOConfig(correction="icepop"), seqs, fields=("old",))
