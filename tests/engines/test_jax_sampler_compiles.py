"""The embedded sampler compiles per shape, not per sampling value: temperature, top-p, top-k,
stop ids and max_tokens within a length bucket reuse one program (counted by `compiles`); its
draws are the static version's; the model's context bounds prompt + max_tokens; and a long
request decodes in turns, so a short one that comes after it finishes first."""
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax import nnx

from posttrain_jax.config_io import ConfigTypeError
from posttrain_jax.engines.base import PromptTooLongError, SamplingParams
from posttrain_jax.engines.jax_sampler import JaxSampler, JaxSamplerConfig
from posttrain_jax.engines.registry import engine_spec
from posttrain_jax.engines.sampling import length_bucket, sample
from tests.support.learner import VOCAB, small_model

PROMPT = [3, 4, 5, 6, 7]


@pytest.fixture(scope="module")
def model():
  return small_model(seed=1, max_position_embeddings=128)


def _static_sample(logits_bv, rng, temperature: float, top_p: float, top_k: int):
  """The sampler before this change, with the values compiled in (reference)."""
  logits_bv = logits_bv.astype(jnp.float32)
  if temperature == 0:
    ids = jnp.argmax(logits_bv, axis=-1)
    return ids, jnp.take_along_axis(jax.nn.log_softmax(logits_bv), ids[:, None], -1)[:, 0]
  z = logits_bv / temperature
  logp = jax.nn.log_softmax(z)
  masked = z
  if top_k > 0:
    kth = jax.lax.top_k(z, top_k)[0][:, -1:]
    masked = jnp.where(z < kth, -jnp.inf, masked)
  if top_p < 1.0:
    sorted_z = jnp.sort(masked, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(sorted_z, axis=-1)
    cum_before = jnp.cumsum(probs, axis=-1) - probs
    cutoff = jnp.min(jnp.where(cum_before < top_p, sorted_z, jnp.inf), axis=-1, keepdims=True)
    masked = jnp.where(masked < cutoff, -jnp.inf, masked)
  ids = jax.random.categorical(rng, masked, axis=-1)
  return ids, jnp.take_along_axis(logp, ids[:, None], -1)[:, 0]


# (temperature, top_p, top_k) of each row of a batch; the batches take the sampler's branches:
# top-p somewhere (a sort), top-k alone (lax.top_k of 64), all greedy (no draw), plain
BATCHES = {"sort": [(0.0, 1.0, 0), (1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 1.0, 5), (0.5, 0.5, 3),
                    (1.0, 1e-6, 0), (2.0, 0.95, VOCAB), (0.0, 0.3, 2), (2.0, 1.0, 2),
                    (1.5, 0.6, 4)],
           "top_k": [(1.0, 1.0, 5), (0.0, 0.5, 0), (2.0, 1.0, 2), (1.0, 1.0, 0), (0.5, 1.0, VOCAB)],
           "greedy": [(0.0, 1.0, 0), (0.0, 0.5, 3)],
           "plain": [(1.0, 1.0, 0), (0.3, 1.0, 0), (0.0, 1.0, 0)]}


@pytest.mark.parametrize("batch", BATCHES)
def test_one_traced_program_draws_what_the_static_one_draws_row_by_row(batch):
  """Every row its own values in one batch: row r is what the static sampler compiled for row
  r's values draws at row r (same key, same batch shape: the same Gumbel noise)."""
  ROWS = BATCHES[batch]
  logits = jax.random.normal(jax.random.key(0), (len(ROWS), VOCAB))
  temp, top_p, top_k = (jnp.asarray(c, dt) for c, dt in zip(zip(*ROWS), (jnp.float32,
                                                                          jnp.float32, jnp.int32)))
  traced = jax.jit(sample, static_argnums=5)
  static = jax.jit(_static_sample, static_argnums=(2, 3, 4))
  drawn = set()
  for seed in range(25):
    key = jax.random.key(seed)
    ids, lps, top_ids, top_lps = traced(logits, key, temp, top_p, top_k, 3)
    for r, (t, p, k) in enumerate(ROWS):
      ref_ids, ref_lps = static(logits, key, t, p, k)
      assert int(ids[r]) == int(ref_ids[r]), (seed, ROWS[r])
      np.testing.assert_allclose(float(lps[r]), float(ref_lps[r]), atol=1e-6)
      drawn.add((r, int(ids[r])))
    logp = jax.nn.log_softmax(logits / jnp.where(temp > 0, temp, 1.0)[:, None])
    np.testing.assert_array_equal(top_ids, np.argsort(-np.asarray(logp), axis=-1)[:, :3])
    np.testing.assert_allclose(top_lps, np.sort(np.asarray(logp), axis=-1)[:, ::-1][:, :3],
                               atol=1e-6)
  sampled = sum(t > 0 for t, _, _ in ROWS)
  assert len(drawn) >= 4 * sampled + len(ROWS) - sampled   # sampling rows drew many tokens


@nnx.jit
def _full_forward_logits(model, ids_bt, seg_bt):
  """Logits of a whole sequence, no KV cache (right padding: segment 0, never attended)."""
  h, _ = model(ids_bt, jnp.arange(ids_bt.shape[1])[None], seg_bt)
  return model.logits(h)


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 0.8, 0),
                                                      (1.3, 1.0, 6), (0.0, 1.0, 0)])
