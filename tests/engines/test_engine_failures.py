"""OpenAIEngine when its server fails, against a scripted OpenAI-compatible HTTP server on a real
socket (the same protocol as vLLM's dev endpoints; tests/engines/test_engine_failures_vllm.py kills the
real vLLM server): a restarted server is given the current weights back before it serves a
request, a weight update waits for a server that is down (bounded), and a hung generate cannot
hold a weight update forever. Plus: a server child never outlives a killed parent."""
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from posttrain_jax.engines.base import SamplingParams
from posttrain_jax.engines.openai_engine import OpenAIEngine, OpenAIEngineConfig, ServerUnreachable
from posttrain_jax.engines.vllm_server import free_port
from tests.support.engines import server_alive

PAIRS = [("model.norm.weight", np.ones((4,), np.float32))]


class ScriptedServer:
  """A fresh server process stand-in: starts with version None (its start weights), records every
  call in order, and answers /v1/completions after `hold` is set (or at once)."""

  def __init__(self, port: int, hold: bool = False):
    self.calls: list[tuple[str, dict]] = []
    self.version = None
    self.release = threading.Event()
    if not hold:
      self.release.set()
    outer = self

    class Handler(http.server.BaseHTTPRequestHandler):
      def log_message(self, *args):
        pass

      def _reply(self, obj):
        data = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

      def do_GET(self):
        outer.calls.append((self.path, {}))
        self._reply({"data": [{"id": "tiny"}]})

      def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        outer.calls.append((self.path.split("?")[0], body))
        if self.path == "/collective_rpc":
          if body["method"] == "ptj_version":
            v = outer.version  # vLLM answers str() of an int result
            return self._reply({"results": [None if v is None else str(v)]})
          outer.version = body["kwargs"]["version"]
          return self._reply({"results": [1]})
        if self.path == "/abort_requests":
          outer.release.set()
          return self._reply({})
        if self.path == "/reset_prefix_cache":
          return self._reply({"success": True})
        if self.path.startswith("/v1/completions"):
          aborted = not outer.release.is_set()
          outer.release.wait()
          n = body["n"]
          return self._reply({"model": "tiny", "choices": [
              {"index": j, "token_ids": [5], "logprobs": {"token_logprobs": [-0.5]},
               "finish_reason": "abort" if aborted else "stop"} for j in range(n)]})
        self._reply({})

    self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    self.url = f"http://127.0.0.1:{port}"
    threading.Thread(target=self.server.serve_forever, daemon=True).start()

  def paths(self) -> list[str]:
    return [p if p != "/collective_rpc" else f"rpc:{b['method']}" for p, b in self.calls]

  def close(self):
    self.release.set()
    self.server.shutdown()
    self.server.server_close()


def _engine(url, tmp_path, **kw):
  cfg = dict(base_url=url, weights_dir=str(tmp_path / "w"), max_retries=0, retry_backoff_s=0.05,
             connect_timeout_s=1.0)
  return OpenAIEngine(OpenAIEngineConfig(**{**cfg, **kw}))


def test_a_restarted_server_gets_the_current_weights_before_any_request(tmp_path):
  port = free_port()
  first = ScriptedServer(port)
  engine = _engine(first.url, tmp_path)
  engine.update_weights(PAIRS, version=3)
  assert first.version == 3
  first.close()                                       # the server dies ...
  with pytest.raises(ServerUnreachable, match=f"127.0.0.1:{port}"):
    engine.generate([[1, 2]], SamplingParams(max_tokens=1))   # -> infra_error upstream
  second = ScriptedServer(port)                       # ... and comes back with start weights
  out = engine.generate([[1, 2]], SamplingParams(max_tokens=1), n=2)
  assert second.paths() == ["rpc:ptj_version", "rpc:ptj_reload_weights", "/reset_prefix_cache",
                            "/v1/completions"]
  reload = second.calls[1][1]["kwargs"]
  assert reload == {"path": str(tmp_path / "w" / "v00000003"), "version": 3}
  assert second.version == 3 and engine.restores == 1
  assert {c.version for c in out[0]} == {3}
  engine.generate([[1, 2]], SamplingParams(max_tokens=1))   # healthy again: no second check
  assert second.paths()[4:] == ["/v1/completions"]
  second.close()


