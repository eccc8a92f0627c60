"""full_distill (losses/full_distill.py): values and gradients against a float64 numpy reference
(analytic gradients for the full vocabulary, central differences for top-k + tail), masks, the
chunked path against the materialised one, and exact accumulation through the learner."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.support.learner import random_trajectories, small_model
from posttrain_jax import batching
from posttrain_jax.learner import Learner, LearnerConfig, gradients
from posttrain_jax.losses import FullDistillConfig, HeadInputs, get_loss
from posttrain_jax.types import np_batch

B, T, D, V, TAU = 2, 5, 6, 23, 0.9


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  h = rng.standard_normal((B * T, D))
  w = rng.standard_normal((D, V)) * 0.7
  ht = rng.standard_normal((B * T, D))
  mask = np.ones((B, T))
  mask[0, 0] = mask[1, 3:] = 0          # prompt / padding
  teacher_mask = np.ones((B, T))
  teacher_mask[1, 1] = 0                # a token no teacher scored
  batch = np_batch(input_ids=np.ones((B, T)), target_ids=np.ones((B, T)), loss_mask=mask,
                   positions=np.tile(np.arange(T), (B, 1)), segment_ids=np.ones((B, T)),
                   seq_ids=np.repeat(np.arange(B)[:, None], T, 1), seq_valid=np.ones(B),
                   advantages=np.zeros((B, T)), teacher_mask=teacher_mask,
                   teacher_hidden=ht.reshape(B, T, D))
  return h, w, ht, mask, teacher_mask, batch


def _log_softmax(z):
  z = z - z.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _div(ls, lt, kind, beta):
  s, t = np.exp(ls), np.exp(lt)
  if kind == "forward_kl":
    return (t * (lt - ls)).sum(-1)
  if kind == "reverse_kl":
    return (s * (ls - lt)).sum(-1)
  lm = np.log(beta * t + (1 - beta) * s)
  return beta * (t * (lt - lm)).sum(-1) + (1 - beta) * (s * (ls - lm)).sum(-1)


def ref_loss(h, w, ht, mask, tmask, cfg):
  """numpy float64: Σ_t w_t m_t D_t with token_mean weights 1 / Σ mask."""
  ls, lt = _log_softmax(h @ w / TAU), _log_softmax(ht @ w / TAU)
  if cfg.topk is not None:
    ids = np.argsort(-ls, axis=1, kind="stable")[:, :cfg.topk]
    tail = lambda l: np.log1p(-np.exp(l).sum(-1, keepdims=True))
    ls_k, lt_k = np.take_along_axis(ls, ids, 1), np.take_along_axis(lt, ids, 1)
    ls, lt = np.concatenate([ls_k, tail(ls_k)], 1), np.concatenate([lt_k, tail(lt_k)], 1)
  d = _div(ls, lt, cfg.divergence, cfg.beta)
  m = (mask * tmask).reshape(-1)
  return float((m * d).sum() / mask.sum()), d


def ref_grad_full(h, w, ht, mask, tmask, cfg):
  """Analytic d loss / d (h, W), the teacher held constant (kernels/teacher.py's formulas)."""
  z = h @ w / TAU
  ls, lt = _log_softmax(z), _log_softmax(ht @ w / TAU)
  s, t = np.exp(ls), np.exp(lt)
  if cfg.divergence == "forward_kl":
    dz = s - t
  elif cfg.divergence == "reverse_kl":
    dz = s * (ls - lt - (s * (ls - lt)).sum(-1, keepdims=True))
  else:
    lm = np.log(cfg.beta * t + (1 - cfg.beta) * s)
    dz = (1 - cfg.beta) * s * (ls - lm - (s * (ls - lm)).sum(-1, keepdims=True))
  g = ((mask * tmask).reshape(-1) / mask.sum())[:, None] * dz / TAU
  return g @ w.T, h.T @ g


def _jax_loss(h, w, batch, cfg, teacher_w=None):
  loss, metrics = get_loss("full_distill").fn(HeadInputs(h, w, False, TAU, teacher_w), batch, cfg)
  return loss, metrics


FULL = [FullDistillConfig(topk=None, impl=impl, divergence=kind)
        for impl in ("chunked", "reference") for kind in ("jsd", "forward_kl", "reverse_kl")]


@pytest.mark.parametrize("cfg", FULL + [FullDistillConfig(topk=None, beta=0.2)],
                         ids=lambda c: f"{c.divergence}-{c.impl}-b{c.beta}")
def test_full_vocabulary_value_and_gradient_match_float64(cfg):
  h, w, ht, mask, tmask, batch = _inputs(1)
  want, d = ref_loss(h, w, ht, mask, tmask, cfg)
  (loss, metrics), (gh, gw) = jax.value_and_grad(_jax_loss, argnums=(0, 1), has_aux=True)(
      jnp.asarray(h, jnp.float32), jnp.asarray(w, jnp.float32), batch, cfg)
  np.testing.assert_allclose(float(loss), want, rtol=2e-5)
  want_h, want_w = ref_grad_full(h, w, ht, mask, tmask, cfg)
  np.testing.assert_allclose(np.asarray(gh), want_h, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(np.asarray(gw), want_w, rtol=1e-4, atol=1e-6)
  m = (mask * tmask).reshape(-1)
  s, c = metrics["distill/divergence"]
  np.testing.assert_allclose(float(s / c), (m * d).sum() / m.sum(), rtol=2e-5)
  s, c = metrics["distill/teacher_token_frac"]
  assert float(s / c) == pytest.approx(m.sum() / mask.sum())


@pytest.mark.parametrize("kind, beta", [("jsd", 0.5), ("jsd", 0.3), ("forward_kl", 0.5),
                                        ("reverse_kl", 0.5)])
def test_topk_and_tail_value_and_gradient_match_float64(kind, beta):
  cfg = FullDistillConfig(topk=4, divergence=kind, beta=beta)
  h, w, ht, mask, tmask, batch = _inputs(2)
  want, _ = ref_loss(h, w, ht, mask, tmask, cfg)
  (loss, _), (gh, gw) = jax.value_and_grad(_jax_loss, argnums=(0, 1), has_aux=True)(
      jnp.asarray(h, jnp.float32), jnp.asarray(w, jnp.float32), batch, cfg)
  np.testing.assert_allclose(float(loss), want, rtol=2e-5)
  # central differences of the numpy reference, the teacher's head held at w (stop-gradient)
  eps = 1e-6
  for arr, got, name in ((h, gh, "h"), (w, gw, "w")):
    num = np.zeros_like(arr)
    for idx in np.ndindex(arr.shape):
      plus, minus = arr.copy(), arr.copy()
      plus[idx] += eps
      minus[idx] -= eps
      args = lambda a: (a, w, ht) if name == "h" else (h, a, ht)
      f = lambda a: (ref_loss_teacher_fixed(*args(a), mask, tmask, cfg, w))
      num[idx] = (f(plus) - f(minus)) / (2 * eps)
    np.testing.assert_allclose(np.asarray(got), num, rtol=2e-3, atol=2e-5, err_msg=name)


def ref_loss_teacher_fixed(h, w, ht, mask, tmask, cfg, w_teacher):
  """ref_loss with the teacher's distribution from w_teacher (the top-k ids from the student)."""
  ls, lt = _log_softmax(h @ w / TAU), _log_softmax(ht @ w_teacher / TAU)
  ids = np.argsort(-ls, axis=1, kind="stable")[:, :cfg.topk]
  tail = lambda l: np.log1p(-np.exp(l).sum(-1, keepdims=True))
  ls_k, lt_k = np.take_along_axis(ls, ids, 1), np.take_along_axis(lt, ids, 1)
  d = _div(np.concatenate([ls_k, tail(ls_k)], 1), np.concatenate([lt_k, tail(lt_k)], 1),
           cfg.divergence, cfg.beta)
  return float(((mask * tmask).reshape(-1) * d).sum() / mask.sum())


@pytest.mark.parametrize("topk", [None, 4])
def test_a_teacher_with_its_own_head(topk):
  """An EMA / frozen teacher's head: T = softmax(h_T W_T); the gradient still only the student's."""
  cfg = FullDistillConfig(topk=topk)
  h, w, ht, mask, tmask, batch = _inputs(6)
  w_t = w + np.random.default_rng(7).standard_normal(w.shape) * 0.3
  want = ref_loss_teacher_fixed(h, w, ht, mask, tmask, cfg, w_t) if topk else None
  if topk is None:
    ls, lt = _log_softmax(h @ w / TAU), _log_softmax(ht @ w_t / TAU)
    want = float(((mask * tmask).reshape(-1) * _div(ls, lt, "jsd", 0.5)).sum() / mask.sum())
  f = lambda hh, ww, wt: _jax_loss(hh, ww, batch, cfg, wt)[0]
  loss, (gh, gw, gwt) = jax.value_and_grad(f, argnums=(0, 1, 2))(
      *(jnp.asarray(a, jnp.float32) for a in (h, w, w_t)))
  np.testing.assert_allclose(float(loss), want, rtol=2e-5)
  assert not np.asarray(gwt).any()     # the teacher's head is stop-gradient
  same = _jax_loss(jnp.asarray(h, jnp.float32), jnp.asarray(w, jnp.float32), batch, cfg)[0]
  assert abs(float(same) - want) > 1e-3   # and it is used: not the student's head


def test_tokens_without_a_teacher_or_outside_the_loss_mask_contribute_nothing():
  cfg = FullDistillConfig(topk=None)
  h, w, _, mask, tmask, batch = _inputs(3)
  garbage = np.asarray(batch.teacher_hidden).copy()
  garbage[1, 1] = 1e3                   # the unscored token's teacher state
  garbage[1, 4] = -1e3                  # a padding position's
  moved = dataclasses.replace(batch, teacher_hidden=jnp.asarray(garbage, jnp.float32))
  f = lambda b: jax.value_and_grad(_jax_loss, argnums=(0, 1), has_aux=True)(
      jnp.asarray(h, jnp.float32), jnp.asarray(w, jnp.float32), b, cfg)
  (l1, _), g1 = f(batch)
  (l2, _), g2 = f(moved)
  assert float(l1) == float(l2)
  for a, b in zip(g1, g2):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # an unscored token's own h gets no gradient from this loss; a scored one does
  assert np.abs(np.asarray(g1[0]).reshape(B, T, D)[1, 0]).max() > 1e-6
  np.testing.assert_array_equal(np.asarray(g1[0]).reshape(B, T, D)[1, 1], 0.0)


@pytest.mark.slow  # > 30 s: CI's slow stage
def test_head_loss_through_the_learner_is_exact_over_micro_batches():
  trajs = random_trajectories(6, seed=4)
  cfg = batching.BatchConfig(rows=8, seq_len=16, max_seqs=8, pack=False)
  batch = batching.build_batch(trajs, [0.0] * 6, cfg)
  rng = np.random.default_rng(5)
  batch = dataclasses.replace(
      batch, teacher_mask=(rng.random(batch.loss_mask.shape) < 0.7).astype(np.float32),
      teacher_hidden=rng.standard_normal((*batch.loss_mask.shape, 32)).astype(np.float32))
  loss_cfg = FullDistillConfig(topk=5)
  out = []
  for m in (1, 2, 4):
    learner = Learner(small_model(), LearnerConfig(loss="full_distill", micro_batches=m), loss_cfg)
    out.append(gradients(learner.params, learner.put_batch(batch), graphdef=learner.graphdef,
                         spec=learner.spec, loss_cfg=loss_cfg, cfg=learner.cfg))
  (g1, m1), rest = out[0], out[1:]
  assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(g1)) > 1e-4
  for g, m in rest:
    np.testing.assert_allclose(float(m["loss"][0]), float(m1["loss"][0]), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g1)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=1e-7)


