"""Fake engines for tests.

    FakeEngine    an engine object for the actor tests (no model): 1..6 tokens a completion,
                  chosen calls failing, delays, a gate
    "fake"        the one registered engine (`rl.engine="fake"` in a run config): the embedded
                  JAX sampler, with chosen generate calls failing (FakeConfig); importing this
                  module registers it
"""
import dataclasses
import itertools
import random
import threading
import time

from posttrain_jax.engines.base import Completion, EngineError
from posttrain_jax.engines.jax_sampler import JaxSamplerConfig, _build as build_jax
from posttrain_jax.engines.registry import register_engine
from posttrain_jax.run.evaluation import SEED as EVAL_SEED
from posttrain_jax.graders import GradeResult
from posttrain_jax.tasks import Task


class Tokenizer:
  def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
    return [2 + ord(c) % 40 for m in messages for c in m["content"]]

  def decode(self, ids, skip_special_tokens=True):
    return str(len(ids))


def grader(text, task):
  return GradeResult(reward=float(int(text) % 2))


class FakeEngine:
  """Samples 1..6 tokens per completion; `fail(prompt_key, nth_call_for_it)` decides failures;
  sleeps `delay` s per call (`block` makes it wait until released)."""

  def __init__(self, fail=lambda key, nth: False, delay=0.0, block=None):
    self.version, self.fail, self.delay, self.block = 0, fail, delay, block
    self.calls: dict = {}
    self.lock = threading.Lock()

  def update_weights(self, weights, version):
    self.version = version

  def generate(self, prompts, sampling, n=1, seed=None):
    version = self.version
    key = tuple(map(tuple, prompts))
    with self.lock:
      self.calls[key] = nth = self.calls.get(key, 0) + 1
    if self.fail(key, nth):
      raise ConnectionError("engine unreachable")
    if self.block is not None:
      self.block.wait()
    time.sleep(self.delay)
    rng = random.Random(seed)
    return [[Completion(token_ids=[5] * (k := rng.randint(1, 6)), logprobs=[-0.5] * k,
                        finish_reason="stop", version=version) for _ in range(n)] for _ in prompts]


def tasks(n=None, start=0):
  for i in itertools.count(start) if n is None else range(n):
    yield Task(id=f"t{i}", prompt=f"{i}+{i}=", answer=str(2 * i))



@dataclasses.dataclass(frozen=True)
class FakeConfig(JaxSamplerConfig):
  """The "fake" engine: the embedded sampler, and which of its generate calls fail."""
  fail_calls: tuple = ()     # 1-based numbers, among the calls `fail_on` counts, that fail
  fail_on: str = "eval"      # eval: held-out eval's calls (they sample with run/evaluation.SEED);
                             # rollout: every other call; any: all calls
  error: str = "engine"      # engine: EngineError (infrastructure); bug: ValueError (our code)


class Fake:
  """The sampler `inner`, failing the calls FakeConfig names; `counted` calls so far."""

  def __init__(self, inner, cfg: FakeConfig):
    if cfg.fail_on not in ("eval", "rollout", "any"):
      raise ValueError(f"engine_config.fail_on: {cfg.fail_on!r}; valid: eval, rollout, any")
    self.inner, self.cfg, self.counted = inner, cfg, 0

  def generate(self, prompts, params, n=1, seed=0):
    is_eval = seed == EVAL_SEED
    if self.cfg.fail_on == "any" or is_eval == (self.cfg.fail_on == "eval"):
      self.counted += 1
      if self.counted in self.cfg.fail_calls:
        if self.cfg.error == "bug":
          raise ValueError("a bug in our code")
        raise EngineError(f"engine down ({self.cfg.fail_on} call {self.counted})")
    return self.inner.generate(prompts, params, n=n, seed=seed)

  def __getattr__(self, name):
    return getattr(self.inner, name)


@register_engine("fake", FakeConfig, shareable=False)
def _build_fake(cfg, ctx):
  return Fake(build_jax(cfg, ctx), cfg)
