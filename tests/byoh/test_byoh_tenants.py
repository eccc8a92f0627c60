"""One base, one adapter per tenant, learning on the job (`rl.learner.lora.tenants`, online):
each tenant is served its own adapter, only its own graded sessions train it, and no tenant
reads another's sessions. A real proxy in the run, the embedded sampler, two harness threads."""
import threading
import time

import httpx
import numpy as np
import pytest
from safetensors.numpy import load_file

from posttrain_jax.config_io import ConfigTypeError
from posttrain_jax.metrics import read_metrics
from posttrain_jax.run import Trainer
from tests.byoh.test_byoh_learning import RL, _config
from tests.support import byoh as bt

KEYS = {"acme": "key-acme", "globex": "key-globex"}


def _harness(url, tenant, grade, out, stop):
  """Calls as `tenant` until `stop` (a grading harness sets it once served version 2, before
  the run ends and its server with it); grades its sessions only if `grade`. Appends
  (session, call id, served version) to out["seen"], failures to out["failed"]."""
  headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
  deadline, k = time.monotonic() + 300, 0
  while time.monotonic() < deadline and not stop.is_set():
    try:
      httpx.get(url + "/health", timeout=1)
      break
    except httpx.HTTPError:
      time.sleep(0.1)
  while time.monotonic() < deadline and not stop.is_set():
    session = f"{tenant}-{k}"
    body = {"model": "posttrain_jax", "max_tokens": 4, "seed": k,
            "messages": [{"role": "user", "content": f"Compute {k % 9}+1."}]}
    try:
      r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60,
                     headers={**headers, "X-Session-Id": session})
      if r.status_code != 200:
        out["failed"].append((session, r.status_code, r.text))
      else:
        out["seen"].append((session, r.json()["id"], int(r.headers["X-Policy-Version"])))
        if grade:
          httpx.post(f"{url}/v1/sessions/{session}/feedback", json={"grade": float(k % 2)},
                     headers=headers, timeout=30)
          if out["seen"][-1][2] >= 2:   # served after 2 steps: enough graded for the third
            stop.set()
    except httpx.HTTPError as e:
      out["failed"].append((session, "error", repr(e)))
    k += 1
    time.sleep(0.02)


@pytest.mark.slow   # ~75 s: a run serving two harnesses
def test_each_tenant_is_served_and_trained_its_own_adapter_only(tmp_path):
  """acme grades its sessions, globex never does: after 3 steps acme's adapter has moved and
  is served at rising versions; globex is served version 0 throughout and its exported
  adapter's B matrices are still exactly zero (nothing of acme's reached it); globex cannot
  list, read or grade acme's sessions (404), and neither harness saw a failed call."""
  db, port = tmp_path / "traces.db", bt.free_port()
  keys = [[key, tenant] for tenant, key in KEYS.items()]
  cfg = _config(tmp_path, db, rl={
      **RL, "mode": "online", "steps": 3, "prompts_per_step": 2,
      "learner": {**RL["learner"], "lora": {"rank": 4, "tenants": ["acme", "globex"]}},
      "traces": {"store": {"path": str(db)}, "wait_s": 60.0,
                 "online": {"port": port, "proxy": {"api_keys": keys}}}})
  url = f"http://127.0.0.1:{port}"
  stop = threading.Event()
  runs = {t: {"seen": [], "failed": []} for t in KEYS}
  threads = [threading.Thread(target=_harness, args=(url, t, t == "acme", runs[t], stop))
             for t in KEYS]
  for t in threads:
    t.start()
  trainer = Trainer(cfg, log=lambda *_: None)
  result = _run_then_probe(trainer, url, runs, stop)
  for t in threads:
    t.join()
  assert result is not None
  assert runs["acme"]["failed"] == [] and runs["globex"]["failed"] == []
  acme = [v for _, _, v in runs["acme"]["seen"]]
  assert acme == sorted(acme) and acme[0] == 0 and acme[-1] >= 2
  assert {v for _, _, v in runs["globex"]["seen"]} == {0} and runs["globex"]["seen"]
  rows = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "tenant/index" in r]
  assert [r["tenant/index"] for r in rows] == [0.0, 0.0, 0.0]
  # each step's versions as it collected (before its update): acme 0, 1, 2; globex never moves
  assert [r["tenant/acme/version"] for r in rows] == [0.0, 1.0, 2.0]
  assert [r["tenant/globex/version"] for r in rows] == [0.0, 0.0, 0.0]
  out = tmp_path / "run" / "final_adapter"
  moved = load_file(out / "acme" / "adapter_model.safetensors")
  still = load_file(out / "globex" / "adapter_model.safetensors")
  b_names = [k for k in still if "lora_B" in k]
  assert b_names and all(not np.any(still[k]) for k in b_names)
  assert any(np.any(moved[k]) for k in b_names)
  assert trainer.probe == {"list": [], "read": 404, "grade": 404}