@pytest.mark.parametrize("bad, match", [
    (dict(divergence="tvd"), "divergence"), (dict(beta=1.0), "beta"), (dict(topk=0), "topk"),
    (dict(aggregation="nope"), "aggregation")])
def test_config_errors(bad, match):
  with pytest.raises((ValueError, KeyError), match=match):
    FullDistillConfig(**bad)


@pytest.mark.parametrize("kind, want", [("forward_kl", 0.130812), ("jsd", 0.033822)])
def test_hand_computed_case(kind, want):
  """One token, V = 2: S = softmax(0, 0) = (1/2, 1/2), T = softmax(ln 3, 0) = (3/4, 1/4).
  KL(T||S) = 3/4 ln(3/2) + 1/4 ln(1/2) = 0.130812; with M = (5/8, 3/8), JSD_0.5 =
  (KL(T||M) + KL(S||M)) / 2 = (0.035375 + 0.032269) / 2 = 0.033822. The forward KL's gradient
  w.r.t. the student logits is s - t = (-1/4, 1/4), so dW = h (s - t) = (-1/4, 1/4) at h = 1."""
  one = np.ones((1, 1))
  batch = np_batch(input_ids=one, target_ids=one, loss_mask=one, positions=0 * one,
                   segment_ids=one, seq_ids=0 * one, seq_valid=np.ones(1), advantages=0 * one,
                   teacher_mask=one, teacher_hidden=np.ones((1, 1, 1)))
  cfg = FullDistillConfig(topk=None, divergence=kind)
  f = lambda w: get_loss("full_distill").fn(
      HeadInputs(jnp.ones((1, 1)), w, False, 1.0, jnp.array([[np.log(3.0), 0.0]])), batch, cfg)[0]
  loss, gw = jax.value_and_grad(f)(jnp.zeros((1, 2)))
  assert float(loss) == pytest.approx(want, abs=2e-6)
  if kind == "forward_kl":
    np.testing.assert_allclose(np.asarray(gw), [[-0.25, 0.25]], atol=1e-6)


