"""sft and kl losses, the aggregations they share, and the loss registry's errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.support.losses import (Seq, check_invariances, check_separable, from_bt, layout,
                                loss_value_and_grad, one_per_row, random_seqs, ref_agg_weights,
                                ref_kl, to_bt)
from posttrain_jax.losses import LOSSES, KLConfig, SFTConfig, get_loss

AGGS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]


def _seq(mask, logp, ref=None, adv=0.0):
  mask, logp = np.asarray(mask, float), np.asarray(logp, float)
  ref = logp if ref is None else np.asarray(ref, float)
  return Seq(mask, logp, logp.copy(), np.where(mask > 0, logp, 0.0), ref, ref.copy(), adv)


# 2 sequences: 3 sampled tokens; 1 prompt token then 2 sampled tokens.
HAND = [_seq([1, 1, 1], [-1.0, -2.0, -0.5]), _seq([0, 1, 1], [-9.0, -0.5, -1.5])]


def _run(name, cfg, seqs, **kw):
  lay = layout(seqs, one_per_row(seqs), **kw)
  loss, metrics, grad = loss_value_and_grad(name, cfg, lay, to_bt(lay, [s.logp for s in seqs]))
  return float(loss), metrics, from_bt(lay, grad, seqs)


# ---------------------------------------------------------------- hand-computed


@pytest.mark.parametrize("aggregation, want_loss, want_grad, want_count", [
    # NLLs 1, 2, 0.5 | 0.5, 1.5; 5 sampled tokens.
    ("token_mean", 5.5 / 5, [[-.2, -.2, -.2], [0, -.2, -.2]], 5.0),
    # (3.5/3 + 2/2) / 2 sequences.
    ("seq_mean_token_mean", (3.5 / 3 + 1.0) / 2, [[-1 / 6] * 3, [0, -.25, -.25]], 2.0),
    # Σ NLL / (G · L_max) with G = 2, L_max = 4.
    ("seq_mean_token_sum_norm", 5.5 / 8, [[-.125] * 3, [0, -.125, -.125]], 2.0),
])
def test_sft_hand(aggregation, want_loss, want_grad, want_count):
  cfg = SFTConfig(aggregation=aggregation, max_len=4)
  loss, metrics, grad = _run("sft", cfg, HAND)
  assert loss == pytest.approx(want_loss, rel=1e-6)
  for g, w in zip(grad, want_grad):
    np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(metrics["loss"], (want_loss * want_count, want_count), rtol=1e-6)
  np.testing.assert_allclose(metrics["nll"], (5.5, 5.0), rtol=1e-6)   # token mean, any aggregation


def test_kl_hand():
  # x = ref − logp = 0.5, −0.5, 0 on the sampled tokens (the prompt token is ignored).
  seqs = [_seq([0, 1, 1], [-3.0, -1.0, -2.0], ref=[5.0, -0.5, -2.5]),
          _seq([1], [-1.0], ref=[-1.0])]
  k1, k2 = [-0.5, 0.5, 0.0], [0.125, 0.125, 0.0]
  k3 = [np.exp(0.5) - 1.5, np.exp(-0.5) - 0.5, 0.0]    # 0.148721, 0.106531, 0
  for est, vals, grads in [("k2", k2, [-0.5, 0.5, 0.0]),
                           ("k3", k3, [1 - np.exp(0.5), 1 - np.exp(-0.5), 0.0])]:
    loss, metrics, grad = _run("kl", KLConfig(estimator=est), seqs)
    assert loss == pytest.approx(sum(vals) / 3, abs=1e-6), est
    np.testing.assert_allclose(np.concatenate(grad), np.r_[0.0, grads] / 3, atol=1e-6)
  for est, vals in [("k1", k1), ("k2", k2), ("k3", k3)]:   # k1 stays a metric
    np.testing.assert_allclose(metrics[f"kl_{est}"], (sum(vals), 3.0), rtol=1e-5, atol=1e-6)


def test_kl_against_teacher_field():
  seqs = [_seq([1, 1], [-1.0, -2.0], ref=[-1.0, -2.0])]
  seqs[0].teacher = np.array([-2.0, -1.0])   # x = −1, +1 → k1 = 1, −1 → mean 0; k2 = 0.5
  assert _run("kl", KLConfig(estimator="k2", against="teacher"), seqs)[0] == pytest.approx(0.5)
  assert _run("kl", KLConfig(estimator="k2", against="ref"), seqs)[0] == pytest.approx(0.0)
  # The default estimator against a teacher is k2 (reverse-KL gradient): 0.5, not k3's
  # mean(e^-1 + e^1 − 2)/2 = 0.5431.
  assert _run("kl", KLConfig(against="teacher"), seqs)[0] == pytest.approx(0.5)


# ---------------------------------------------------------------- float64 references


@pytest.mark.parametrize("aggregation", AGGS)
def test_sft_matches_numpy_reference(aggregation):
  seqs = random_seqs(np.random.default_rng(1))
  w = ref_agg_weights(seqs, aggregation, max_len=7)
  want = sum(float(np.sum(-wi * s.logp)) for wi, s in zip(w, seqs))
  with jax.enable_x64(True):
    lay = layout(seqs, one_per_row(seqs), dtype=np.float64)
    loss, _, grad = loss_value_and_grad("sft", SFTConfig(aggregation=aggregation, max_len=7),
                                        lay, to_bt(lay, [s.logp for s in seqs], dtype=np.float64))
    assert loss.dtype == jnp.float64
  np.testing.assert_allclose(float(loss), want, rtol=1e-12)
  for g, wi in zip(from_bt(lay, grad, seqs), w):
    np.testing.assert_allclose(g, -wi, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("estimator", ["k2", "k3"])
def test_kl_matches_numpy_reference(estimator):
  seqs = random_seqs(np.random.default_rng(2))
  w = ref_agg_weights(seqs, "seq_mean_token_mean")
  want, want_grad = 0.0, []
  for wi, s in zip(w, seqs):
    g = np.zeros(len(s))
    for t in range(len(s)):
      k, dk = ref_kl(s.ref[t] - s.logp[t], estimator)
      want += wi[t] * k
      g[t] = wi[t] * dk
    want_grad.append(g)
  with jax.enable_x64(True):
    lay = layout(seqs, one_per_row(seqs), dtype=np.float64)
    loss, _, grad = loss_value_and_grad(
        "kl", KLConfig(estimator=estimator, aggregation="seq_mean_token_mean"), lay,
        to_bt(lay, [s.logp for s in seqs], dtype=np.float64))
  np.testing.assert_allclose(float(loss), want, rtol=1e-12)
  for g, wg in zip(from_bt(lay, grad, seqs), want_grad):
    np.testing.assert_allclose(g, wg, rtol=1e-12, atol=1e-15)


# ---------------------------------------------------------------- invariances and separability


CASES = [("sft", SFTConfig(aggregation=a, max_len=9)) for a in AGGS] + [
    ("kl", KLConfig(estimator=e, aggregation=a, max_len=9))
    for e, a in [("k2", "token_mean"), ("k3", "seq_mean_token_mean"),
                 (None, "seq_mean_token_sum_norm")]] + [
    ("kl", KLConfig(against="teacher")), ("kl", KLConfig(against="old", estimator="k2"))]


@pytest.mark.parametrize("name, cfg", CASES)
def test_packed_equals_unpacked_and_microbatched_equals_full(name, cfg):
  check_invariances(name, cfg, random_seqs(np.random.default_rng(3)), split=3)


@pytest.mark.parametrize("name, cfg", CASES)
def test_separable_form(name, cfg):
  check_separable(name, cfg, random_seqs(np.random.default_rng(5)))


def test_empty_batch_is_zero_with_zero_count():
  seqs = [_seq([0, 0], [-1.0, -2.0])]
  for name, cfg in CASES:
    loss, metrics, grad = _run(name, cfg, seqs)
    assert loss == 0.0 and float(metrics["loss"][1]) in (0.0, 1.0), name
    assert np.all(np.concatenate(grad) == 0.0), name


# ---------------------------------------------------------------- registry and config errors


def test_unknown_loss_lists_registered_names():
  with pytest.raises(KeyError) as e:
    get_loss("gpro")
  for name in ["cispo", "grpo", "gspo", "kl", "m2po", "sft"]:
    assert name in str(e.value)
  assert set(LOSSES.names()) >= {"cispo", "grpo", "gspo", "kl", "m2po", "sft"}


def test_specs_declare_separability_and_config():
  for name in ["sft", "kl", "grpo", "cispo", "m2po"]:
    assert get_loss(name).separable, name
  assert not get_loss("gspo").separable
  assert get_loss("sft").config_cls is SFTConfig and get_loss("kl").config_cls is KLConfig


def test_config_errors_name_the_choices():
  with pytest.raises(KeyError, match="seq_mean_token_mean"):
    SFTConfig(aggregation="seq_mean")
  with pytest.raises(ValueError, match="max_len"):
    SFTConfig(aggregation="seq_mean_token_sum_norm")
  with pytest.raises(KeyError, match="k1, k2, k3"):
    KLConfig(estimator="k4")
  with pytest.raises(ValueError, match="teacher"):
    KLConfig(against="student")


def test_missing_batch_field_is_named():
  seqs = random_seqs(np.random.default_rng(6))
  lay = layout(seqs, one_per_row(seqs), fields=("old",))
  with pytest.raises(ValueError, match="batch.ref_logp"):
    loss_value_and_grad("kl", KLConfig(), lay, to_bt(lay, [s.logp for s in seqs]))
