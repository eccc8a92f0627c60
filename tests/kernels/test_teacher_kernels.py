"""Teacher terms (distillation) against a float64 numpy reference; gradients against autodiff
of the materialised jnp reference. Fresh inputs each run unless POSTTRAIN_TEST_SEED is set; the
seed is printed with every failure (see `seed` below), so a CI log alone replays it."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain_jax.kernels import lm_head_chunked, teacher, teacher_divergence, topk_logprobs
from posttrain_jax.kernels import teacher_token_logprobs

BS = lm_head_chunked.BlockSizes(token_chunk=8, vocab_tile=32, fused_token_chunk=8)
N, D, DT, V, TAU = 13, 8, 12, 101, 0.9


# One seed for the whole session: POSTTRAIN_TEST_SEED when set (KERNEL_TEST_SEED, the older
# name, too), else fresh from os.urandom. A CI log alone replays a failure: the fixture prints
# it (pytest shows "Captured stdout setup" under every failing test, and the `seed = N`
# argument in its traceback) and every assertion message ends with the rerun setting.
_SEED_ENV = os.environ.get("POSTTRAIN_TEST_SEED") or os.environ.get("KERNEL_TEST_SEED")
SEED = int(_SEED_ENV) if _SEED_ENV else int.from_bytes(os.urandom(4), "little")


@pytest.fixture
def seed():
  print(f"random inputs: rerun with POSTTRAIN_TEST_SEED={SEED} to replay them")
  return SEED


def _replay(seed):
  return f"(POSTTRAIN_TEST_SEED={seed} replays)"


def rel_err(got, want):
  got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
  want = np.asarray(want, np.float64)
  assert got.shape == want.shape, (got.shape, want.shape)
  if not np.all(np.isfinite(got)):
    return np.inf
  return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def assert_close(name, got, want, tol, seed):
  err = rel_err(got, want)
  assert err <= tol, f"{name}: relative error {err:.3e} > {tol:g} {_replay(seed)}"


def inputs(seed, transposed=False, teacher_transposed=False):
  ks = jax.random.split(jax.random.PRNGKey(seed), 6)
  h = jax.random.normal(ks[0], (N, D))
  w = jax.random.normal(ks[1], (V, D) if transposed else (D, V)) * 2 / np.sqrt(D)
  ht = jax.random.normal(ks[2], (N, DT))
  wt = jax.random.normal(ks[3], (V, DT) if teacher_transposed else (DT, V)) * 2 / np.sqrt(DT)
  mask = (jax.random.uniform(ks[4], (N,)) > 0.25).at[0].set(False).at[1].set(True)
  y = jax.random.randint(ks[5], (N,), 0, V)
  return h, w, ht, wt, mask, y


def np_logsoftmax(h, w, transposed=False):
  h, w = np.asarray(h, np.float64), np.asarray(w, np.float64)
  z = (h @ (w.T if transposed else w)) / TAU
  m = z.max(1, keepdims=True)
  return z - (m + np.log(np.exp(z - m).sum(1, keepdims=True)))


def test_teacher_token_logprobs(seed):
  h, w, ht, wt, mask, y = inputs(seed, teacher_transposed=True)
  lt = np_logsoftmax(ht, wt, transposed=True)
  want = np.where(np.asarray(mask), lt[np.arange(N), np.asarray(y)], 0.0)
  f = lambda ht: teacher_token_logprobs(ht, wt, y, temperature=TAU, mask=mask, transposed=True,
                                        impl="chunked", block_sizes=BS)
  assert_close("log T(y)", f(ht), want, 1e-5, seed)
  g = jax.grad(lambda ht: jnp.sum(f(ht)))(ht)
  assert np.all(np.asarray(g) == 0), f"teacher must be stop-gradient {_replay(seed)}"


@pytest.mark.parametrize("impl,transposed", [("reference", False), ("chunked", False),
                                             ("chunked", True)])
def test_topk_against_float64(impl, transposed, seed):
  k = 7  # > the last vocab tile's width (101 = 3 * 32 + 5)
  h, w, ht, wt, mask, _ = inputs(seed, transposed=transposed)
  ls, lt = np_logsoftmax(h, w, transposed), np_logsoftmax(ht, wt)
  ids = np.argsort(-ls, axis=1)[:, :k]
  m = np.asarray(mask)[:, None]
  want_s = np.take_along_axis(ls, ids, 1)
  want_t = np.take_along_axis(lt, ids, 1)
  tail = lambda lp: np.log1p(-np.exp(lp).sum(1))
  out = topk_logprobs(h, w, ht, wt, k=k, temperature=TAU, mask=mask, transposed=transposed,
                      impl=impl, block_sizes=BS if impl == "chunked" else None)
  assert np.array_equal(np.asarray(out.ids_nk), np.where(m, ids, 0)), \
      f"top-k ids {_replay(seed)}"
  assert_close("student logp", out.student_logp_nk, np.where(m, want_s, 0), 1e-5, seed)
  assert_close("teacher logp", out.teacher_logp_nk, np.where(m, want_t, 0), 1e-5, seed)
  # the tail log(1 − Σ_topk p) cancels: float32 rounding grows by 1/(tail mass). Over 150 seeds
  # the worst error was 9.7e-6 and one CI seed gave 1.8e-5, hence 1e-4 (a bug is ≥ 1e-3)
  assert_close("student tail", out.student_tail_n, np.where(m[:, 0], tail(want_s), 0), 1e-4, seed)
  assert_close("teacher tail", out.teacher_tail_n, np.where(m[:, 0], tail(want_t), 0), 1e-4, seed)


def test_topk_gradients_match_autodiff(seed):
  h, w, ht, wt, mask, _ = inputs(seed)
  c = jax.random.normal(jax.random.PRNGKey(seed + 7), (N, 6))

  def loss(impl, bs):
    def f(h, w, ht):
      o = topk_logprobs(h, w, ht, wt, k=5, temperature=TAU, mask=mask, impl=impl, block_sizes=bs)
      return jnp.sum(c[:, :5] * o.student_logp_nk) + jnp.sum(c[:, 5] * o.student_tail_n) \
          + jnp.sum(o.teacher_logp_nk) + jnp.sum(o.teacher_tail_n)
    return jax.jit(jax.grad(f, argnums=(0, 1, 2)))

  want = loss("reference", None)(h, w, ht)
  got = loss("chunked", BS)(h, w, ht)
  # float32 against float32 in another summation order, through the tail's 1/(tail mass):
  # worst over 150 seeds 3.5e-5, one CI seed 7.4e-5; 3e-4 leaves room (a bug is ≥ 1e-2)
  assert_close("dh", got[0], want[0], 3e-4, seed)
  assert_close("dW", got[1], want[1], 3e-4, seed)
  assert np.all(np.asarray(got[2]) == 0), f"teacher must be stop-gradient {_replay(seed)}"


def np_divergence(kind, beta, ls, lt):
  s, t = np.exp(ls), np.exp(lt)
  if kind == "forward_kl":
    return (t * (lt - ls)).sum(1)
  if kind == "reverse_kl":
    return (s * (ls - lt)).sum(1)
  lm = np.log(beta * t + (1 - beta) * s)
  return beta * (t * (lt - lm)).sum(1) + (1 - beta) * (s * (ls - lm)).sum(1)


KINDS = [("jsd", 0.3), ("forward_kl", 0.5), ("reverse_kl", 0.5)]


@pytest.mark.parametrize("kind,beta", KINDS)
def test_divergence_against_float64_and_autodiff(kind, beta, seed):
  h, w, ht, wt, mask, _ = inputs(seed, transposed=kind == "jsd", teacher_transposed=kind == "jsd")
  tr = kind == "jsd"
  want = np.where(np.asarray(mask),
                  np_divergence(kind, beta, np_logsoftmax(h, w, tr), np_logsoftmax(ht, wt, tr)), 0)
  c = jax.random.normal(jax.random.PRNGKey(seed + 3), (N,))

  def run(impl, bs):
    def f(h, w, ht, wt):
      d = teacher_divergence(h, w, ht, wt, kind=kind, beta=beta, temperature=TAU, mask=mask,
                             transposed=tr, teacher_transposed=tr, impl=impl, block_sizes=bs)
      return jnp.sum(c * d), d
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True))(h, w, ht, wt)

  (_, d_ref), g_ref = run("reference", None)
  (_, d), g = run("chunked", BS)
  assert_close(f"{kind} reference", d_ref, want, 1e-5, seed)
  assert_close(f"{kind} chunked", d, want, 1e-5, seed)
  assert np.all(np.asarray(d)[~np.asarray(mask)] == 0), f"masked rows nonzero {_replay(seed)}"
  # float32 vs float32 gradients: worst over 60 seeds 8.7e-6, so 1e-4 (a bug is ≥ 1e-2)
  assert_close(f"{kind} dh", g[0], g_ref[0], 1e-4, seed)
  assert_close(f"{kind} dW", g[1], g_ref[1], 1e-4, seed)
  assert np.all(np.asarray(g[2]) == 0) and np.all(np.asarray(g[3]) == 0), \
      f"teacher grad {_replay(seed)}"
  assert np.all(np.asarray(g[0])[~np.asarray(mask)] == 0), \
      f"masked rows get gradient {_replay(seed)}"


def test_jsd_ends_match_the_documented_kls(seed):
  """The docstring's orientation, in float64: beta -> 0: JSD/beta -> KL(T||S) (forward);
  beta -> 1: JSD/(1-beta) -> KL(S||T) (reverse). The kernel matches np_divergence above."""
  h, w, ht, wt, _, _ = inputs(seed)
  ls, lt = np_logsoftmax(h, w), np_logsoftmax(ht, wt)
  fwd, rev = np_divergence("forward_kl", 0, ls, lt), np_divergence("reverse_kl", 0, ls, lt)
  eps = 1e-10
  lo = np_divergence("jsd", eps, ls, lt) / eps
  hi = np_divergence("jsd", 1 - eps, ls, lt) / eps
  assert_close("JSD/beta vs KL(T||S)", lo, fwd, 1e-3, seed)
  assert_close("JSD/(1-beta) vs KL(S||T)", hi, rev, 1e-3, seed)
  assert rel_err(lo, rev) > 1e-2, f"ends indistinguishable, test is vacuous {_replay(seed)}"


def test_bad_arguments_are_explained():
  h, w = jnp.zeros((2, 4)), jnp.zeros((4, 9))
  with pytest.raises(ValueError, match="0 < beta < 1"):
    teacher_divergence(h, w, h, w, kind="jsd", beta=0.0)
  with pytest.raises(ValueError, match="valid: 'jsd', 'forward_kl', 'reverse_kl'"):
    teacher_divergence(h, w, h, w, kind="tvd")
  with pytest.raises(ValueError, match="valid: 'auto', 'reference', 'chunked'"):
    topk_logprobs(h, w, h, w, k=2, impl="pallas_gpu")
  with pytest.raises(ValueError, match="vocabulary 9 != teacher vocabulary 8"):
    teacher_divergence(h, w, h, jnp.zeros((4, 8)))
  assert teacher.TEACHER_IMPLS == ("reference", "chunked")
