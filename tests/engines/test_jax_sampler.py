"""Embedded sampler: its log-probs equal the learner's; stops, greedy, top-k, seeds, errors."""
import jax
import numpy as np
import pytest

from posttrain_jax import batching
from posttrain_jax import learner as L
from posttrain_jax.engines.base import PromptTooLongError, SamplingParams
from posttrain_jax.engines.jax_sampler import JaxSampler, JaxSamplerConfig
from posttrain_jax.types import Trajectory
from tests.support.learner import VOCAB, small_model

PROMPTS = [[3, 4, 5], [7, 8, 9, 10, 11, 12, 13], [2]]


@pytest.fixture(scope="module")
def model():
  return small_model(seed=1)


def test_logprobs_equal_learner(model):
  sampler = JaxSampler(model)
  out = sampler.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=1.0), n=3, seed=0)
  trajs = []
  for i, (prompt, comps) in enumerate(zip(PROMPTS, out)):
    assert len(comps) == 3
    for j, c in enumerate(comps):
      ids = prompt + c.token_ids
      trajs.append(Trajectory(id=f"{i}.{j}", task_id=str(i), token_ids=ids,
                              loss_mask=[0] * len(prompt) + [1] * len(c.token_ids),
                              behaviour_logprobs=[0.0] * len(prompt) + c.logprobs,
                              policy_version=[-1] * len(prompt) + [c.version] * len(c.token_ids)))
  batch = batching.build_batch(trajs, [0.0] * len(trajs),
                               batching.BatchConfig(rows=9, seq_len=20, max_seqs=9, pack=False))
  learner = L.Learner(model, L.LearnerConfig(loss="sft"))
  logp = np.asarray(learner.logprobs(batch))
  m = batch.loss_mask > 0
  assert m.sum() == 9 * 12
  np.testing.assert_allclose(logp[m], batch.behaviour_logp[m], atol=2e-5)


def test_temperature_logprobs_match_learner_at_same_temperature(model):
  sampler = JaxSampler(model)
  (c,), = sampler.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0.7), seed=1)
  traj = Trajectory(id="a", task_id="a", token_ids=PROMPTS[0] + c.token_ids,
                    loss_mask=[0] * 3 + [1] * 8, behaviour_logprobs=[0.0] * 3 + c.logprobs,
                    policy_version=[0] * 11)
  batch = batching.build_batch([traj], [0.0], batching.BatchConfig(rows=1, seq_len=16, max_seqs=1))
  learner = L.Learner(model, L.LearnerConfig(loss="sft", temperature=0.7))
  m = batch.loss_mask > 0
  np.testing.assert_allclose(np.asarray(learner.logprobs(batch))[m], batch.behaviour_logp[m], atol=2e-5)


def test_greedy_equals_top_k_1_and_is_argmax(model):
  sampler = JaxSampler(model)
  greedy = sampler.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0))
  topk = sampler.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=1.0, top_k=1), seed=5)
  for g, k in zip(greedy, topk):
    assert g[0].token_ids == k[0].token_ids
  # argmax check against a full forward
  import jax.numpy as jnp
  ids = PROMPTS[0] + greedy[0][0].token_ids
  h, _ = model(jnp.asarray([ids]), jnp.arange(len(ids))[None])
  argmax = np.asarray(jnp.argmax(model.logits(h)[0], -1))
  assert greedy[0][0].token_ids == argmax[len(PROMPTS[0]) - 1:-1].tolist()


def test_top_p_keeps_only_the_nucleus(model):
  sampler = JaxSampler(model)
  # top_p tiny -> always the most likely token (same as greedy)
  a = sampler.generate(PROMPTS, SamplingParams(max_tokens=5, temperature=1.0, top_p=1e-6), seed=3)
  g = sampler.generate(PROMPTS, SamplingParams(max_tokens=5, temperature=0.0))
  assert [x[0].token_ids for x in a] == [x[0].token_ids for x in g]


def test_stop_tokens_and_lengths(model):
  sampler = JaxSampler(model)
  free = sampler.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0.0))
  stop = free[1][0].token_ids[3]  # a token greedy decoding produces at step 4
  out = sampler.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0.0,
                                                 stop_token_ids=(stop,)))
  c = out[1][0]
  assert c.finish_reason == "stop" and c.token_ids[-1] == stop
  assert len(c.token_ids) == c.token_ids.index(stop) + 1 <= 4
  assert all(x[0].finish_reason == "length" and len(x[0].token_ids) == 10
             for x in free if stop not in x[0].token_ids)


def test_seed_determinism_and_version(model):
  sampler = JaxSampler(model, version=3)
  sp = SamplingParams(max_tokens=8, temperature=1.0)
  a = sampler.generate(PROMPTS, sp, n=2, seed=7)
  b = sampler.generate(PROMPTS, sp, n=2, seed=7)
  c = sampler.generate(PROMPTS, sp, n=2, seed=8)
  ids = lambda out: [x.token_ids for comps in out for x in comps]
  assert ids(a) == ids(b) and ids(a) != ids(c)
  assert {x.version for comps in a for x in comps} == {3}
  sampler.update_weights(small_model(seed=2), version=4)
  d = sampler.generate(PROMPTS, sp, n=2, seed=7)
  assert ids(d) != ids(a) and d[0][0].version == 4


def test_too_long_prompt_is_named(model):
  sampler = JaxSampler(model, JaxSamplerConfig(max_prompt_len=4))
  # not an infra error: the rollout source drops such a task as "invalid" instead of retrying
  with pytest.raises(PromptTooLongError, match="prompt 1 has 7 tokens.*max_prompt_len") as e:
    sampler.generate(PROMPTS, SamplingParams(max_tokens=2))
  assert e.value.index == 1


def test_once_per_prompt_prefill_samples_what_n_copies_do(model):
  """n completions of a prompt share one prefill (its KV cache repeated n times); the slow path,
  the prompt written out n times with n=1, prefills every copy: same rows, same random stream,
  so the same tokens and log-probs."""
  sampler = JaxSampler(model)
  sp = SamplingParams(max_tokens=10, temperature=1.0)
  fast = sampler.generate(PROMPTS, sp, n=3, seed=5)
  slow = sampler.generate([p for p in PROMPTS for _ in range(3)], sp, n=1, seed=5)
  fast = [c for comps in fast for c in comps]
  slow = [comps[0] for comps in slow]
  assert [c.token_ids for c in fast] == [c.token_ids for c in slow]
  assert len({tuple(c.token_ids) for c in fast}) > 3  # the copies of a prompt did differ
  np.testing.assert_allclose(np.concatenate([c.logprobs for c in fast]),
                             np.concatenate([c.logprobs for c in slow]), atol=2e-5)