def _run_then_probe(trainer, url, runs, stop):
  """Runs the trainer; while it serves (after acme's first served call), globex tries to
  list, read and grade acme's session."""
  probe = {}

  def cross_reads():
    deadline = time.monotonic() + 300
    while not runs["acme"]["seen"] and time.monotonic() < deadline:
      time.sleep(0.05)
    session = runs["acme"]["seen"][0][0]
    g = {"Authorization": f"Bearer {KEYS['globex']}"}
    probe["list"] = [s["id"] for s in httpx.get(url + "/v1/sessions", headers=g).json()["data"]
                     if s["id"].startswith("acme")]
    probe["read"] = httpx.get(f"{url}/v1/sessions/{session}", headers=g).status_code
    probe["grade"] = httpx.post(f"{url}/v1/sessions/{session}/feedback", json={"grade": 1.0},
                                headers=g).status_code

  t = threading.Thread(target=cross_reads)
  t.start()
  try:
    result = trainer.run()
  finally:
    stop.set()
    t.join()
  trainer.probe = probe
  return result


def test_per_tenant_config_errors_name_the_field(tmp_path):
  db = tmp_path / "traces.db"
  lora = {"rank": 4, "tenants": ["acme"]}
  rl = {**RL, "prompts_per_step": 2}
  with pytest.raises(ConfigTypeError, match="api_keys"):
    _config(tmp_path, db, rl={**rl, "mode": "online", "learner": {**RL["learner"], "lora": lora},
                              "traces": {"store": {"path": str(db)}}})
  with pytest.raises(ConfigTypeError, match=r"\[.globex.\] that have no adapter"):
    _config(tmp_path, db, rl={**rl, "mode": "online", "learner": {**RL["learner"], "lora": lora},
                              "traces": {"store": {"path": str(db)}, "online": {"proxy": {
                                  "api_keys": [["k1", "acme"], ["k2", "globex"]]}}}})
  with pytest.raises(ConfigTypeError, match="does not know whose a sample is"):
    _config(tmp_path, db, rl={**rl, "mode": "sync", "advantage": {"estimator": "grpo"},
                              "rollout": {"group_size": 2},
                              "learner": {**RL["learner"], "lora": lora}})


def test_the_running_baseline_is_kept_per_tenant():
  """Each tenant's advantages are against its own reward EMA: tenant b's rewards of 0 do not
  move tenant a's baseline (a shared global mean would have given a's next sample A = 0.5)."""
  from posttrain_jax.advantages import AdvantageConfig, compute_advantages
  from posttrain_jax.byoh.tenant_source import TenantTraceRollouts
  from posttrain_jax.types import Trajectory

  def traj(i, tenant, reward):
    return Trajectory(id=f"s{i}/0", task_id=f"s{i}", token_ids=[1, 2], loss_mask=[0, 1],
                      behaviour_logprobs=[0.0, -1.0], policy_version=[-1, 0], reward=reward,
                      metrics={"tenant": tenant, "sample_index": 0})
  cfg = AdvantageConfig(estimator="running", baseline_rate=0.5)
  key = TenantTraceRollouts.baseline_key
  first = compute_advantages([traj(0, "a", 1.0), traj(1, "b", 0.0)], cfg, per_task=False,
                             baseline_key=key)
  assert dict(first.state.task_means) == {"tenant:a": 1.0, "tenant:b": 0.0}
  second = compute_advantages([traj(2, "a", 1.0), traj(3, "b", 0.0)], cfg, first.state,
                              per_task=False, baseline_key=key)
  np.testing.assert_array_equal(second.advantages, [0.0, 0.0])
  shared = compute_advantages([traj(2, "a", 1.0)], cfg, first.state, per_task=False)
  np.testing.assert_array_equal(shared.advantages, [0.5])   # the global EMA (1 then 0 at 0.5)
