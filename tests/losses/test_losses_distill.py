"""sampled_distill (losses/distill.py): hand values, a float64 NumPy reference, and by exact
enumeration over a small vocabulary, the claim that its expected gradient is that of the
reverse KL(π_θ‖T) (on-policy, or off-policy with the importance weight unclipped)."""
import dataclasses

import jax
import numpy as np
import pytest

from tests.support.losses import (Seq, check_invariances, check_separable, from_bt, layout,
                                loss_value_and_grad, one_per_row, random_seqs, ref_agg_weights,
                                ref_distill, to_bt)
from posttrain_jax.losses import DistillConfig

NAME = "sampled_distill"
FIELDS = ("beh", "teacher", "teacher_mask")
V = 7


def _seq(mask, logp, ratio, teacher, adv, tmask):
  """A sequence with log μ = logp − log(ratio) (0 off the mask, as engines report)."""
  mask, logp = np.asarray(mask, float), np.asarray(logp, float)
  beh = np.where(mask > 0, logp - np.log(np.asarray(ratio, float)), 0.0)
  return Seq(mask, logp, logp.copy(), beh, logp.copy(), np.asarray(teacher, float), float(adv),
             np.asarray(tmask, float))


def _run(cfg, seqs, dtype=np.float32):
  lay = layout(seqs, one_per_row(seqs), fields=FIELDS, dtype=dtype)
  loss, metrics, grad = loss_value_and_grad(NAME, cfg, lay,
                                            to_bt(lay, [s.logp for s in seqs], dtype=dtype))
  metrics = {k: np.asarray(v, float) for k, v in metrics.items()}
  return float(loss), metrics, from_bt(lay, grad, seqs)


def _random_seqs(seed):
  """random_seqs with π_θ/μ spread past the clip; seq 0 has no teacher, seq 2 a partial one.
  Where m = 0 the teacher holds 50: a leak of it into the loss could not go unnoticed."""
  seqs = random_seqs(np.random.default_rng(seed), spread=0.6)
  rng = np.random.default_rng(seed + 100)
  seqs[0].teacher_mask = np.zeros(len(seqs[0]))
  seqs[2].teacher_mask = (rng.random(len(seqs[2])) < 0.5).astype(float)
  seqs[2].teacher_mask[-2:] = [0.0, 1.0]
  for s in seqs:
    s.teacher = np.where(s.teacher_mask > 0, s.teacher, 50.0)
  return seqs


# ---------------------------------------------------------------- hand-computed

# Seq 1: a prompt token, then logp −1, −2 with π_θ/μ = 0.5, 3 and log T = −0.5, −3; Â = +1.
# Seq 2: logp −1.2, π_θ/μ = 1, no teacher (m = 0; its log T is NaN and must be ignored); Â = 2.
HAND = [_seq([0, 1, 1], [-9.0, -1.0, -2.0], [1.0, 0.5, 3.0], [0.0, -0.5, -3.0], 1.0, [1, 1, 1]),
        _seq([1], [-1.2], [1.0], [np.nan], 2.0, [0])]
# δ = log T − logp = 0.5, −1 | (m = 0).  ℓ = −ρ·A·logp, dℓ/dlogp = −ρ·A, token_mean over 3:
#   rl_coef = 0.5, c = 2: ρ = 0.5, min(3, 2) = 2, 1;  A = 0.5 + 0.5, −1 + 0.5, 0.5·2 = 1, −0.5, 1
#     ℓ = 0.5, −2, 1.2 → loss −0.3/3;  dℓ/dlogp = −0.5, 1, −1
#   pure distillation, no ρ: A = 0.5, −1, 0;  ℓ = 0.5, −2, 0 → −1.5/3;  dℓ/dlogp = −0.5, 1, 0


