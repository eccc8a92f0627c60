"""The real vLLM server dies (issue R item 2): kill -9 its process group mid-generate. The request
in flight fails as an EngineError (a rollout's infra_error, never a reward), the supervisor
restarts the server, and the engine gives the restarted server the current weights before it
serves anything: its completions are the trained weights' log-probs, not the start weights'
(which is what a client-side version alone would have tagged as current). And the server does
not outlive a trainer that is killed."""
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest


from posttrain_jax.engines.base import EngineError, SamplingParams
from posttrain_jax.engines.openai_engine import OpenAIEngine, OpenAIEngineConfig
from posttrain_jax.models import hf_io
from tests import vllm_testing as vt
from tests.test_engine_failures import _alive

PROMPTS = [[3, 4, 5], list(range(40, 57)), [7]]


def _answers(url: str) -> bool:
  try:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=2):
      return True
  except OSError:
    return False


@vt.needs_vllm
def test_a_killed_server_is_restarted_and_serves_the_current_weights(tmp_path_factory):
  from posttrain_jax.engines.vllm_server import LocalServerConfig, LocalVLLMServer
  base = tmp_path_factory.getbasetemp()
  with vt.vllm_environment(base / "vllm_env"):
    tiny = vt.tiny_model_dir(base)
    logs = tmp_path_factory.mktemp("server")
    server = LocalVLLMServer(LocalServerConfig(
        model=str(tiny), dtype="float32", max_model_len=512, enforce_eager=True,
        log_path=str(logs / "server.log"), max_restarts=1))
    with server:
      engine = OpenAIEngine(OpenAIEngineConfig(
          base_url=server.url, weights_dir=str(tmp_path_factory.mktemp("weights")),
          max_retries=0))
      start = hf_io.load_hf_model(tiny)
      ref, new = vt.Reference(start), vt.noised(start, 0.03, seed=2)
      engine.update_weights(new, version=1)
      result = {}

      def long_generate():
        try:
          engine.generate([[3, 4, 5]], SamplingParams(max_tokens=480), n=8, seed=1)
        except EngineError as e:
          result["error"] = e

      t = threading.Thread(target=long_generate)
      t.start()
      time.sleep(1.0)  # the request is at the server, decoding
      first = server.proc.pid
      os.killpg(first, signal.SIGKILL)
      t.join(120)
      assert "error" in result, "the request in flight at the kill did not fail"
      print(f"\nin flight at the kill: {result['error']}")
      t0 = time.monotonic()
      while not (server.restarts == 1 and server.proc is not None and server.proc.pid != first
                 and _answers(server.url)):
        assert time.monotonic() - t0 < 600, server.log_tail()
        time.sleep(0.5)
      print(f"restarted in {time.monotonic() - t0:.1f} s")
      out = engine.generate(PROMPTS, SamplingParams(max_tokens=8), n=2, seed=3)
      assert engine.restores == 1
      assert {c.version for x in out for c in x} == {1}
      d_new = vt.completion_deltas(ref, new, PROMPTS, out).mean()
      d_start = vt.completion_deltas(ref, start, PROMPTS, out).mean()
      print(f"after the restart: mean |d| vs current {d_new:.2e}, vs start {d_start:.2e}")
      assert d_new <= 1e-3 and d_start > 0.05
      engine.close()


_TRAINER = """
import sys, time
from posttrain_jax.engines.vllm_server import LocalServerConfig, LocalVLLMServer
s = LocalVLLMServer(LocalServerConfig(model=sys.argv[1], dtype="float32", max_model_len=256,
                                      enforce_eager=True, log_path=sys.argv[2])).start()
print(s.proc.pid, s.url, flush=True)
time.sleep(600)
"""


@vt.needs_vllm
def test_the_server_does_not_outlive_a_killed_trainer(tmp_path_factory):
  import psutil
  base = tmp_path_factory.getbasetemp()
  with vt.vllm_environment(base / "vllm_env_orphan"):
    tiny = vt.tiny_model_dir(base)
    log = tmp_path_factory.mktemp("orphan") / "server.log"
    trainer = subprocess.Popen([sys.executable, "-c", _TRAINER, str(tiny), str(log)],
                               stdout=subprocess.PIPE, text=True, env={**os.environ})
    line = trainer.stdout.readline()
    assert line, log.read_text()[-3000:] if log.exists() else "the server did not start"
    pid, url = int(line.split()[0]), line.split()[1]
    family = [pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)]
    assert _answers(url) and len(family) >= 2, family  # api_server + its engine process
    trainer.send_signal(signal.SIGKILL)
    trainer.wait()
    t0 = time.monotonic()
    while any(_alive(p) for p in family) and time.monotonic() - t0 < 90:
      time.sleep(0.2)
    left = [p for p in family if _alive(p)]
    for p in left:
      os.kill(p, signal.SIGKILL)
    assert not left, f"vLLM processes {left} outlived the killed trainer"
    print(f"\nserver family {family} gone {time.monotonic() - t0:.1f} s after the kill")
    assert not _answers(url)


