"""The recording proxy behind a real uvicorn server, driven by the official `openai` client.

Two engines stand behind it: the embedded JAX sampler on a tiny model (token exactness,
streaming, n, logprobs, seeds), and, where a test needs a model that writes tool calls (a tiny
random model never does), `ScriptedEngine` as the *policy*: it answers with fixed text as token
ids and records every prompt it was sent, so the rebuilt samples can be compared with what the
engine really saw and returned.
"""
import json
import threading

import httpx
import openai
import pytest

from posttrain_jax.byoh.server import ProxyConfig
from posttrain_jax.engines.jax_sampler import JaxSampler, JaxSamplerConfig
from posttrain_jax.models import hf_io
from tests.support import byoh as bt
from tests.support import envs as et
from tests.support.byoh import openai_client, scripted_engine

MODEL = "posttrain_jax"
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Adds two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}}}}}]
TWO_CALLS = ('<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
             '<tool_call>\n{"name": "add", "arguments": {"a": 4, "b": 5}}\n</tool_call>')






def _streamed(stream):
  """A streamed chat answer reassembled as a harness does: content, tool calls, finish."""
  content, calls, finish = "", {}, None
  for ch in stream:
    for c in ch.choices:
      d = c.delta
      content += d.content or ""
      for tc in d.tool_calls or []:
        slot = calls.setdefault(tc.index, {"id": "", "type": "function",
                                           "function": {"name": "", "arguments": ""}})
        slot["id"] += tc.id or ""
        slot["function"]["name"] += tc.function.name or ""
        slot["function"]["arguments"] += tc.function.arguments or ""
      finish = c.finish_reason or finish
  msg = {"role": "assistant", "content": content or None}
  if calls:
    msg["tool_calls"] = [calls[i] for i in sorted(calls)]
  return msg, finish


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_using_agent_loop_is_recorded_token_exactly(tmp_path, stream):
  """openai client as the harness: parallel tool calls, the assistant turn echoed with
  content None, tool results, a final answer. The rebuilt sample is the engine's last prompt +
  what it sampled, mask 1 exactly on the sampled spans, no break; a harness that then edits
  its history is caught."""
  engine = scripted_engine([TWO_CALLS, "The sums are 5 and 9."])
  with bt.running(engine, tmp_path / "t.db") as (url, proxy):
    client = openai_client(url, "agent-1")
    messages = [{"role": "user", "content": "Add 2+3 and 4+5."}]
    for turn in range(2):
      kw = dict(model=MODEL, messages=messages, tools=TOOLS, tool_choice="auto", max_tokens=256)
      if stream:
        msg, finish = _streamed(client.chat.completions.create(stream=True, **kw))
      else:
        choice = client.chat.completions.create(**kw).choices[0]
        msg, finish = choice.message, choice.finish_reason
      if turn == 0:
        calls = msg["tool_calls"] if stream else msg.tool_calls
        assert finish == "tool_calls" and len(calls) == 2
        assert (msg["content"] if stream else msg.content) is None
        messages.append(msg)            # echoed back as the harness got it (content: None)
        for tc in calls:
          fn = tc["function"] if stream else tc.function
          args = json.loads(fn["arguments"] if stream else fn.arguments)
          messages.append({"role": "tool", "tool_call_id": tc["id"] if stream else tc.id,
                           "content": str(args["a"] + args["b"])})
      else:
        assert finish == "stop"
        assert (msg["content"] if stream else msg.content) == "The sums are 5 and 9."
    samples = httpx.get(f"{url}/v1/sessions/agent-1/samples").json()
    assert not [k for k in samples["stats"] if k.startswith("break/")]
    (s,) = samples["samples"]
    p0, p1 = engine.prompts
    r0, r1 = engine.returned
    assert p1[:len(p0) + len(r0)] == p0 + r0       # the second prompt reused the sampled ids
    assert s["token_ids"] == p1 + r1               # trained on exactly what the engine saw
    want = [0] * len(p0) + [1] * len(r0) + [0] * (len(p1) - len(p0) - len(r0)) + [1] * len(r1)
    assert s["loss_mask"] == want
    sampled_lps = [lp for lp, m in zip(s["behaviour_logprobs"], s["loss_mask"]) if m]
    assert sampled_lps == [-0.01 * (1 + i) for i in range(len(r0))] + [
        -0.01 * (2 + i) for i in range(len(r1))]
    edited = [{"role": "user", "content": "Add 2+3 and 4+6."}, *messages[1:]]
    client.chat.completions.create(model=MODEL, messages=edited, tools=TOOLS, max_tokens=8)
    stats = httpx.get(f"{url}/v1/sessions/agent-1/samples").json()["stats"]
    assert stats["break/history_edited"] == 1 and stats["samples"] == 2


