"""The in-process vLLM engine's core dies or hangs (issue R item 2), on the real vLLM.

kill -9 of vLLM's worker process mid-generate: the call fails as an EngineError at once (vLLM's
own `LLM.generate` would block forever), the next call runs on a new core that was first given
the current weights (its log-probs are the trained weights', not the start weights' the new
core loaded). A hung core (SIGSTOP) is bounded by `request_timeout_s`, and so is a weight update
waiting behind it. No process of a dead or closed engine is left behind. One engine for the
module: every restart is 20-50 s here."""
import os
import signal
import threading
import time

import psutil
import pytest

from posttrain_jax.engines.base import EngineError, SamplingParams
from posttrain_jax.engines.vllm_engine import VLLMEngine, VLLMEngineConfig
from posttrain_jax.engines.vllm_procs import core_procs
from posttrain_jax.models import hf_io
from tests.support import vllm as vt

PROMPTS = [[3, 4, 5], list(range(40, 57)), [7]]
TIMEOUT_S = 30.0


def _workers(engine) -> list[int]:
  """The engine's worker processes (children of the engine core), pids."""
  core = {p.pid for p in core_procs(engine._llm)}
  return [pid for pid in engine.core_pids() if pid not in core]


def _alive(pid: int) -> bool:
  try:
    return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
  except psutil.NoSuchProcess:
    return False


@pytest.fixture(scope="module")
def live(tmp_path_factory):
  base = tmp_path_factory.getbasetemp()
  with vt.vllm_environment(base / "vllm_env_failures"):
    tiny = vt.tiny_model_dir(base)
    engine = VLLMEngine(VLLMEngineConfig(model=str(tiny), dtype="float32", max_model_len=512,
                                         enforce_eager=True, request_timeout_s=TIMEOUT_S,
                                         max_restarts=2))
    start = hf_io.load_hf_model(tiny)
    yield engine, start
    family = engine.core_pids()
    engine.close()
    time.sleep(1.0)
    assert not [p for p in family if _alive(p)], "vLLM processes outlived close()"


def _in_thread(call):
  box = {}

  def run():
    t0 = time.monotonic()
    try:
      box["out"] = call()
    except EngineError as e:
      box["error"] = e
    box["s"] = time.monotonic() - t0

  t = threading.Thread(target=run, daemon=True)
  t.start()
  return t, box


def _long_generate(engine):
  """64 sequences of 480 tokens: seconds of decoding, so a fault 0.5 s in lands mid-call (8 such
  sequences once finished in 0.96 s, before the fault, on an idle machine)."""
  return engine.generate([[3, 4, 5]] * 4, SamplingParams(max_tokens=480), n=16, seed=1)


@vt.needs_vllm
def test_a_killed_worker_fails_the_call_and_the_restart_serves_the_current_weights(live):
  engine, start = live
  ref, new = vt.Reference(start), vt.noised(start, 0.03, seed=2)
  engine.update_weights(new, version=1)
  workers = _workers(engine)
  assert workers, f"no worker process under the engine core: {engine.core_pids()}"
  t, box = _in_thread(lambda: _long_generate(engine))
  time.sleep(0.5)  # decoding
  assert t.is_alive(), "the generate call ended before the kill"
  t_kill = time.monotonic()
  os.kill(workers[0], signal.SIGKILL)
  t.join(TIMEOUT_S * 3)
  assert not t.is_alive(), "generate still blocked after the worker was killed"
  assert "error" in box, f"the call in flight at the kill did not fail: {box}"
  print(f"\nkilled worker {workers[0]}: the call failed {time.monotonic() - t_kill:.1f} s later: "
        f"{box['error']}")
  assert "request_timeout_s" not in str(box["error"])  # seen dead, not waited out
  t0 = time.monotonic()
  out = engine.generate(PROMPTS, SamplingParams(max_tokens=8), n=2, seed=3)
  print(f"restart + restore + generate {time.monotonic() - t0:.1f} s")
  assert engine.restarts == 1 and engine.restores == 1
  assert {c.version for x in out for c in x} == {1}
  d_new = vt.completion_deltas(ref, new, PROMPTS, out).mean()
  d_start = vt.completion_deltas(ref, start, PROMPTS, out).mean()
  print(f"after the restart: mean |dlogp| vs current {d_new:.2e}, vs start {d_start:.2e}")
  assert d_new <= 1e-3 and d_start > 0.05
  assert not [p for p in workers if _alive(p)], "the killed core's processes are still alive"


