"""Backpressure (byoh/backpressure.py): with the learner at its bound, a new session's call is a
429 with Retry-After (OpenAI's shape; Anthropic's on /v1/messages) that records nothing, or
waits until the learner reports a new version; below the bound every call is served. The real
openai / anthropic clients against the real proxy; the learner is driven through `proxy.gate`,
as TraceRollouts.update_weights drives it online."""
import threading
import time

import anthropic
import httpx
import openai
import pytest

from posttrain_jax.byoh.server import ProxyConfig
from posttrain_jax.byoh.trace_source import TraceRollouts, TraceSourceConfig
from posttrain_jax.byoh.store import StoreConfig, TraceStore
from tests.support import byoh as bt

MODEL = "posttrain_jax"
HI = [{"role": "user", "content": "Hi."}]


def _chat(url, session):
  return bt.openai_client(url, session).chat.completions.create(model=MODEL, messages=HI,
                                                                max_tokens=8)


def _health(url) -> dict:
  return httpx.get(url + "/health").json()["backpressure"]


def test_reject_mode_answers_429_with_retry_after_at_the_bound_and_records_nothing(tmp_path):
  cfg = ProxyConfig(backpressure="reject", max_pending_sessions=3, retry_after_s=7)
  with bt.running(bt.scripted_engine(["ok"]), tmp_path / "t.db", cfg) as (url, proxy):
    now = [0.0]   # the gate's clock: the learner's step time is ours to set, not the machine's
    proxy.gate._clock, proxy.gate._reported_at = (lambda: now[0]), 0.0
    proxy.gate.report(0, 1)                       # one ready session the learner has not trained
    assert _chat(url, "a").choices[0].message.content == "ok"   # below the bound: served
    assert _chat(url, "b").choices[0].message.content == "ok"   # 1 pending + 2 new = the bound
    assert _chat(url, "a").choices[0].message.content == "ok"   # a session begun goes on
    with pytest.raises(openai.RateLimitError) as e:
      _chat(url, "c")
    assert e.value.status_code == 429 and e.value.response.headers["retry-after"] == "7"
    assert e.value.body["code"] == "learner_behind" and e.value.body["type"] == "rate_limit_error"
    with pytest.raises(anthropic.RateLimitError) as e:
      bt.anthropic_client(url, "d").messages.create(model=MODEL, max_tokens=8, messages=HI)
    assert e.value.response.headers["retry-after"] == "7"
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "rate_limit_error"
    got = _health(url)
    assert (got["rejected"], got["queued"], got["pending"], got["new"]) == (2, 0, 1, 2)
    store = proxy.store
    assert [len(store.calls("default", s)) for s in "abcd"] == [2, 1, 0, 0]
    now[0] = 1.2
    proxy.gate.report(1, 0)                       # the learner stepped (in 1.2 s) and caught up
    assert _chat(url, "c").choices[0].message.content == "ok"
    assert len(store.calls("default", "c")) == 1
    proxy.gate.report(1, 3)                       # at the bound again: Retry-After = its step
    with pytest.raises(openai.RateLimitError) as e:
      _chat(url, "e")
    assert e.value.response.headers["retry-after"] == "2"


def test_queue_mode_serves_the_call_once_the_learner_advances(tmp_path):
  cfg = ProxyConfig(backpressure="queue", max_pending_sessions=2, queue_timeout_s=30)
  with bt.running(bt.scripted_engine(["ok"]), tmp_path / "t.db", cfg) as (url, proxy):
    proxy.gate.report(0, 1)
    assert _chat(url, "a").choices[0].message.content == "ok"    # below the bound: at once
    assert _health(url)["queued"] == 0
    out = {}
    waiting = threading.Thread(target=lambda: out.update(r=_chat(url, "b")))
    t0 = time.monotonic()
    waiting.start()
    while _health(url)["queued"] == 0:
      assert time.monotonic() - t0 < 10, "the call was neither queued nor served"
      time.sleep(0.02)
    time.sleep(0.5)
    assert waiting.is_alive() and proxy.store.calls("default", "b") == []   # held, not served
    proxy.gate.report(1, 0)                       # the learner advanced
    waiting.join(timeout=10)
    assert out["r"].choices[0].message.content == "ok"
    assert len(proxy.store.calls("default", "b")) == 1
    got = _health(url)
    assert (got["queued"], got["rejected"]) == (1, 0) and got["queued_s"] >= 0.5


def test_queue_mode_is_a_429_after_its_timeout(tmp_path):
  cfg = ProxyConfig(backpressure="queue", max_pending_sessions=1, queue_timeout_s=0.3)
  with bt.running(bt.scripted_engine(["ok"]), tmp_path / "t.db", cfg) as (url, proxy):
    proxy.gate.report(0, 1)
    t0 = time.monotonic()
    with pytest.raises(openai.RateLimitError) as e:
      _chat(url, "a")
    assert time.monotonic() - t0 >= 0.3 and "retry-after" in e.value.response.headers
    got = _health(url)
    assert (got["queued"], got["rejected"]) == (1, 1) and got["queued_s"] >= 0.3
    assert proxy.store.calls("default", "a") == []


def test_no_bound_serves_every_call(tmp_path):
  with bt.running(bt.scripted_engine(["ok"]), tmp_path / "t.db") as (url, proxy):
    proxy.gate.report(0, 1000)
    assert [_chat(url, s).choices[0].message.content for s in "abc"] == ["ok"] * 3
    assert _health(url)["rejected"] == 0


def test_the_trace_source_reports_its_version_and_backlog_to_the_gate(tmp_path):
  """Online, each weight swap tells the proxy the learner's version and its untrained backlog."""
  db = tmp_path / "t.db"
  with bt.running(bt.scripted_engine(["ok"]), db) as (url, proxy):
    for k in range(3):
      _chat(url, f"s{k}")
      httpx.post(f"{url}/v1/sessions/s{k}/feedback", json={"grade": 1.0})

    class Server:  # what TraceRollouts uses of an OnlineServer
      def close(self):
        pass
    server = Server()
    server.proxy = proxy
    src = TraceRollouts(TraceSourceConfig(store=StoreConfig(path=str(db))), 1,
                        store=TraceStore(StoreConfig(path=str(db))), server=server)
    src.collect(0)                                # trains one of the three
    src.update_weights(None, 1)
    assert (proxy.gate.version, proxy.gate.pending) == (1, 2)
    src.store.close()


def test_an_unknown_mode_is_an_error_naming_the_field():
  with pytest.raises(ValueError, match="ProxyConfig.backpressure is 'drop'"):
    ProxyConfig(backpressure="drop")