@pytest.mark.parametrize("cfg, want, want_grad", [
    (DistillConfig(rl_coef=0.5), -0.3 / 3, [[0, -0.5, 1], [-1]]),
    (DistillConfig(is_clip=None), -1.5 / 3, [[0, -0.5, 1], [0]]),
], ids=["rl_mix_clipped", "pure_distill_no_rho"])
def test_hand(cfg, want, want_grad):
  loss, metrics, grad = _run(cfg, HAND)
  assert loss == pytest.approx(want, abs=1e-6)
  for g, w in zip(grad, want_grad):
    np.testing.assert_allclose(g, np.asarray(w) / 3, atol=1e-6)
  np.testing.assert_allclose(metrics["loss"], (want * 3, 3.0), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(metrics["nll"], (4.2, 3.0), rtol=1e-6)
  np.testing.assert_allclose(metrics["distill/reverse_kl"], (-0.5 + 1.0, 2.0), rtol=1e-6)
  np.testing.assert_allclose(metrics["distill/teacher_token_frac"], (2.0, 3.0))  # not the prompt
  if cfg.is_clip is None:
    assert not any(k.startswith("is_weight/") for k in metrics)
  else:
    np.testing.assert_allclose(metrics["is_weight/mean"], (0.5 + 2.0 + 1.0, 3.0), rtol=1e-6)
    np.testing.assert_allclose(metrics["is_weight/clipped_frac"], (1.0, 3.0))


# ---------------------------------------------------------------- float64 reference

CONFIGS = [DistillConfig(), DistillConfig(is_clip=None),
           DistillConfig(coef=0.7, rl_coef=0.3, is_clip=1.5, aggregation="seq_mean_token_mean"),
           DistillConfig(coef=0.0, rl_coef=1.0, is_clip=None),
           DistillConfig(rl_coef=0.5, aggregation="seq_mean_token_sum_norm", max_len=9)]


def _ref_metrics(seqs, cfg):
  """The metrics as (sum, count) pairs, straight from their definitions."""
  tok = [(s, t) for s in seqs for t in range(len(s)) if s.mask[t]]
  scored = [(s, t) for s, t in tok if s.teacher_mask[t]]
  n = float(len(tok))
  counts = {"token_mean": n, "seq_mean_token_mean": sum(s.mask.sum() > 0 for s in seqs),
            "seq_mean_token_sum_norm": len(seqs)}
  loss, _ = ref_distill(seqs, **dataclasses.asdict(cfg))
  c = counts[cfg.aggregation]
  out = {"loss": (loss * c, c), "nll": (sum(-s.logp[t] for s, t in tok), n),
         "distill/reverse_kl": (sum(s.logp[t] - s.teacher[t] for s, t in scored), len(scored)),
         "distill/teacher_token_frac": (len(scored), n)}
  if cfg.is_clip is not None:
    x = np.array([s.logp[t] - s.beh[t] for s, t in tok])
    out["is_weight/mean"] = (np.minimum(np.exp(x), cfg.is_clip).sum(), n)
    out["is_weight/clipped_frac"] = (np.sum(x > np.log(cfg.is_clip)), n)
  return out


@pytest.mark.parametrize("cfg", CONFIGS)
def test_matches_numpy_reference(cfg):
  seqs = _random_seqs(7)
  with jax.enable_x64(True):
    loss, metrics, grad = _run(cfg, seqs, dtype=np.float64)
  want, want_grad = ref_distill(seqs, **dataclasses.asdict(cfg))
  np.testing.assert_allclose(loss, want, rtol=1e-12)
  for g, w in zip(grad, want_grad):
    np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-15)
  want_metrics = _ref_metrics(seqs, cfg)
  assert set(metrics) == set(want_metrics)
  for k, w in want_metrics.items():
    np.testing.assert_allclose(metrics[k], w, rtol=1e-5, atol=1e-6, err_msg=k)
  # The case covers what it claims: clipped ratios, sampled tokens without a teacher.
  if cfg.is_clip is not None:
    assert 0 < want_metrics["is_weight/clipped_frac"][0] < want_metrics["nll"][1]
  frac = want_metrics["distill/teacher_token_frac"]
  assert 0 < frac[0] < frac[1]
  if cfg.rl_coef == 0:   # no teacher, no RL term: no gradient at all
    assert all(np.all(g[(s.teacher_mask == 0) & (s.mask > 0)] == 0) for g, s in zip(grad, seqs))
    assert sum(np.abs(g).sum() for g in grad) > 0


@pytest.mark.parametrize("cfg", CONFIGS)
def test_packed_equals_unpacked_and_microbatched_equals_full(cfg):
  check_invariances(NAME, cfg, _random_seqs(3), fields=FIELDS)


@pytest.mark.parametrize("cfg", CONFIGS)
def test_separable_form(cfg):
  check_separable(NAME, cfg, _random_seqs(5), fields=FIELDS)


# ---------------------------------------------------------------- exact enumeration


def _softmax(z):
  e = np.exp(z - z.max())
  return e / e.sum()