class _KillingProxy:
  """A TCP forwarder between the engine and the server: once `arm()`ed, the first
  POST /v1/completions that passes through is forwarded and then the server's process group is
  killed (SIGKILL), so the kill lands with a rollout's request in flight at the server, not
  between two requests (where update_weights would just wait for the restart). The answer to
  that request is never passed back, so a server that answers within the forwarder's 50 ms (a
  few tokens) still loses it. With `kill_first` the server is killed before the request is
  passed on."""

  def __init__(self, server, kill_first: bool = False):
    self.server, self.armed, self.killed_pid = server, threading.Event(), None
    self.kill_first = kill_first
    self._arm_when = None
    self._lsock = socket.create_server(("127.0.0.1", 0))
    self.url = f"http://127.0.0.1:{self._lsock.getsockname()[1]}"
    threading.Thread(target=self._accept, daemon=True).start()

  def arm(self):
    self.armed.set()

  def arm_after_step(self, workdir, step: int) -> None:
    """Arms once metrics.jsonl in `workdir` holds step `step`'s row. Checked when a request
    arrives, not by a polling thread: the trainer flushes a step's row before the next step's
    rollouts, so the kill lands in step `step + 1` however late a poller would wake (in one CI
    run a 50 ms poller armed after step 3's 0.3 s of rollouts had already gone through)."""
    from posttrain_jax.metrics import read_metrics
    path = pathlib.Path(workdir) / "metrics.jsonl"
    self._arm_when = lambda: path.exists() and any(
        r.get("policy_version") == step for r in read_metrics(path))

  def _accept(self):
    while True:
      try:
        client, _ = self._lsock.accept()
      except OSError:
        return
      try:
        upstream = socket.create_connection(("127.0.0.1", self.server.port), timeout=5)
      except OSError:
        client.close()  # the server is down: the engine sees a refused / reset connection
        continue
      upstream.settimeout(None)
      doomed = threading.Event()  # this connection carried the killing request
      threading.Thread(target=self._pipe, args=(client, upstream, True, doomed), daemon=True).start()
      threading.Thread(target=self._pipe, args=(upstream, client, False, doomed), daemon=True).start()

  def _should_kill(self, data: bytes) -> bool:
    if self.killed_pid is not None or b"POST /v1/completions" not in data:
      return False
    if not self.armed.is_set() and self._arm_when is not None and self._arm_when():
      self.armed.set()
    return self.armed.is_set()

  def _pipe(self, src, dst, to_server, doomed):
    try:
      while data := src.recv(65536):
        if not to_server and doomed.is_set():
          break  # the answer to the killing request never reaches the engine, however fast
        kill = to_server and self._should_kill(data)
        if kill:
          self.killed_pid = self.server.proc.pid
          doomed.set()
        if kill and self.kill_first:
          os.killpg(self.killed_pid, signal.SIGKILL)
          time.sleep(0.2)   # gone before the request reaches it
        dst.sendall(data)
        if kill and not self.kill_first:
          time.sleep(0.05)  # the request has reached the server
          os.killpg(self.killed_pid, signal.SIGKILL)
    except OSError:
      pass
    finally:
      for s in (src, dst):
        try:
          s.shutdown(socket.SHUT_RDWR)
        except OSError:
          pass
        s.close()

  def close(self):
    self._lsock.close()


@pytest.mark.slow  # ~4 min: CI runs it in the slow stage (vLLM is installed by then)
@vt.needs_vllm
def test_a_run_rides_out_a_killed_server(tmp_path):
  """GRPO with rl.engine=openai on a supervised local server, killed (process group, kill -9)
  with step 3's rollout request in flight: those rollouts are infra_error, retried with backoff
  until the restarted server answers, the restarted server is given the current weights before
  it serves them, training goes on to the end. Metrics show the gap (engine errors, retries,
  the step's time) and every step's learner log-probs still equal the server's (a restarted
  server serving its start weights under the current version's tag would break that)."""
  from posttrain_jax.engines.vllm_server import LocalServerConfig, LocalVLLMServer
  from posttrain_jax.run import Trainer
  from tests.test_trainer import tiny_run
  from tests.test_trainer_vllm import TINY
  with vt.vllm_environment(tmp_path / "vllm_env"):
    server = LocalVLLMServer(LocalServerConfig(
        model=str(vt.tiny_model_dir(tmp_path)), dtype="float32", max_model_len=256,
        enforce_eager=True, log_path=str(tmp_path / "server.log"), max_restarts=1))
    with server:
      proxy = _KillingProxy(server)
      workdir = tmp_path / "run"
      cfg = tiny_run(workdir, model={"tiny": {**TINY, "corpus_lines": 500}},
                     rl={"steps": 5, "prompts_per_step": 2, "engine": "openai",
                         "engine_config": {"base_url": proxy.url, "max_retries": 0,
                                           "weights_dir": str(tmp_path / "weights")},
                         "retry": {"backoff_s": 2.0, "backoff_max_s": 8.0, "max_retries": 30,
                                   "max_requeues": 4},
                         "rollout": {"group_size": 4, "max_tokens": 4},
                         "learner": {"loss": "grpo", "optimizer": {"learning_rate": 1e-3}},
                         "batch": {"rows": 8, "seq_len": 32, "max_seqs": 8, "pack": False}})

      proxy.arm_after_step(workdir, 2)
      result = Trainer(cfg, log=lambda *_: None).run()
      proxy.close()
      assert proxy.killed_pid is not None, "the server was never killed"
      assert result is not None and server.restarts == 1
  vt.check_run_rode_out_step_3(workdir, result)
