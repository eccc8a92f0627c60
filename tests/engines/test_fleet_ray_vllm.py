"""The fleet placed by Ray (a local `ray.init()`): two real vLLM servers as Ray actors, routing
over both, weight sync to both; then one actor's process is killed (kill -9): its server dies
with it, Ray restarts the actor (a new server on a new port), and the fleet follows the slot
to its new URL and readmits it only once it holds the current weights."""
import importlib.util
import os
import signal
import time

import numpy as np
import pytest

from posttrain_jax.engines.base import SamplingParams
from posttrain_jax.engines.fleet import FleetConfig, FleetEngine
from posttrain_jax.engines.fleet_ray import RayFleet, RayFleetConfig
from posttrain_jax.engines.openai_engine import OpenAIEngineConfig
from posttrain_jax.models import hf_io
from tests.support import vllm as vt
from tests.support.engines import server_alive

PROMPTS = [[3, 4, 5], list(range(40, 57)), [7], [9, 9, 2, 11]]
needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="Ray is not installed (pip install -e '.[ray]')")


def _spread(engine, before):
  return np.subtract([s["requests"] for s in engine.servers()], before)


@needs_ray
@vt.needs_vllm
def test_ray_places_and_restarts_servers_and_the_fleet_follows(tmp_path):
  import ray
  with vt.vllm_environment(tmp_path / "vllm_env"):
    tiny = vt.tiny_model_dir(tmp_path)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)  # inherits the env above
    engine = placed = None
    try:
      placed = RayFleet(RayFleetConfig(servers=2, dtype="float32", max_model_len=512,
                                       enforce_eager=True, max_restarts=1), tiny)
      first_urls = placed.urls()
      engine = FleetEngine(FleetConfig(health_interval_s=0.5, server=OpenAIEngineConfig(
          weights_dir=str(tmp_path / "weights"), max_retries=0)),
          discover=placed.urls, on_close=placed.close)
      start = hf_io.load_hf_model(tiny)
      ref, new = vt.Reference(start), vt.noised(start, 0.03, seed=2)
      before = [0, 0]
      out = engine.generate(PROMPTS * 3, SamplingParams(max_tokens=8), n=2, seed=0)
      assert _spread(engine, before).min() >= 3
      assert vt.completion_deltas(ref, start, PROMPTS * 3, out).mean() <= 1e-3
      engine.update_weights(new, version=1)
      assert engine.last_weight_sync["servers"] == 2

      actor_pid = ray.get(placed.actors[1].actor_pid.remote())
      server_pid = ray.get(placed.actors[1].pid.remote())
      family = _family(server_pid)   # api_server, engine core
      assert len(family) >= 2, family
      os.kill(actor_pid, signal.SIGKILL)
      t0 = time.monotonic()
      while any(server_alive(p) for p in family):
        assert time.monotonic() - t0 < 90, f"vLLM processes outlived their killed Ray actor: {family}"
        time.sleep(0.2)
      print(f"\nserver {family} gone {time.monotonic() - t0:.1f} s after its actor")
      t0 = time.monotonic()
      while not (engine.servers()[1]["up"] and engine.servers()[1]["url"] != first_urls[1]):
        assert time.monotonic() - t0 < 600, engine.servers()
        time.sleep(0.5)
      print(f"restarted by Ray at {engine.servers()[1]['url']} (was {first_urls[1]}), "
            f"readmitted in {time.monotonic() - t0:.1f} s")
      assert engine._members[1].client.served_version() == 1
      before = [s["requests"] for s in engine.servers()]
      out = engine.generate(PROMPTS * 3, SamplingParams(max_tokens=8), n=2, seed=1)
      assert _spread(engine, before).min() >= 3
      d_new = vt.completion_deltas(ref, new, PROMPTS * 3, out).mean()
      d_start = vt.completion_deltas(ref, start, PROMPTS * 3, out).mean()
      print(f"after the restart: mean |d| vs current {d_new:.2e}, vs start {d_start:.2e}")
      assert d_new <= 1e-3 and d_start > 0.05
      family = [p for pid in (ray.get(a.pid.remote()) for a in placed.actors)
                for p in _family(pid)]
      engine.close()      # stops the servers, ends the actors
      engine = None
      t0 = time.monotonic()
      while any(server_alive(p) for p in family):
        assert time.monotonic() - t0 < 60, f"vLLM processes outlived the fleet's close: {family}"
        time.sleep(0.2)
    finally:
      if engine is not None:
        engine.close()
      elif placed is not None:
        placed.close()
      ray.shutdown()


def _family(pid: int) -> list[int]:
  import psutil
  return [pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)]
