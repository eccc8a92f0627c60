"""The fleet's own decisions on CPU in seconds, against small stand-in servers that speak the
HTTP the fleet uses (completions with token ids, vLLM's dev-mode weight endpoints and our
worker extension's version): what real vLLM servers do is tests/test_fleet*_vllm.py's. Here:
a server restarted between two health probes (start weights, no connection ever failed) is
taken out, then readmitted holding the current weights; a weight update while every server is
out waits for one to come back; a dead server's prompts are "error" completions and later
prompts avoid it; a request the server rejects (4xx) is raised and leaves the server in."""
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from posttrain_jax.engines.base import SamplingParams
from posttrain_jax.engines.fleet import FleetConfig, FleetEngine
from posttrain_jax.engines.openai_engine import OpenAIEngineConfig, RequestRejected
from posttrain_jax.engines.vllm_server import free_port

WEIGHTS = [("model.embed_tokens.weight", np.zeros((4, 2), np.float32))]


class StandIn:
  """Serves `model`; completion token i of a prompt is (last prompt token + i + 1) % 100; a
  prompt holding token 999 is rejected (400); `version` is what ptj_version reports."""

  def __init__(self, model: str = "tiny"):
    self.model, self.port, self.version, self.completions = model, free_port(), None, 0
    self._httpd = None
    self.start()

  @property
  def url(self) -> str:
    return f"http://127.0.0.1:{self.port}"

  def start(self, version=None):
    """Up (again) on the same port, holding `version` (None: its start weights)."""
    self.version = version
    server = self

    class Handler(BaseHTTPRequestHandler):
      def log_message(self, *args):
        pass

      def _send(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

      def do_GET(self):
        self._send(200, {"data": [{"id": server.model}]})

      def do_POST(self):
        n = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(n) or b"{}")
        path = self.path.split("?")[0]
        if path == "/v1/completions":
          if 999 in body["prompt"]:
            return self._send(400, {"error": {"message": "prompt holds token 999"}})
          server.completions += 1
          ids = [(body["prompt"][-1] + i + 1) % 100 for i in range(body["max_tokens"])]
          return self._send(200, {"model": server.model, "choices": [
              {"index": j, "token_ids": ids, "logprobs": {"token_logprobs": [-1.0] * len(ids)},
               "finish_reason": "length"} for j in range(body["n"])]})
        if path == "/collective_rpc":
          if body["method"] == "ptj_reload_weights":
            server.version = body["kwargs"]["version"]
            return self._send(200, {"results": [None]})
          return self._send(200, {"results": [server.version]})
        if path == "/reset_prefix_cache":
          return self._send(200, {"success": True})
        return self._send(200, {})           # /pause, /resume, /abort_requests

    self._httpd = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
    threading.Thread(target=self._httpd.serve_forever, daemon=True).start()

  def stop(self):
    """Gone: connections are refused."""
    self._httpd.shutdown()
    self._httpd.server_close()


@pytest.fixture
def two(tmp_path):
  servers = [StandIn(), StandIn()]
  engine = FleetEngine(FleetConfig(
      urls=tuple(s.url for s in servers), health_interval_s=0,   # rounds run by the test
      server=OpenAIEngineConfig(weights_dir=str(tmp_path / "w"), max_retries=0,
                                connect_timeout_s=2, server_wait_s=20)))
  yield engine, servers
  engine.close()
  for s in servers:
    try:
      s.stop()
    except Exception:  # noqa: BLE001 -- already stopped by the test
      pass


def _up(engine):
  return [s["up"] for s in engine.servers()]


def test_a_server_restarted_between_probes_is_taken_out_then_readmitted_current(two):
  engine, (a, b) = two
  engine.update_weights(WEIGHTS, version=1)
  assert (a.version, b.version) == (1, 1) and engine.last_weight_sync["servers"] == 2
  engine.check_health()
  assert _up(engine) == [True, True]
  b.stop()
  b.start(version=None)         # restarted by its supervisor: start weights, same URL
  engine.check_health()          # the fleet never saw a connection fail
  assert _up(engine) == [True, False]
  assert "holds weights version None" in engine.servers()[1]["why"]
  out = engine.generate([[1, 2], [5]], SamplingParams(max_tokens=3), n=2)
  assert b.completions == 0 and all(c.version == 1 for x in out for c in x)
  engine.check_health()          # answers: reloaded with the current checkpoint, back in
  assert _up(engine) == [True, True] and b.version == 1
  assert engine.servers()[1]["readmitted"] == 1


def test_an_update_with_every_server_out_waits_for_one_to_come_back(two):
  engine, (a, b) = two
  a.stop()
  b.stop()
  engine.check_health()
  assert _up(engine) == [False, False]
  threading.Timer(1.5, a.start).start()   # a comes back (start weights) during the update
  t0 = time.monotonic()
  engine.update_weights(WEIGHTS, version=1)
  print(f"\nthe update waited {time.monotonic() - t0:.1f} s for a server")
  assert time.monotonic() - t0 >= 1.0 and engine.version == 1
  assert _up(engine) == [True, False] and a.version == 1   # readmitted with version 1
  out = engine.generate([[7]], SamplingParams(max_tokens=2))
  assert out[0][0].version == 1 and out[0][0].token_ids == [8, 9]


def test_an_update_fails_after_server_wait_s_when_none_comes_back(tmp_path):
  s = StandIn()
  engine = FleetEngine(FleetConfig(urls=(s.url,), health_interval_s=0, server=OpenAIEngineConfig(
      weights_dir=str(tmp_path / "w"), max_retries=0, connect_timeout_s=1, server_wait_s=2)))
  s.stop()
  engine.check_health()
  with pytest.raises(Exception, match="no server of the fleet took it within server_wait_s=2"):
    engine.update_weights(WEIGHTS, version=1)
  engine.close()


def test_a_dead_servers_prompts_are_errors_and_later_ones_avoid_it(two):
  engine, (a, b) = two
  b.stop()                       # not yet noticed: no health round
  out = engine.generate([[1], [2], [3], [4]], SamplingParams(max_tokens=2), n=3)
  errors = [x for x in out if x[0].finish_reason == "error"]
  assert errors and all(c.token_ids == [] and c.logprobs == [] for x in errors for c in x)
  assert len(errors) + a.completions == 4
  assert _up(engine) == [True, False]
  before = a.completions
  out = engine.generate([[1], [2]], SamplingParams(max_tokens=2))
  assert a.completions - before == 2 and all(x[0].finish_reason == "length" for x in out)


def test_a_rejected_request_is_raised_and_the_server_stays_in(two):
  engine, _ = two
  with pytest.raises(RequestRejected, match="token 999"):
    engine.generate([[999]], SamplingParams(max_tokens=2))
  assert _up(engine) == [True, True]