@pytest.fixture(scope="module")
def sampler():
  d = et.tiny_dir("hermes")
  tok = et.tokenizer("hermes")
  return JaxSampler(hf_io.load_hf_model(d), JaxSamplerConfig(max_prompt_len=256,
                                                             pad_id=tok.pad_token_id))


def test_stream_and_not_n_and_logprobs_on_the_embedded_sampler(tmp_path, sampler):
  """Same seed, streamed or not: the same tokens; what the client got is what was recorded;
  n=3 records three choices; the returned log-probs are the recorded behaviour log-probs."""
  with bt.running(sampler, tmp_path / "t.db") as (url, proxy):
    client = openai_client(url, "s")
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Compute 12+30."}],
              max_tokens=10, seed=7, temperature=1.0)
    whole = client.chat.completions.create(logprobs=True, **kw)
    streamed = list(client.chat.completions.create(stream=True,
                                                   stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == whole.choices[0].message.content
    assert streamed[-1].usage.completion_tokens == whole.usage.completion_tokens
    three = client.chat.completions.create(n=3, logprobs=True, **{**kw, "seed": 8})
    calls = proxy.store.calls("default", "s")
    assert [c.status for c in calls] == ["complete"] * 3
    a, b, c = calls
    assert a.choices[0].token_ids == b.choices[0].token_ids      # the seed fixed the tokens
    assert [t.logprob for t in whole.choices[0].logprobs.content] == a.choices[0].logprobs
    assert len(c.choices) == 3 and len(three.choices) == 3
    tok = et.tokenizer("hermes")
    for ch, rec in zip(three.choices, c.choices):
      assert [t.logprob for t in ch.logprobs.content] == rec.logprobs
      body = rec.token_ids[:-1] if rec.finish_reason == "stop" else rec.token_ids
      assert ch.message.content == tok.decode(body, skip_special_tokens=False)
      assert rec.version == 0
    assert c.prompt_ids == a.prompt_ids                          # the same chat, not re-rendered


class _GatedSampler:
  """The embedded sampler whose stream waits after its first chunk until `gate` is set: the
  test sets it only once the client holds streamed text, which a proxy that sends the text
  after decoding could never give it (the wait would run out instead)."""

  def __init__(self, sampler):
    self.inner, self.gate, self.released = sampler, threading.Event(), None
    self.version = sampler.version

  def generate(self, *a, **k):
    return self.inner.generate(*a, **k)

  def stream(self, *a, **k):
    for i, part in enumerate(self.inner.stream(*a, **{**k, "chunk_tokens": 2})):
      if i == 1:
        self.released = self.gate.wait(timeout=20)   # False: nothing reached the client
      yield part


def test_a_stream_sends_text_while_the_engine_still_decodes(tmp_path, sampler):
  gated = _GatedSampler(sampler)
  with bt.running(gated, tmp_path / "t.db") as (url, proxy):
    client = openai_client(url, "s")
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Compute 12+30."}],
              max_tokens=12, seed=3, temperature=1.0)
    whole = client.chat.completions.create(**kw)
    assert whole.choices[0].finish_reason == "length"   # the gate is past the first chunk
    pieces = []
    for chunk in client.chat.completions.create(stream=True, **kw):
      if chunk.choices and chunk.choices[0].delta.content:
        pieces.append(chunk.choices[0].delta.content)
        gated.gate.set()   # text arrived while the engine waits inside its decode
    assert gated.released is True and len(pieces) > 1
    assert "".join(pieces) == whole.choices[0].message.content
    a, b = proxy.store.calls("default", "s")
    assert a.choices[0].token_ids == b.choices[0].token_ids and b.status == "complete"


@pytest.mark.parametrize("stop", [None, ["e"], ["mp", "ro"]])
def test_streamed_text_joins_to_the_whole_answer_with_stop_strings_and_n(tmp_path, sampler,
                                                                         stop):
  """Every choice's streamed pieces join to its whole-answer content, stop strings cut both the
  same way, and nothing past a stop string is ever sent."""
  cut = 0
  with bt.running(sampler, tmp_path / "t.db") as (url, proxy):
    client = openai_client(url, "s")
    for seed in range(4):
      kw = dict(model=MODEL, messages=[{"role": "user", "content": "Compute 12+30."}],
                max_tokens=16, seed=seed, temperature=1.0, n=3, stop=stop)
      whole = client.chat.completions.create(**kw)
      got = {0: "", 1: "", 2: ""}
      for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
          got[c.index] += c.delta.content or ""
      assert [got[i] for i in range(3)] == [c.message.content for c in whole.choices]
      rec = proxy.store.call(whole.id, "default")   # cut by a stop string, not a stop token
      cut += sum(c.finish_reason == "stop" and c.token_ids[-1] not in proxy.stop_ids
                 for c in rec.choices)
      assert not any(s in got[i] for s in stop or () for i in range(3))
    assert proxy.counts["stream_text_mismatch"] == 0
  assert (cut > 0) == bool(stop)   # the tiny model's text does hit these stop strings


def test_stream_text_never_sends_what_a_stop_string_or_stop_token_takes_back():
  """StreamText on a one-character-per-token decode: a stop string split over tokens, a stop
  token, and a multi-byte character still incomplete (U+FFFD) each hold text back; the tokens
  kept are those up to the one that ended the answer, each with its log-prob."""
  from posttrain_jax.byoh.server import StreamText
  dec = lambda ids: "".join("\ufffd" if i == 0 else chr(i) for i in ids)  # noqa: E731
  st = StreamText(dec, stop_ids=(1,))
  ids = [ord(c) for c in "xab"]
  assert st.feed(ids, [-1.0, -2.0, -3.0], ("bc",)) == (
      "xa", [(ord("x"), -1.0), (ord("a"), -2.0), (ord("b"), -3.0)])   # "b" held back
  assert st.feed(ids + [ord("c"), ord("d")], [-1.0, -2.0, -3.0, -4.0, -5.0], ("bc",)) == (
      "", [(ord("c"), -4.0)])          # "c" completes the stop string; "d" is not kept
  assert st.rest("xa") == ""
  st = StreamText(dec, stop_ids=(1,))
  assert st.feed([ord("h"), 0], [-1.0, -2.0], ()) == ("h", [(ord("h"), -1.0), (0, -2.0)])
  assert st.feed([ord("h"), 0, ord("i"), 1], [-1.0, -2.0, -3.0, -4.0], ()) == (
      "", [(ord("i"), -3.0), (1, -4.0)])   # the stop token: kept, its text never sent
  assert st.rest("\ufffdhi") is None and st.rest("h\ufffdi") == "\ufffdi"   # the end sends it


def test_streamed_logprobs_are_the_whole_answers_token_for_token(tmp_path, sampler):
  """With logprobs, a stream's per-token entries joined are the whole answer's (the stop
  token's included), with and without stop strings, held-back text or not."""
  with bt.running(sampler, tmp_path / "t.db") as (url, proxy):
    client = openai_client(url, "s")
    for stop in (None, ["ro"], ["e", "mp"]):
      for seed in range(3):
        kw = dict(model=MODEL, messages=[{"role": "user", "content": "Compute 12+30."}],
                  max_tokens=16, seed=seed, temperature=1.0, n=2, stop=stop, logprobs=True)
        whole = client.chat.completions.create(**kw)
        got = {0: [], 1: []}
        for chunk in client.chat.completions.create(stream=True, **kw):
          for c in chunk.choices:
            if c.logprobs is not None:
              got[c.index] += [(t.token, t.logprob) for t in c.logprobs.content]
        for ch in whole.choices:
          assert got[ch.index] == [(t.token, t.logprob) for t in ch.logprobs.content]


def test_a_prompt_the_engine_cannot_take_is_a_400_streamed_or_not(tmp_path, sampler):
  """The engine's own prompt limit (here under the proxy's) is the client's error, named, in
  both paths: a 400 body, or the stream's error event; the call is recorded as an error. (A
  prompt past the model's context, 1024, is the proxy's 400 before recording: test_byoh_limits.)"""
  with bt.running(sampler, tmp_path / "t.db", ProxyConfig(max_prompt_tokens=100_000)) as (
      url, proxy):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "1 + " * 150}],  # 458 ids
            "max_tokens": 4}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers={"X-Session-Id": "long"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.post(url + "/v1/chat/completions", json={**body, "stream": True},
                   headers={"X-Session-Id": "long"})
    events = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == "context_length_exceeded"
    assert [c.status for c in proxy.store.calls("default", "long")] == ["error", "error"]


def _status(url, path, body=None, headers=None, raw=None):
  r = httpx.post(url + path, json=body, content=raw, headers=headers or {})
  return r.status_code, r.json()


def test_bad_requests_are_openai_4xx_and_record_nothing(tmp_path):
  engine = scripted_engine(["ok"])
  cfg = ProxyConfig(max_request_bytes=20_000, max_prompt_tokens=200, max_tokens_limit=100)
  with bt.running(engine, tmp_path / "t.db", cfg) as (url, proxy):
    client = openai_client(url)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
      client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    good = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    cases = [
        ({**good, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
        ({**good, "temperature": "hot"}, 400, "temperature"),
        ({**good, "max_tokens": 10_000}, 400, "max_tokens"),
        ({**good, "tool_choice": "required"}, 400, "tool_choice"),   # no tools to call
        ({**good, "tool_choice": {"type": "function", "function": {"name": "mul"}},
          "tools": TOOLS}, 400, "tool_choice.function.name"),
        ({**good, "frobnicate": 1}, 400, "frobnicate"),
        ({**good, "n": 0}, 400, "n"),
        ({**good, "messages": [{"role": "user", "content": "word " * 400}]}, 400, "messages"),
        ({**good, "messages": [{"role": "user", "content": "x" * 30_000}]}, 413, None),
        ({"messages": good["messages"]}, 400, "model"),
        ([1, 2], 400, None),
    ]
    for body, status, param in cases:
      got, err = _status(url, "/v1/chat/completions", body)
      assert (got, err["error"]["param"]) == (status, param), (body, err)
      assert err["error"]["message"]
    got, err = _status(url, "/v1/chat/completions", raw=b'{"model": ')
    assert got == 400 and "not valid JSON" in err["error"]["message"]
    got, err = _status(url, "/v1/completions", {"model": MODEL, "prompt": [1, -2]})
    assert got == 400 and err["error"]["param"] == "prompt"
    assert httpx.get(url + "/v1/nowhere").json()["error"]["code"] == "not_found"
    assert proxy.store.calls("default") == [] and engine.calls == 0


def test_keys_tenants_and_session_keys(tmp_path):
  engine = scripted_engine(["hello"])
  cfg = ProxyConfig(api_keys=(("key-a", "acme"), ("key-b", "bobco")))
  with bt.running(engine, tmp_path / "t.db", cfg) as (url, proxy):
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    with pytest.raises(openai.AuthenticationError):
      openai_client(url, key="nope").chat.completions.create(**chat)
    got, err = _status(url, "/v1/chat/completions", chat)      # no key at all
    assert got == 401 and err["error"]["code"] == "invalid_api_key"
    openai_client(url, "a-task", key="key-a").chat.completions.create(**chat)
    a, b = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}
    assert [s["id"] for s in httpx.get(url + "/v1/sessions", headers=a).json()["data"]] == [
        "a-task"]
    assert httpx.get(url + "/v1/sessions", headers=b).json()["data"] == []
    for path in ("/v1/sessions/a-task", "/v1/sessions/a-task/samples"):
      assert httpx.get(url + path, headers=b).status_code == 404
      assert httpx.get(url + path, headers=a).status_code == 200
    assert _status(url, "/v1/sessions/a-task/feedback", {"grade": 1}, b)[0] == 404
    assert httpx.get(url + "/v1/sessions/a-task").status_code == 401
    # a harness that can only set a base URL and a key: a session key groups its calls
    sess = httpx.post(url + "/v1/sessions", headers=a).json()
    only_key = openai_client(url, key=sess["api_key"])
    only_key.chat.completions.create(**chat)
    only_key.chat.completions.create(**chat)
    assert len(proxy.store.calls("acme", sess["id"])) == 2
    assert proxy.store.calls("bobco") == []


def test_feedback_is_idempotent_and_grades_the_samples(tmp_path):
  engine = scripted_engine(["an answer"])
  with bt.running(engine, tmp_path / "t.db") as (url, proxy):
    r = openai_client(url, "task-7").chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "q"}], max_tokens=8)
    fb = {"grade": 0.8, "text": "right, but answer in euros"}
    first = _status(url, "/v1/sessions/task-7/feedback", fb)[1]
    again = _status(url, "/v1/sessions/task-7/feedback", fb)[1]
    assert first["created"] is True and again == {**first, "created": False}
    keyed = {"Idempotency-Key": "grader-run-1"}
    assert _status(url, "/v1/sessions/task-7/feedback", {"grade": 0.3}, keyed)[1]["created"]
    assert not _status(url, "/v1/sessions/task-7/feedback", {"grade": 0.9}, keyed)[1]["created"]
    got, body = _status(url, f"/v1/sessions/task-7/calls/{r.id}/feedback",
                        {"rubric": {"tone": 1.0}, "text": "too curt"})
    assert got == 200 and body["call_id"] == r.id
    assert _status(url, "/v1/sessions/task-7/calls/nope/feedback", {"grade": 1})[0] == 404
    assert _status(url, "/v1/sessions/task-7/feedback", {"grade": "A+"})[0] == 400
    assert _status(url, "/v1/sessions/task-7/feedback", {})[0] == 400
    assert _status(url, "/v1/sessions/nobody/feedback", {"grade": 1})[0] == 404
    assert len(proxy.store.feedback("default", "task-7")) == 3
    (s,) = httpx.get(url + "/v1/sessions/task-7/samples").json()["samples"]
    assert s["reward"] == 0.3                       # the latest session grade
    assert s["feedback"] == "right, but answer in euros\ntoo curt"