# One token, V = 4, k = 2, h = 1, τ = 1 (so dW = d/d logits): student logits (ln 4, ln 2, 0, 0),
# S = (1/2, 1/4, 1/8, 1/8); teacher logits (0, ln 3, ln 3, 0), T = (1/8, 3/8, 3/8, 1/8). The
# student's top-2 are ids (0, 1) (the teacher's would be (1, 2)), so the buckets are
#   S_b = (1/2, 1/4, tail 1 - 3/4 = 1/4),   T_b = (1/8, 3/8, tail 1 - 1/2 = 1/2).
HAND_TOPK_STUDENT = [np.log(4.0), np.log(2.0), 0.0, 0.0]
HAND_TOPK_TEACHER = [0.0, np.log(3.0), np.log(3.0), 0.0]


def _hand_topk(cfg):
  """(loss, d loss / d W [1, 4]) for the one-token top-k case above."""
  one = np.ones((1, 1))
  batch = np_batch(input_ids=one, target_ids=one, loss_mask=one, positions=0 * one,
                   segment_ids=one, seq_ids=0 * one, seq_valid=np.ones(1), advantages=0 * one,
                   teacher_mask=one, teacher_hidden=np.ones((1, 1, 1)))
  f = lambda w: get_loss("full_distill").fn(
      HeadInputs(jnp.ones((1, 1)), w, False, 1.0, jnp.array([HAND_TOPK_TEACHER])), batch, cfg)[0]
  loss, gw = jax.value_and_grad(f)(jnp.array([HAND_TOPK_STUDENT], jnp.float32))
  return float(loss), np.asarray(gw)


