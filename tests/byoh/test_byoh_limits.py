"""The proxy's limits on the embedded sampler: prompt + max_tokens past the model's context is a
400 naming the field (each API's own name for it), nothing recorded; and calls asking for many
tokens leave an engine thread to shorter ones."""
import threading
import time

import httpx
import pytest

from posttrain_jax.byoh.server import ProxyConfig
from posttrain_jax.engines.base import PromptTooLongError
from posttrain_jax.engines.jax_sampler import JaxSampler, JaxSamplerConfig
from posttrain_jax.models import hf_io
from tests.support import byoh as bt
from tests.support import envs as et

MODEL = "posttrain_jax"
HI = [{"role": "user", "content": "Compute 12+30."}]


@pytest.fixture(scope="module")
def sampler():
  tok = et.tokenizer("hermes")
  return JaxSampler(hf_io.load_hf_model(et.tiny_dir("hermes")),
                    JaxSamplerConfig(max_prompt_len=256, pad_id=tok.pad_token_id))


def test_past_the_models_context_is_a_400_naming_max_tokens(tmp_path, sampler):
  assert sampler.context_len == 1024   # the tiny model's max_position_embeddings
  with bt.running(sampler, tmp_path / "t.db") as (url, proxy):
    cases = [("/v1/chat/completions", {"messages": HI, "max_tokens": 1010}, "max_tokens"),
             ("/v1/chat/completions", {"messages": HI, "max_completion_tokens": 1010},
              "max_completion_tokens"),
             ("/v1/completions", {"prompt": "12+30=", "max_tokens": 1022}, "max_tokens"),
             ("/v1/responses", {"input": "Compute 12+30.", "max_output_tokens": 1010},
              "max_output_tokens"),
             ("/v1/chat/completions", {"messages": HI, "max_tokens": 1010, "stream": True},
              "max_tokens")]
    for path, body, field in cases:
      r = httpx.post(url + path, json={"model": MODEL, **body})
      err = r.json()["error"]
      assert (r.status_code, err["param"], err["code"]) == (400, field,
                                                              "context_length_exceeded"), body
      assert "context of 1024 tokens" in err["message"] and "at most" in err["message"]
    assert proxy.store.calls("default") == []
    r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": HI,
                                                       "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3


class _TooLong:
  """An engine that declares no context_len and refuses every prompt + max_tokens itself."""
  version = 0

  def generate(self, prompts, sampling, n=1, seed=None):
    raise PromptTooLongError(0, f"max_tokens={sampling.max_tokens} does not fit",
                             param="max_tokens")


def test_an_engines_own_context_error_names_its_field(tmp_path):
  with bt.running(_TooLong(), tmp_path / "t.db") as (url, proxy):
    r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": HI,
                                                       "max_tokens": 7}, headers={
                                                           "X-Session-Id": "s"})
    err = r.json()["error"]
    assert (r.status_code, err["param"]) == (400, "max_tokens") and "max_tokens=7" in err["message"]
    assert [c.status for c in proxy.store.calls("default", "s")] == ["error"]


class _Gated:
  """Answers at once, except calls asking for over 100 tokens: they wait for `release`."""

  def __init__(self):
    self.inner = bt.scripted_engine(["ok"])
    self.version, self.release, self.entered = 0, threading.Event(), 0

  def generate(self, prompts, sampling, n=1, seed=None):
    if sampling.max_tokens > 100:
      self.entered += 1
      self.release.wait(timeout=120)
    return self.inner.generate(prompts, sampling, n, seed)


def _wait(cond, timeout: float = 60.0) -> None:
  """Blocks until cond() holds (a guard against a hang, not a timing assertion)."""
  end = time.monotonic() + timeout
  while not cond():
    if time.monotonic() > end:
      raise AssertionError("timed out waiting for the proxy")
    time.sleep(0.005)


def test_long_calls_leave_a_thread_to_short_ones(tmp_path):
  """Two engine threads, two long calls in flight (one decoding, one waiting for the long
  lane): a short call still gets the second thread and is answered before either long one."""
  engine = _Gated()
  cfg = ProxyConfig(workers=2, long_request_tokens=100)
  with bt.running(engine, tmp_path / "t.db", cfg) as (url, proxy):
    answers = {}

    def call(name, max_tokens):
      r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
          "model": MODEL, "messages": HI, "max_tokens": max_tokens})
      answers[name] = r.status_code
    longs = [threading.Thread(target=call, args=(f"long{i}", 500)) for i in range(2)]
    for t in longs:
      t.start()
    _wait(lambda: proxy.counts["long_calls"] == 2 and engine.entered == 1)
    call("short", 10)                  # this thread: returns once the short call is answered
    assert answers == {"short": 200} and engine.entered == 1
    engine.release.set()
    for t in longs:
      t.join()
    assert answers == {"short": 200, "long0": 200, "long1": 200} and engine.entered == 2