@pytest.fixture(params=[0, 1, 2])
def dists(request):
  """(π_θ, T, μ) over V tokens, and ∇_θ KL(π_θ‖T) w.r.t. the logits θ = log π_θ."""
  rng = np.random.default_rng(request.param)
  pi, teacher, mu = (_softmax(rng.normal(0.0, 1.0, V)) for _ in range(3))
  d = np.log(pi) - np.log(teacher)
  grad_rev = pi * (d - np.sum(pi * d))
  kl = lambda th: np.sum(_softmax(th) * (np.log(_softmax(th)) - np.log(teacher)))
  h, th = 1e-6, np.log(pi)
  fd = [(kl(th + h * e) - kl(th - h * e)) / (2 * h) for e in np.eye(V)]
  np.testing.assert_allclose(fd, grad_rev, atol=1e-8)
  assert (pi / mu).max() > 2, "μ should put some ratios past the clip"
  return pi, teacher, mu, grad_rev


def _expected_grad(cfg, pi, teacher, mu, sample):
  """E_{y ~ sample}[dℓ/dlogp(y) · ∇_θ log π_θ(y)], ∇_θ log π_θ(y) = e_y − π_θ, exactly: every
  token y is its own one-token sequence (token_mean over V, so × V is the per-token dℓ/dlogp)."""
  seqs = [_seq([1], [np.log(p)], [p / m], [np.log(t)], 0.0, [1])
          for p, t, m in zip(pi, teacher, mu)]
  with jax.enable_x64(True):
    _, _, grad = _run(cfg, seqs, dtype=np.float64)
  dl = V * np.concatenate(grad)
  return np.sum(sample[:, None] * dl[:, None] * (np.eye(V) - pi[None, :]), axis=0)


def test_on_policy_expected_gradient_is_the_reverse_kl(dists):
  pi, teacher, _, grad_rev = dists
  assert np.abs(grad_rev).max() > 1e-2
  for cfg, mu in ((DistillConfig(is_clip=None), pi), (DistillConfig(), pi)):   # ρ = 1
    got = _expected_grad(cfg, pi, teacher, mu, pi)
    np.testing.assert_allclose(got, grad_rev, rtol=1e-10, atol=1e-13)
    # Descending the loss descends the KL: a flipped sign, or the forward KL, would fail.
    assert np.abs(got + grad_rev).max() > 1e-2
    assert np.abs(got - (pi - teacher)).max() > 1e-2


def test_off_policy_importance_weight(dists):
  """y ~ μ: ρ = π_θ/μ (unclipped) restores the reverse-KL gradient; without ρ, or clipped at
  c = 2 while some ratio exceeds it, the expectation is a different one."""
  pi, teacher, mu, grad_rev = dists
  got = _expected_grad(DistillConfig(is_clip=1e6), pi, teacher, mu, mu)
  np.testing.assert_allclose(got, grad_rev, rtol=1e-10, atol=1e-13)
  for cfg in (DistillConfig(is_clip=None), DistillConfig(is_clip=2.0)):
    assert np.abs(_expected_grad(cfg, pi, teacher, mu, mu) - grad_rev).max() > 1e-3, cfg
  rho = np.minimum(pi / mu, 2.0)   # clipped: E_μ[ρ_c δ ∇log π_θ] exactly
  delta = np.log(teacher) - np.log(pi)
  want = np.sum((mu * rho * -delta)[:, None] * (np.eye(V) - pi[None, :]), axis=0)
  np.testing.assert_allclose(_expected_grad(DistillConfig(), pi, teacher, mu, mu), want,
                             rtol=1e-10, atol=1e-13)


# ---------------------------------------------------------------- config errors


def test_config_errors():
  with pytest.raises(ValueError, match="coef=0.0 and rl_coef=0.0 must be ≥ 0 and not both 0"):
    DistillConfig(coef=0.0)
  with pytest.raises(ValueError, match="coef=-1.0"):
    DistillConfig(coef=-1.0, rl_coef=1.0)
  with pytest.raises(ValueError, match="rl_coef=-0.5"):
    DistillConfig(rl_coef=-0.5)
  for c in (0.0, -1.0, float("nan")):
    with pytest.raises(ValueError, match="DistillConfig.is_clip must be > 0 or None"):
      DistillConfig(is_clip=c)
  with pytest.raises(ValueError, match="max_len"):
    DistillConfig(aggregation="seq_mean_token_sum_norm")
  with pytest.raises(KeyError, match="token_mean"):
    DistillConfig(aggregation="tokens")
  DistillConfig(coef=0.0, rl_coef=1.0)   # pure RL through this loss is allowed