@pytest.mark.parametrize("kind, beta, want", [
    ("forward_kl", 0.5, 0.325336), ("reverse_kl", 0.5, 0.418494), ("jsd", 0.5, 0.087762),
    ("jsd", 0.3, 0.070922)])
def test_hand_computed_topk_and_tail_case(kind, beta, want):
  """Over the buckets S_b = (1/2, 1/4, 1/4), T_b = (1/8, 3/8, 1/2):
  KL(T||S) = 1/8 ln(1/4) + 3/8 ln(3/2) + 1/2 ln 2 = 3/8 ln 3 - 1/8 ln 2 = 0.325336;
  KL(S||T) = 1/2 ln 4 + 1/4 ln(2/3) + 1/4 ln(1/2) = ln 2 - 1/4 ln 3 = 0.418494.
  JSD_0.5: M = (5/16, 5/16, 3/8), KL(T||M) = 1/8 ln(2/5) + 3/8 ln(6/5) + 1/2 ln(4/3) = 0.097675,
  KL(S||M) = 1/2 ln(8/5) + 1/4 ln(4/5) + 1/4 ln(2/3) = 0.077850, JSD = (0.097675 + 0.077850) / 2
  = 0.087762.
  JSD_0.3: M = 0.3 T + 0.7 S = (31/80, 23/80, 13/40), KL(T||M) = 1/8 ln(10/31) + 3/8 ln(30/23)
  + 1/2 ln(20/13) = 0.173605, KL(S||M) = 1/2 ln(40/31) + 1/4 ln(20/23) + 1/4 ln(10/13) = 0.026915,
  JSD = 0.3 · 0.173605 + 0.7 · 0.026915 = 0.070922 (β swapped, 0.7, would give 0.077738).
  For contrast: the full vocabulary's KL(T||S) is 0.390742, and the teacher's top-2 as the
  buckets would give T_b = (3/8, 3/8, 1/4), S_b = (1/4, 1/8, 5/8)."""
  loss, _ = _hand_topk(FullDistillConfig(topk=2, divergence=kind, beta=beta))
  assert loss == pytest.approx(want, abs=2e-6)