@vt.needs_vllm
def test_a_hung_core_is_bounded_and_so_is_an_update_behind_it(live):
  engine, start = live
  restarts = engine.restarts
  newer = vt.noised(start, 0.03, seed=5)
  version = engine.version + 1
  family = engine.core_pids()
  t, box = _in_thread(lambda: _long_generate(engine))
  time.sleep(0.5)  # decoding
  assert t.is_alive(), "the generate call ended before the core was stopped"
  for pid in family:
    os.kill(pid, signal.SIGSTOP)  # hung: alive, silent
  t0 = time.monotonic()
  engine.update_weights(newer, version=version)  # waits for the lock the hung call holds
  waited = time.monotonic() - t0
  t.join(5)
  print(f"\nhung core: generate failed after {box.get('s', float('nan')):.1f} s "
        f"({box.get('error')}); update_weights returned after {waited:.1f} s")
  assert "error" in box and "request_timeout_s" in str(box["error"])
  assert TIMEOUT_S - 1 <= box["s"] <= TIMEOUT_S + 15
  assert engine.version == version and engine.restarts == restarts + 1
  assert not [p for p in family if _alive(p)], "the hung core was not killed"
  ref = vt.Reference(start)
  out = engine.generate(PROMPTS, SamplingParams(max_tokens=8), n=2, seed=4)
  assert {c.version for x in out for c in x} == {version}
  assert vt.completion_deltas(ref, newer, PROMPTS, out).mean() <= 1e-3


@vt.needs_vllm
def test_restarts_are_bounded_and_the_error_says_so(live):
  engine, _ = live
  assert engine.restarts == engine.cfg.max_restarts  # spent by the two tests above
  engine.kill_core()
  with pytest.raises(EngineError) as e:
    engine.generate(PROMPTS, SamplingParams(max_tokens=4))
  if "max_restarts" not in str(e.value):  # the kill was seen by this call itself
    with pytest.raises(EngineError, match="max_restarts=2 restarts are spent"):
      engine.generate(PROMPTS, SamplingParams(max_tokens=4))


@pytest.mark.slow  # ~2 min: two vLLM start-ups; CI runs it in the slow stage
@vt.needs_vllm
def test_a_run_rides_out_a_killed_worker(tmp_path, monkeypatch):
  """GRPO with rl.engine=vllm (in process): the worker is killed (kill -9) just as step 3's
  rollouts go to vLLM. Those rollouts are infra_error and retried with backoff; the retry runs
  on a restarted core given the current weights (every step's learner log-probs still equal
  vLLM's), training goes on to the end, and the metrics show the gap."""
  from posttrain_jax.run import Trainer
  from tests.support.runs import tiny_run
  from tests.support.vllm import TINY_FIELDS
  killed = []
  real_run = VLLMEngine._run

  def run_then_kill(self, what, prompts, params):  # the fault lands inside step 3's generate
    rollout = what == "generate" and params[0].n == 4  # (held-out evals sample 1 per prompt)
    if rollout and self.version == 2 and not killed:
      killed.append(self._watch[-1])
      os.kill(killed[0], signal.SIGKILL)
    return real_run(self, what, prompts, params)

  monkeypatch.setattr(VLLMEngine, "_run", run_then_kill)
  workdir = tmp_path / "run"
  cfg = tiny_run(workdir, model={"tiny": {**TINY_FIELDS, "corpus_lines": 500}},
                 rl={"steps": 5, "prompts_per_step": 2, "engine": "vllm",
                     "engine_config": {"dtype": "float32", "max_model_len": 256,
                                       "enforce_eager": True},
                     "retry": {"backoff_s": 1.0, "backoff_max_s": 4.0, "max_retries": 10,
                               "max_requeues": 4},
                     "rollout": {"group_size": 4, "max_tokens": 4},
                     "learner": {"loss": "grpo", "optimizer": {"learning_rate": 1e-3}},
                     "batch": {"rows": 8, "seq_len": 32, "max_seqs": 8, "pack": False}})
  with vt.vllm_environment(tmp_path / "vllm_env"):
    trainer = Trainer(cfg, log=lambda *_: None)
    result = trainer.run()
    engine = trainer.engine
    restarts, restores = engine.restarts, engine.restores
  assert killed, "the worker was never killed"
  assert result is not None and restarts == 1 and restores == 1
  vt.check_run_rode_out_step_3(workdir, result, f"restarts {restarts} restores {restores}\n")