def _serve(db, port):
  """launch/serve.py as a user starts it, on the tests' tiny hermes model."""
  import subprocess
  import sys
  import pathlib
  flags = [f"--config.tiny.{k}={v}" for k, v in et.SMALL.items()]
  root = pathlib.Path(__file__).resolve().parents[2]
  return subprocess.Popen(
      [sys.executable, str(root / "launch" / "serve.py"), f"--config.port={port}",
       f"--config.store.path={db}", "--config.max_prompt_tokens=256", *flags],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_ready(proc):
  line = proc.stdout.readline()
  assert line.startswith("serving"), line + proc.stdout.read()


def test_kill_9_mid_stream_keeps_every_completed_call_and_marks_the_cut_one(tmp_path):
  """A proxy killed with SIGKILL while it streams: the completed call is in the store, the cut
  one reads incomplete, the store opens cleanly, and a restarted proxy serves on it, continuing
  the session from what was stored."""
  import signal
  from posttrain_jax.byoh.store import StoreConfig, TraceStore
  db, port = tmp_path / "traces.db", bt.free_port()
  url = f"http://127.0.0.1:{port}"
  proc = _serve(db, port)
  try:
    _wait_ready(proc)
    client = openai_client(url, "long-task")
    first = [{"role": "user", "content": "Compute 1+2."}]
    done = client.chat.completions.create(model=MODEL, messages=first, max_tokens=6)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a lot."}], max_tokens=1000,
        stream=True)                  # 18 prompt tokens + 1000: within the model's 1024
    next(iter(stream))                # the role chunk: the call is recorded and decoding
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
  finally:
    proc.kill()
  store = TraceStore(StoreConfig(path=str(db)))
  calls = store.calls("default", "long-task")
  assert [c.status for c in calls] == ["complete", "incomplete"]
  assert calls[0].id == done.id and calls[0].choices[0].text == done.choices[0].message.content
  assert "stopped mid-call" in calls[1].reason
  store.close()
  proc = _serve(db, port)
  try:
    _wait_ready(proc)
    reply = {"role": "assistant", "content": done.choices[0].message.content}
    openai_client(url, "long-task").chat.completions.create(
        model=MODEL, messages=[*first, reply, {"role": "user", "content": "Again."}],
        max_tokens=4)
    detail = httpx.get(f"{url}/v1/sessions/long-task").json()
    assert [c["status"] for c in detail["calls"]] == ["complete", "incomplete", "complete"]
    assert detail["calls"][2]["parent_call"] == done.id     # history read back from the store
    stats = httpx.get(f"{url}/v1/sessions/long-task/samples").json()["stats"]
    assert stats["incomplete"] == 1 and stats["samples"] == 1
  finally:
    proc.kill()
    proc.wait()


