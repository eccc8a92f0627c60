"""engines/coalesce.py: concurrent unseeded calls become one engine call; each caller gets what a
call of its own would have given; seeded calls are never grouped; an error finds its owner."""
import threading

import numpy as np
import pytest

from posttrain_jax.engines.base import SamplingParams
from posttrain_jax.engines.coalesce import Coalescer
from tests.support.byoh import tiny_sampler
from tests.support.fake_engine import FakeEngine


def _concurrently(fn, args):
  """fn(*a) for every a in args, each on its own thread, released together; results in order."""
  out, gate = [None] * len(args), threading.Barrier(len(args))

  def run(i):
    gate.wait()
    try:
      out[i] = fn(*args[i])
    except Exception as e:  # noqa: BLE001 -- returned for the test to check
      out[i] = e
  threads = [threading.Thread(target=run, args=(i,)) for i in range(len(args))]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  return out


@pytest.fixture(scope="module")
def sampler():
  return tiny_sampler()


def test_concurrent_greedy_calls_are_one_batch_and_each_gets_its_own_answer(sampler):
  prompts = [[1 + (7 * i + j) % 300 for j in range(5 + i)] for i in range(8)]
  sp = SamplingParams(max_tokens=6, temperature=0.0)
  alone = [sampler.generate([p], sp)[0][0] for p in prompts]
  eng = Coalescer(sampler, window_s=0.05)
  got = _concurrently(lambda p: eng.generate([p], sp), [(p,) for p in prompts])
  stats = eng.coalesce_stats()
  assert stats["requests"] == 8 and stats["engine_calls"] < 8 and stats["largest"] >= 2
  for ((c,),), a in zip(got, alone):
    assert c.token_ids == a.token_ids
    np.testing.assert_allclose(c.logprobs, a.logprobs, atol=1e-4)


def test_seeded_calls_go_alone_and_reproduce(sampler):
  prompts = [[3, 4, 5 + i] for i in range(4)]
  sp = SamplingParams(max_tokens=5, temperature=1.0)
  alone = [sampler.generate([p], sp, seed=11)[0][0].token_ids for p in prompts]
  eng = Coalescer(sampler, window_s=0.05)
  got = _concurrently(lambda p: eng.generate([p], sp, seed=11), [(p,) for p in prompts])
  assert [g[0][0].token_ids for g in got] == alone
  assert eng.coalesce_stats()["engine_calls"] == 4


def test_different_sampling_is_never_mixed_and_a_failed_group_fails_only_its_owner():
  bad = (9, 9, 9)
  inner = FakeEngine(fail=lambda key, nth: bad in key, delay=0.05)
  eng = Coalescer(inner, window_s=0.05)
  a, b = SamplingParams(max_tokens=4, temperature=1.0), SamplingParams(max_tokens=4, temperature=0.5)
  args = [([[i, i]], a) for i in range(1, 5)] + [([list(bad)], a)] + [([[i]], b) for i in range(3)]
  got = _concurrently(lambda p, sp: eng.generate(p, sp), args)
  assert isinstance(got[4], ConnectionError)
  assert all(isinstance(g, list) and len(g) == 1 for i, g in enumerate(got) if i != 4)
  issued = list(inner.calls)   # each engine call's prompts
  # no call held prompts of both sampling settings: b's prompts have length 1, a's length 2 / 3
  assert all(len({len(p) == 1 for p in key}) == 1 for key in issued)
  # the failed group was retried alone by each of its callers
  assert inner.calls[(bad,)] == 1
  assert eng.coalesce_stats()["requests"] == 8


def test_nothing_is_kept_per_sampling_setting_once_its_calls_are_done():
  """A harness drawing its own temperature per call must not grow the coalescer's state."""
  eng = Coalescer(FakeEngine(delay=0.01), window_s=0.01)
  args = [([[i, i]], SamplingParams(max_tokens=4, temperature=0.1 * i)) for i in range(1, 9)]
  assert all(isinstance(g, list) for g in _concurrently(lambda p, sp: eng.generate(p, sp), args))
  assert eng._open == {} and eng._last == {}