def test_a_server_that_kept_the_current_weights_is_not_reloaded(tmp_path):
  port = free_port()
  server = ScriptedServer(port)
  engine = _engine(server.url, tmp_path)
  engine.update_weights(PAIRS, version=1)
  engine._stale = True  # as after a dropped connection to a server that did not restart
  server.calls.clear()
  engine.generate([[1]], SamplingParams(max_tokens=1))
  assert server.paths() == ["rpc:ptj_version", "/v1/completions"] and engine.restores == 0
  server.close()


def test_a_weight_update_waits_for_a_server_that_is_down_then_gives_up(tmp_path):
  port = free_port()
  server = ScriptedServer(port)
  engine = _engine(server.url, tmp_path, server_wait_s=30.0)
  server.close()
  back = {}
  timer = threading.Timer(1.0, lambda: back.update(server=ScriptedServer(port)))
  timer.start()
  engine.update_weights(PAIRS, version=1)             # waits ~1 s instead of failing the run
  assert back["server"].version == 1 and engine.version == 1
  back["server"].close()
  gone = ScriptedServer(free_port())
  quick = _engine(gone.url, tmp_path / "q", server_wait_s=0.5)
  gone.close()
  t0 = time.monotonic()
  with pytest.raises(ServerUnreachable,
                     match=f"version 1: the server did not come back within server_wait_s=0.5 .*"
                           f"{gone.url}"):
    quick.update_weights(PAIRS, version=1)
  assert time.monotonic() - t0 < 10 and quick.version == 0


def test_a_hung_generate_cannot_hold_a_weight_update_forever(tmp_path):
  """in_flight="finish" waits for requests at most drain_timeout_s, then aborts them: they
  come back "abort" with the old version (infra_error), and the update goes through."""
  server = ScriptedServer(free_port(), hold=True)
  engine = _engine(server.url, tmp_path, request_timeout_s=60.0, drain_timeout_s=0.5,
                   in_flight="finish")
  result = {}
  t = threading.Thread(target=lambda: result.update(
      out=engine.generate([[1, 2]], SamplingParams(max_tokens=4), n=2)))
  t.start()
  while "/v1/completions" not in server.paths():
    time.sleep(0.01)
  t0 = time.monotonic()
  engine.update_weights(PAIRS, version=1)
  waited = time.monotonic() - t0
  t.join(10)
  assert "/abort_requests" in server.paths() and engine.version == 1
  assert [c.finish_reason for c in result["out"][0]] == ["abort", "abort"]
  assert result["out"][0][0].version == 0
  assert waited < 10, waited  # bounded by the timeouts (1 s + abort), not by the hung request
  server.close()


_PARENT = """
import sys, time
from posttrain_jax.engines.vllm_server import spawn_child
import pathlib
p = spawn_child([sys.executable, "-c", "import time; time.sleep(300)"],
                pathlib.Path(sys.argv[1]), {})
print(p.pid, flush=True)
time.sleep(300)
"""


def test_a_server_child_dies_with_a_killed_parent(tmp_path):
  """kill -9 of the process that started the server (a trainer): the child, in its own session
  so that a Ctrl-C does not reach it first, still gets SIGTERM (PR_SET_PDEATHSIG)."""
  parent = subprocess.Popen([sys.executable, "-c", _PARENT, str(tmp_path / "log")],
                            stdout=subprocess.PIPE, text=True, env={**os.environ})
  child = int(parent.stdout.readline())
  assert os.getsid(child) == child  # its own session
  parent.send_signal(signal.SIGKILL)
  parent.wait()
  for _ in range(200):
    if not server_alive(child):
      break
    time.sleep(0.05)
  else:
    os.kill(child, signal.SIGKILL)
    pytest.fail(f"server child {child} outlived its killed parent")


