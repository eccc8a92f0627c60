"""JaxSampler.stream: the completions grow chunk by chunk, each a prefix of the next, and the
last is exactly what `generate` returns for the same prompt, n and seed (the same programs on
the same random stream); a cancel stops the decode early."""
import threading

import pytest

from posttrain_jax.engines.base import SamplingParams
from posttrain_jax.engines.jax_sampler import JaxSampler
from tests.support.learner import small_model


@pytest.fixture(scope="module")
def sampler():
  return JaxSampler(small_model(seed=1))


@pytest.mark.parametrize("n,temperature,stops,chunk", [
    (1, 1.0, (), 4), (3, 1.0, (5, 9), 3), (2, 0.0, (), 1), (2, 0.7, (7,), 32)])
def test_a_stream_ends_in_what_generate_returns(sampler, n, temperature, stops, chunk):
  sp = SamplingParams(max_tokens=20, temperature=temperature, stop_token_ids=stops)
  for seed in range(3):
    whole = sampler.generate([[3, 4, 5, 6]], sp, n=n, seed=seed)[0]
    parts = list(sampler.stream([3, 4, 5, 6], sp, n=n, seed=seed, chunk_tokens=chunk))
    assert parts[-1] == whole
    assert all(c.finish_reason in ("stop", "length") for c in parts[-1])
    for before, after in zip(parts, parts[1:]):   # each a prefix of the next
      for b, a in zip(before, after):
        assert a.token_ids[:len(b.token_ids)] == b.token_ids
        assert a.logprobs[:len(b.logprobs)] == b.logprobs
        assert b.finish_reason in ("", "stop")
    if chunk < 20 and any(c.finish_reason == "length" for c in whole):
      assert len(parts) == -(-20 // chunk)   # it streamed: one item per chunk
      assert len(parts[0][0].token_ids) <= chunk


def test_a_cancelled_stream_stops_decoding(sampler):
  sp = SamplingParams(max_tokens=40, temperature=1.0)
  cancel = threading.Event()
  seen = []
  for part in sampler.stream([3, 4], sp, n=1, seed=0, chunk_tokens=4, cancelled=cancel):
    seen.append(len(part[0].token_ids))
    cancel.set()
  assert seen == [4]
