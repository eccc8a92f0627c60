"""Learning from recorded traces: `rl.mode="traces"` trains on the graded sessions the proxy
recorded (a real proxy, the openai client as the harness, the embedded sampler), each session
once, resumably, with the staleness of the recorded tokens reported."""
import httpx
import openai
import pytest

from posttrain_jax.byoh.rebuild import rebuild_session
from posttrain_jax.byoh.store import StoreConfig, TraceStore
from posttrain_jax.engines.jax_sampler import JaxSampler, JaxSamplerConfig
from posttrain_jax.metrics import read_metrics
from posttrain_jax.models import hf_io
from posttrain_jax.run_config import run_config_from_dict
from posttrain_jax.run import Trainer
from tests.support import byoh as bt
from tests.support import envs as et


def _record_sessions(db):
  """Six graded sessions (three of two turns) and one ungraded, through the proxy."""
  tok = et.tokenizer("hermes")
  sampler = JaxSampler(hf_io.load_hf_model(et.tiny_dir("hermes")),
                       JaxSamplerConfig(max_prompt_len=128, pad_id=tok.pad_token_id))
  with bt.running(sampler, db) as (url, _):
    for k in range(7):
      client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0,
                             default_headers={"X-Session-Id": f"task-{k}"})
      messages = [{"role": "user", "content": f"Compute {k}+1."}]
      r = client.chat.completions.create(model="posttrain_jax", messages=messages, max_tokens=6,
                                         seed=k)
      if k % 2:
        messages += [r.choices[0].message, {"role": "user", "content": "Sure?"}]
        client.chat.completions.create(model="posttrain_jax", messages=messages, max_tokens=6,
                                       seed=100 + k)
      if k < 6:
        httpx.post(f"{url}/v1/sessions/task-{k}/feedback", json={"grade": (k % 3) / 2})


RL = {"mode": "traces", "advantage": {"estimator": "running"}, "reference_kl": False,
      "learner": {"loss": "grpo", "optimizer": {"learning_rate": 1e-3}},
      "rollout": {"max_tokens": 4},
      "batch": {"rows": 8, "seq_len": 64, "max_seqs": 8, "pack": False}}


def _config(tmp_path, db, **over):
  d = {"workdir": str(tmp_path / "run"), "seed": 0,
       "model": {"tiny": {"chat_format": "hermes", **et.SMALL}},
       "tasks": {"generator_config": {"max_digits": 1, "ops": "+", "allow_negative": False},
                 "eval_fraction": 0.2, "eval_size": 4},
       "sft": {"steps": 0},
       "rl": {**RL, "steps": 3, "prompts_per_step": 4, "traces": {"store": {"path": str(db)}}},
       "eval": {"every_steps": 0, "samples_per_prompt": 1, "max_tokens": 4, "greedy": False},
       "checkpoint": {"every_steps": 1}}
  d.update(over)
  return run_config_from_dict(d)


def test_traces_mode_trains_each_graded_session_once_and_resumes(tmp_path):
  db = tmp_path / "traces.db"
  _record_sessions(db)
  store = TraceStore(StoreConfig(path=str(db)))
  sampled = {}
  for k in range(6):
    samples, _ = rebuild_session(f"task-{k}", store.calls("default", f"task-{k}"),
                                 store.feedback("default", f"task-{k}"))
    sampled[k] = sum(sum(s.loss_mask) for s in samples)
  store.close()
  # stop after the first step, resume for the rest: no session twice, none lost
  assert Trainer(_config(tmp_path, db, stop_after_step=1), log=lambda *_: None).run() is None
  assert Trainer(_config(tmp_path, db), log=lambda *_: None).run() is not None
  rows = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "traces/sessions" in r
          or "skipped_update" in r]
  by_step = {r["step"]: r for r in rows}
  assert sorted(by_step) == [1, 2, 3]
  s1, s2, s3 = by_step[1], by_step[2], by_step[3]
  # oldest grade first: task-0..3, then task-4, task-5; task-6 has no grade and is never taken
  assert (s1["traces/sessions"], s2["traces/sessions"]) == (4, 2)
  assert s1["tokens"] == sum(sampled[k] for k in range(4))
  assert s2["tokens"] == sampled[4] + sampled[5]
  assert s3["skipped_update"] == 1.0 and s3.get("traces/sessions", 0) == 0
  assert s3["traces/total/sessions"] == 6
  # recorded at version 0; trained at versions 0 and 1
  assert s1["traces/staleness/max"] == 0 and s2["traces/staleness/max"] == 1
  assert s1["reward/mean"] == pytest.approx((0 + 0.5 + 1.0 + 0) / 4)