def test_a_batch_grader_job_scores_stored_sessions_once(tmp_path):
  """The harness puts the expected answer in the request metadata; launch/grade_traces.py grades
  the final answers with the numeric grader; a second run stores nothing twice; a session with
  no reference is counted ungradable, not scored 0."""
  import subprocess
  import sys
  import pathlib
  engine = scripted_engine(["The answer is 42.", "It is 41.", "Hmm."])
  db = tmp_path / "t.db"
  with bt.running(engine, db) as (url, proxy):
    for k, meta in enumerate([{"reference": "42"}, {"reference": "42"}, None]):
      openai_client(url, f"job-{k}").chat.completions.create(
          model=MODEL, messages=[{"role": "user", "content": "What is 6*7?"}], max_tokens=16,
          **({"metadata": meta} if meta else {}))
  script = pathlib.Path(__file__).resolve().parents[2] / "launch" / "grade_traces.py"
  runs = [subprocess.run([sys.executable, str(script), f"--store={db}"], capture_output=True,
                         text=True, timeout=120) for _ in range(2)]
  assert runs[0].stdout.strip().splitlines()[-1] == "RESULT graded=2 ungradable=1 skipped=0"
  assert runs[1].stdout.strip().splitlines()[-1] == "RESULT graded=0 ungradable=1 skipped=2"
  from posttrain_jax.byoh.store import StoreConfig, TraceStore
  store = TraceStore(StoreConfig(path=str(db)))
  grades = {f.session: f.grade for f in store.feedback("default")}
  assert grades == {"job-0": 1.0, "job-1": 0.0}
  assert {f.source for f in store.feedback("default")} == {"grader:reference"}
  store.close()
  bad = subprocess.run([sys.executable, str(script), f"--store={tmp_path / 'none.db'}"],
                       capture_output=True, text=True, timeout=120)
  assert bad.returncode == 1 and "no such file" in bad.stderr