def test_a_decode_equals_a_plain_loop_with_the_static_sampler(model, temperature, top_p, top_k):
  """Reference: a Python loop, a full forward (no KV cache) per token, the static sampler on
  the engine's random stream (key split per step; row 0 of the 8-row batch bucket)."""
  sp = SamplingParams(max_tokens=10, temperature=temperature, top_p=top_p, top_k=top_k)
  (got,), = JaxSampler(model).generate([PROMPT], sp, seed=4)
  rng = jax.random.key(int(np.random.SeedSequence(4).generate_state(1)[0]))
  ids, lps = list(PROMPT), []
  for _ in range(sp.max_tokens):
    rng, sub = jax.random.split(rng)
    pad = 16 - len(ids)   # one shape: one compile
    logits = _full_forward_logits(model, jnp.asarray([ids + [0] * pad]),
                                  jnp.asarray([[1] * len(ids) + [0] * pad]))
    batch = jnp.zeros((8, VOCAB)).at[0].set(logits[0, len(ids) - 1])
    y, lp = _static_sample(batch, sub, temperature, top_p, top_k)
    ids.append(int(y[0]))
    lps.append(float(lp[0]))
  assert got.token_ids == ids[len(PROMPT):]
  np.testing.assert_allclose(got.logprobs, lps, atol=2e-5)


def test_twenty_sampling_values_within_a_bucket_compile_nothing_new():
  # a model (graphdef) of its own: no other test has compiled its programs
  engine = JaxSampler(small_model(seed=3, max_position_embeddings=96))
  engine.generate([PROMPT], SamplingParams(max_tokens=20), seed=0)
  assert engine.compiles == 2                 # the prefill and the decode segment
  rng = np.random.default_rng(0)
  seen = set()
  for i in range(20):
    sp = SamplingParams(max_tokens=int(rng.integers(17, 33)),
                        temperature=float(rng.choice([0.0, rng.uniform(0.1, 2.0)])),
                        top_p=float(rng.choice([1.0, rng.uniform(0.05, 1.0)])),
                        top_k=int(rng.integers(0, VOCAB + 1)),
                        stop_token_ids=tuple(int(t) for t in rng.choice(VOCAB, int(rng.integers(
                            0, 4)), replace=False)))
    (c,), = engine.generate([PROMPT], sp, seed=i)
    assert 1 <= len(c.token_ids) <= sp.max_tokens
    assert c.finish_reason == ("stop" if c.token_ids[-1] in sp.stop_token_ids else "length")
    seen.add((sp.temperature, sp.top_p, sp.top_k, sp.max_tokens))
  assert len(seen) == 20 and length_bucket(17) == length_bucket(32) == 32
  assert engine.compiles == 2
  for k in (1, 5, 20):                       # top_logprobs compiles as 0 or 20: once
    (c,), = engine.generate([PROMPT], SamplingParams(max_tokens=8, top_logprobs=k), seed=k)
    assert all(len(t) == k for t in c.top_logprobs)
  assert engine.compiles == 4
  engine.generate([PROMPT], SamplingParams(max_tokens=33), seed=0)   # the next length bucket
  assert engine.compiles == 6