@pytest.mark.parametrize("kind, beta, want", [
    ("forward_kl", 0.5, [0.375, -0.125, -0.125, -0.125]),
    ("jsd", 0.5, [0.098038, -0.037624, -0.030207, -0.030207]),
    ("jsd", 0.3, [0.079792, -0.029168, -0.025312, -0.025312])])
def test_hand_computed_topk_and_tail_gradient(kind, beta, want):
  """d D / d z_j with b(j) the bucket of id j (the tail for j outside the top-k): through
  d ln S_i / d z_j = δ_ij - s_j (i in the top-k) and d ln S_tail / d z_j = [j ∉ top-k] s_j / S_tail
  - s_j,
    forward_kl: s_j - T_b(j) s_j / S_b(j) = s_j - t_j in the top-k, s_j (1 - T_tail / S_tail) in the
      tail: (1/2 - 1/8, 1/4 - 3/8, 1/8 (1 - 2), 1/8 (1 - 2)) = (3/8, -1/8, -1/8, -1/8)
      (the full vocabulary's s - t would be (3/8, -1/8, -1/4, 0): the tail bucket shares T_tail
      in the student's proportions);
    jsd: dD/dS_b = (1 - β) ln(S_b / M_b) =: g_b, so dD/dz_j = s_j (g_b(j) - Σ_b S_b g_b).
      β = 0.5: g = 1/2 (ln(8/5), ln(4/5), ln(2/3)) = (0.235002, -0.111572, -0.202733),
      Σ S g = 0.038925, dz = (1/2 · 0.196077, 1/4 · -0.150497, 1/8 · -0.241657, same)
      = (0.098038, -0.037624, -0.030207, -0.030207).
      β = 0.3: g = 0.7 (ln(40/31), ln(20/23), ln(10/13)) = (0.178425, -0.097833, -0.183655),
      Σ S g = 0.018840, dz = (0.079792, -0.029168, -0.025312, -0.025312).
  h = 1 and τ = 1, so d loss / d W = dz; each row sums to 0 (softmax shift invariance)."""
  _, gw = _hand_topk(FullDistillConfig(topk=2, divergence=kind, beta=beta))
  np.testing.assert_allclose(gw, [want], atol=2e-6)
