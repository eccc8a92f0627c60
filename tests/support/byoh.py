"""A real proxy server for the BYOH tests (uvicorn on a free port in a background thread), and
the check that a served call was recorded as sampled."""
from __future__ import annotations

import contextlib
import pathlib
import socket
import subprocess
import sys
import threading
import time

import openai
import uvicorn

from posttrain_jax.byoh.app import build_app
from posttrain_jax.byoh.server import Proxy, ProxyConfig
from posttrain_jax.byoh.store import Choice, StoreConfig, TraceStore
from tests.support import envs as et


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@contextlib.contextmanager
def running(engine, db_path, cfg: ProxyConfig = ProxyConfig(), chat_format: str = "hermes"):
  """Yields (base_url, proxy) for a proxy on `engine` recording into `db_path`."""
  tok = et.tokenizer(chat_format)
  store = TraceStore(StoreConfig(path=str(db_path), synchronous="NORMAL"))
  proxy = Proxy(cfg, engine, tok, store, et.stop_ids(tok, chat_format), "hermes")
  port = free_port()
  # the stdlib event loop: uvloop's C-level state stays out of the pytest process, whose main
  # thread runs asyncio (and SIGINT) tests of its own
  server = uvicorn.Server(uvicorn.Config(build_app(proxy), host="127.0.0.1", port=port,
                                         log_level="warning", loop="asyncio"))
  thread = threading.Thread(target=server.run, daemon=True)
  thread.start()
  deadline = time.monotonic() + 30
  while not server.started:
    if time.monotonic() > deadline or not thread.is_alive():
      raise RuntimeError("the proxy did not start")
    time.sleep(0.02)
  try:
    yield f"http://127.0.0.1:{port}", proxy
  finally:
    server.should_exit = True
    thread.join(timeout=10)
    proxy.close()
    store.close()


def check_recorded_as_sampled(response, db, session: str, model_dir, what: str) -> None:
  """The chat `response` (n choices, logprobs) is the session's one recorded call, token for
  token: the client's per-token log-probs and texts are the recorded ones, the recorded
  log-probs are the learner's under the served weights (`model_dir`), and the rebuilt samples
  are the recorded prompt ids + each choice's sampled ids."""
  import pytest

  from posttrain_jax.byoh.rebuild import rebuild_session
  from posttrain_jax.engines.base import Completion
  from posttrain_jax.models import hf_io
  from tests.support import vllm as vt
  store = TraceStore(StoreConfig(path=str(db)))
  (call,) = store.calls("default", session)
  assert call.status == "complete"
  assert [c.index for c in call.choices] == list(range(len(response.choices)))
  tok = hf_io.load_tokenizer(model_dir)
  for got, rec in zip(response.choices, call.choices):
    n = len(got.logprobs.content)
    assert [t.logprob for t in got.logprobs.content] == pytest.approx(rec.logprobs[:n], abs=1e-6)
    assert "".join(t.token for t in got.logprobs.content) == tok.decode(rec.token_ids[:n])
    assert got.message.content == rec.text
  model = hf_io.load_hf_model(model_dir)
  comps = [[Completion(token_ids=c.token_ids, logprobs=c.logprobs, finish_reason=c.finish_reason,
                       version=c.version) for c in call.choices]]
  d = vt.completion_deltas(vt.Reference(model), model, [call.prompt_ids], comps)
  print(f"\n{what} vs learner: mean |d logp| {d.mean():.2e}, max {d.max():.2e} "
        f"over {d.size} tokens")
  assert d.size >= 2 and d.mean() <= 1e-3 and d.max() <= 1e-2
  samples, stats = rebuild_session(session, store.calls("default", session))
  assert stats["samples"] == len(call.choices)
  for sample, c in zip(samples, call.choices):
    assert sample.token_ids == call.prompt_ids + c.token_ids
    assert sample.behaviour_logprobs[len(call.prompt_ids):] == c.logprobs
  store.close()


def check_seeded_stream(url: str, db, prefix: str) -> None:
  """A seeded stream through the proxy at `url` samples what the seeded whole answer did:
  the same text, the same recorded ids and prompt ids (sessions `<prefix>-whole`, `-stream`)."""
  import openai

  def client(session):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                         default_headers={"X-Session-Id": session})
  kw = dict(model="posttrain_jax", messages=[{"role": "user", "content": "Count."}],
            max_tokens=10, temperature=1.0, seed=11)
  whole = client(f"{prefix}-whole").chat.completions.create(**kw)
  pieces = [ch.choices[0].delta.content or "" for ch in
            client(f"{prefix}-stream").chat.completions.create(stream=True, **kw) if ch.choices]
  assert "".join(pieces) == whole.choices[0].message.content
  store = TraceStore(StoreConfig(path=str(db)))
  (a,), (b,) = store.calls("default", f"{prefix}-whole"), store.calls("default", f"{prefix}-stream")
  assert a.choices[0].token_ids == b.choices[0].token_ids and b.status == "complete"
  assert a.prompt_ids == b.prompt_ids
  store.close()