def test_past_the_models_context_is_an_error_naming_the_field(model):
  engine = JaxSampler(model, JaxSamplerConfig(max_prompt_len=1000))    # context: 128 tokens
  with pytest.raises(PromptTooLongError, match=r"prompt 0 has 128 tokens.*1\.\.127.*"
                     "max_position_embeddings") as e:
    engine.generate([[3] * 128], SamplingParams(max_tokens=1))
  assert e.value.param == "messages"
  with pytest.raises(PromptTooLongError, match="max_tokens=40 with prompt 1 of 100 tokens.*"
                     "context of 128.*at most 28") as e:
    engine.generate([PROMPT, [3] * 100], SamplingParams(max_tokens=40))
  assert (e.value.param, e.value.index) == ("max_tokens", 1)
  with pytest.raises(PromptTooLongError, match="max_tokens=40"):
    next(engine.stream([3] * 100, SamplingParams(max_tokens=40)))
  (c,), = engine.generate([[3] * 100], SamplingParams(max_tokens=28), seed=0)   # exactly fits
  assert len(c.token_ids) == 28 and c.finish_reason == "length"
  check = engine_spec("jax").check
  with pytest.raises(ConfigTypeError, match="max_tokens=128 leaves no room.*128 tokens"):
    check(JaxSamplerConfig(), model.cfg, 128)
  check(JaxSamplerConfig(), model.cfg, 127)
  check(JaxSamplerConfig(), model.cfg, 4096, field="config.engine_config", serving=True)


def _wait(cond, timeout: float = 120.0) -> None:
  """Blocks until cond() holds (a guard against a hang, not a timing assertion)."""
  end = time.monotonic() + timeout
  while not cond():
    if time.monotonic() > end:
      raise AssertionError("timed out waiting for the engine")
    time.sleep(0.001)


@pytest.mark.parametrize("segment,order", [(8, ["short", "long"]),
                                           (0, ["long", "short"])])   # one segment: as before
def test_a_short_request_finishes_while_a_long_one_decodes(model, segment, order):
  """One program at a time (an accelerator's stream); the test holds the device while the long
  request, then the short one, queue for it. In segments of 8 tokens the long one decodes its
  first 8, the short one all of its 8, then the long one the rest: the short one finishes first.
  Turns change no token: the long answer is what a lone default engine samples."""
  engine = JaxSampler(model, JaxSamplerConfig(turns=1, segment_tokens=segment))
  long_sp, short_sp = SamplingParams(max_tokens=100), SamplingParams(max_tokens=8)
  alone = JaxSampler(model).generate([PROMPT], long_sp, seed=1)
  engine.generate([[9, 8]], short_sp, seed=2)       # compiled before the race
  finished, results = [], {}

  def run(name, prompt, sp, seed):
    results[name] = engine.generate([prompt], sp, seed=seed)
    finished.append(name)
  turns = engine._turns
  with turns.turn():
    threading.Thread(target=run, args=("long", PROMPT, long_sp, 1)).start()
    _wait(lambda: turns.waiting() == 1)
    threading.Thread(target=run, args=("short", [9, 8], short_sp, 2)).start()
    _wait(lambda: turns.waiting() == 2)
  _wait(lambda: len(finished) == 2)
  assert finished == order
  assert results["long"] == alone and len(alone[0][0].token_ids) == 100
