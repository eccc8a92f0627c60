"""Shared test helpers (fake_engine), moved out of the test modules that used to import each other."""
import itertools
import random
import threading
import time
from posttrain_jax.engines.base import Completion
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