@contextlib.contextmanager
def serve_process(args: list[str], db, model_dir, port: int):
  """`launch/serve.py` as a user starts it (its own process, `args` then the model, port and
  store flags); yields the process once it prints `serving`, SIGTERMs it after."""
  root = pathlib.Path(__file__).resolve().parents[2]
  proc = subprocess.Popen(
      [sys.executable, str(root / "launch" / "serve.py"), *args,
       "--config.proxy.max_tokens_limit=256", f"--config.model_path={model_dir}",
       f"--config.port={port}", f"--config.store.path={db}",
       "--config.store.synchronous=NORMAL", "--config.max_prompt_tokens=512"],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    lines = []
    for line in proc.stdout:          # an engine (vLLM) logs its start-up first
      lines.append(line)
      if line.startswith("serving"):
        break
    else:
      raise RuntimeError(f"launch/serve.py {' '.join(args)} did not start:\n" + "".join(lines))
    yield proc
  finally:
    proc.terminate()
    try:
      proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
      proc.kill()


def recorded_choice(i, ids, version=1, finish="stop"):
  return Choice(i, ids, [-0.5 - 0.01 * k for k in range(len(ids))], finish, version, "t",
                {"role": "assistant", "content": "t"})


def scripted_engine(texts):
  tok = et.tokenizer("hermes")
  return et.ScriptedEngine(tok, lambda _, k: texts[min(k, len(texts) - 1)],
                           et.stop_ids(tok, "hermes")[0])


def openai_client(url, session=None, key="unused", **kw):
  headers = {"X-Session-Id": session} if session else {}
  return openai.OpenAI(base_url=url + "/v1", api_key=key, default_headers=headers,
                       max_retries=0, **kw)



def anthropic_client(url, session=None, key="unused", **kw):
  """The official `anthropic` client on the proxy at `url` (it sends the key as x-api-key)."""
  import anthropic
  headers = {"X-Session-Id": session} if session else {}
  return anthropic.Anthropic(base_url=url, api_key=key, default_headers=headers, max_retries=0,
                             **kw)


def tiny_sampler():
  """The embedded JAX sampler on the tests' tiny hermes model (a module fixture's body)."""
  from posttrain_jax.engines.jax_sampler import JaxSampler, JaxSamplerConfig
  from posttrain_jax.models import hf_io
  tok = et.tokenizer("hermes")
  return JaxSampler(hf_io.load_hf_model(et.tiny_dir("hermes")),
                    JaxSamplerConfig(max_prompt_len=256, pad_id=tok.pad_token_id))


def check_one_sample(url, session: str, engine, stop_id: int) -> dict:
  """The session's calls (served by ScriptedEngine `engine`, each continuing the one before)
  rebuild into one sample: the engine's last prompt + what it sampled, no break, every earlier
  prompt + answer a prefix of the next prompt, mask 1 exactly on the sampled spans, each span
  decoding byte-exactly to the text the engine sampled and its stop token. Returns it."""
  import httpx
  got = httpx.get(f"{url}/v1/sessions/{session}/samples").json()
  assert not [k for k in got["stats"] if k.startswith("break/")], got["stats"]
  (s,) = got["samples"]
  ps, rs = engine.prompts, engine.returned
  for p, r, nxt in zip(ps, rs, ps[1:]):
    assert nxt[:len(p) + len(r)] == p + r          # the next prompt reused the sampled ids
  assert s["token_ids"] == ps[-1] + rs[-1]          # trained on exactly what the engine saw
  want = [0] * len(ps[-1]) + [1] * len(rs[-1])
  for p, r in zip(ps, rs):
    want[len(p):len(p) + len(r)] = [1] * len(r)
  assert s["loss_mask"] == want
  tok = et.tokenizer("hermes")
  for p, r, text in zip(ps, rs, engine.texts):
    span = s["token_ids"][len(p):len(p) + len(r)]
    assert tok.decode(span, skip_special_tokens=False, clean_up_tokenization_spaces=False) == (
        text + tok.decode([stop_id], skip_special_tokens=False))
  return s