def test_sessions_older_than_max_staleness_are_counted_not_trained(tmp_path):
  db = tmp_path / "traces.db"
  _record_sessions(db)   # all sampled at version 0
  rl = {**RL, "steps": 2, "prompts_per_step": 4,
        "traces": {"store": {"path": str(db)}, "max_staleness": 0}}
  assert Trainer(_config(tmp_path, db, rl=rl), log=lambda *_: None).run() is not None
  rows = {r["step"]: r for r in read_metrics(tmp_path / "run" / "metrics.jsonl")
          if "traces/sessions" in r or "traces/dropped_stale" in r}
  assert rows[1]["traces/sessions"] == 4 and rows[1]["filter/stale_session_frac"] == 0.0
  # at version 1 the two left are one version old: taken, counted, not trained
  assert rows[2]["traces/dropped_stale"] == 2 and rows[2]["filter/stale_session_frac"] == 1.0
  assert rows[2]["skipped_update"] == 1.0


def test_traces_mode_refuses_a_group_baseline():
  with pytest.raises(Exception, match="running"):
    run_config_from_dict({"rl": {"mode": "traces", "advantage": {"estimator": "grpo"}}})


def test_online_mode_serves_trains_and_swaps_weights_without_a_failed_call(tmp_path):
  """One run serves the policy (a proxy thread), trains on sessions as a harness grades them,
  and installs each step's weights into the serving engine while the harness keeps calling:
  every call succeeds, the versions it is served by rise with the steps, and each recorded
  choice carries the version that answered."""
  import threading
  import time
  db, port = tmp_path / "traces.db", bt.free_port()
  cfg = _config(tmp_path, db, rl={**RL, "mode": "online", "steps": 4, "prompts_per_step": 2,
                                  "traces": {"store": {"path": str(db)}, "wait_s": 60.0,
                                             "online": {"port": port}}})
  url = f"http://127.0.0.1:{port}"
  seen, failures = [], []

  def harness():
    deadline, k = time.monotonic() + 240, 0
    while time.monotonic() < deadline:
      try:
        httpx.get(url + "/health", timeout=1)
        break
      except httpx.HTTPError:
        time.sleep(0.1)
    while time.monotonic() < deadline:
      body = {"model": "posttrain_jax", "max_tokens": 4, "seed": k,
              "messages": [{"role": "user", "content": f"Compute {k % 9}+1."}]}
      try:
        r = httpx.post(url + "/v1/chat/completions", json=body,
                       headers={"X-Session-Id": f"s{k}"}, timeout=60)
        if r.status_code != 200:
          failures.append((k, r.status_code, r.text))
        else:
          seen.append((r.json()["id"], int(r.headers["X-Policy-Version"]),
                       r.json()["system_fingerprint"]))
          if k < 8:
            httpx.post(f"{url}/v1/sessions/s{k}/feedback", json={"grade": float(k % 2)})
      except httpx.HTTPError as e:
        failures.append((k, "error", repr(e)))
      k += 1
      if k >= 8 and seen and seen[-1][1] >= 2:
        return
      time.sleep(0.02)

  t = threading.Thread(target=harness)
  t.start()
  result = Trainer(cfg, log=lambda *_: None).run()
  t.join()
  assert result is not None and failures == []
  versions = [v for _, v, _ in seen]
  assert versions == sorted(versions) and versions[0] == 0 and versions[-1] >= 2
  assert all(fp == f"posttrain_jax-v{v}" for _, v, fp in seen)
  store = TraceStore(StoreConfig(path=str(db)))
  recorded = {c.id: c for c in store.calls("default")}
  for call_id, v, _ in seen:
    assert recorded[call_id].status == "complete"
    assert [ch.version for ch in recorded[call_id].choices] == [v]
  store.close()
  rows = {r["step"]: r for r in read_metrics(tmp_path / "run" / "metrics.jsonl")
          if "traces/sessions" in r}
  assert [rows[s]["traces/sessions"] for s in sorted(rows)] == [2, 2, 2, 2]



def test_online_mode_serves_any_prompt_a_batch_row_can_train(tmp_path):
  """A harness's prompts are its own (a tool schema, worked examples, history), not the task
  bank's: online, the engine takes prompts up to a batch row less the answer's tokens (not the
  bank's longest held-out prompt, which a tool-using agent outgrew: a 400 on every call)."""
  from posttrain_jax.run.parts import Parts
  rl = {**RL, "steps": 1, "prompts_per_step": 4, "batch": {**RL["batch"], "seq_len": 256}}
  offline = Parts(_config(tmp_path, tmp_path / "a.db", rl=rl), print)
  online = Parts(_config(tmp_path, tmp_path / "b.db", rl={**rl, "mode": "online"}), print)
  assert offline.limits.max_prompt == 64          # the bank's prompts are short: the floor
  assert online.limits.max_prompt == 256 - online.limits.max_tokens
  assert online.limits.max_tokens == offline.limits.max_tokens
