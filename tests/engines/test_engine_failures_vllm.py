"""The real vLLM server dies (issue R item 2): kill -9 its process group mid-generate. The request
in flight fails as an EngineError (a rollout's infra_error, never a reward), the supervisor
restarts the server, and the engine gives the restarted server the current weights before it
serves anything: its completions are the trained weights' log-probs, not the start weights'
(which is what a client-side version alone would have tagged as current). And the server does
not outlive a trainer that is killed."""
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest


from posttrain_jax.engines.base import EngineError, SamplingParams
from posttrain_jax.engines.openai_engine import OpenAIEngine, OpenAIEngineConfig
from posttrain_jax.models import hf_io
from tests.support import vllm as vt
from tests.support.engines import server_alive
from tests.support.engines import KillingProxy

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


def _gone_within(family: list[int], limit_s: float) -> float:
  """Seconds until every pid of `family` is gone; fails (killing what is left) past limit_s."""
  t0 = time.monotonic()
  while any(server_alive(p) for p in family) and time.monotonic() - t0 < limit_s:
    time.sleep(0.2)
  left = [p for p in family if server_alive(p)]
  for p in left:
    os.kill(p, signal.SIGKILL)
  assert not left, f"vLLM processes {left} outlived the killed trainer"
  return time.monotonic() - t0


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
    print(f"\nserver family {family} gone {_gone_within(family, 90.0):.1f} s after the kill")
    assert not _answers(url)




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
  from tests.support.runs import tiny_run
  from tests.support.vllm import TINY_FIELDS
  with vt.vllm_environment(tmp_path / "vllm_env"):
    server = LocalVLLMServer(LocalServerConfig(
        model=str(vt.tiny_model_dir(tmp_path)), dtype="float32", max_model_len=256,
        enforce_eager=True, log_path=str(tmp_path / "server.log"), max_restarts=1))
    with server:
      proxy = KillingProxy(server)
      workdir = tmp_path / "run"
      cfg = tiny_run(workdir, model={"tiny": {**TINY_FIELDS, "corpus_lines": 500}},
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


_IN_PROCESS = """
import sys, threading, time
from posttrain_jax.engines.base import SamplingParams
from posttrain_jax.engines.vllm_engine import VLLMEngine, VLLMEngineConfig
e = VLLMEngine(VLLMEngineConfig(model=sys.argv[1], dtype="float32", max_model_len=512,
                                enforce_eager=True))
print("PIDS", *e.core_pids(), flush=True)
while True:   # the worker busy when the kill comes
  e.generate([[3, 4, 5]] * 8, SamplingParams(max_tokens=400), n=4, seed=0)
"""


@vt.needs_vllm
def test_the_in_process_engine_does_not_outlive_a_killed_trainer(tmp_path_factory):
  """kill -9 of a trainer whose `vllm.LLM` runs in its own process: vLLM's engine core and
  worker (its children) go too, busy or not (seen 2026-12-07: a killed trainer's core and
  worker, mid-generate, still at 70 % of a core 40 s later)."""
  base = tmp_path_factory.getbasetemp()
  with vt.vllm_environment(base / "vllm_env_orphan_inproc"):
    tiny = vt.tiny_model_dir(base)
    trainer = subprocess.Popen([sys.executable, "-c", _IN_PROCESS, str(tiny)],
                               stdout=subprocess.PIPE, text=True, env={**os.environ})
    try:
      line = "?"
      while line and not line.startswith("PIDS "):   # vLLM logs to stdout too
        line = trainer.stdout.readline()
      assert line, "the engine did not start"
      family = [int(p) for p in line.split()[1:]]
      assert len(family) >= 2, family   # the engine core + its worker
      # its logs read on, so that a full pipe never stops the trainer before the kill
      threading.Thread(target=trainer.stdout.read, daemon=True).start()
      time.sleep(2.0)   # generating
    finally:
      trainer.send_signal(signal.SIGKILL)
      trainer.wait()
    print(f"\nengine family {family} gone {_gone_within(family, 30.0):.1f} s after the kill")
