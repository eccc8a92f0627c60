"""Anthropic's Messages API (`POST /v1/messages`) of the recording proxy, driven by the official
`anthropic` client against a real uvicorn server (tests/support/byoh.py), and one session that
mixes all three chat dialects.

`ScriptedEngine` is the policy where a test needs a model that writes tool calls or a known text;
the embedded JAX sampler on the tiny model where sampling itself is checked.
"""
import json

import anthropic
import httpx
import pytest

from posttrain_jax.byoh.server import ProxyConfig
from tests.support import byoh as bt
from tests.support import envs as et
from tests.support.byoh import anthropic_client, openai_client, scripted_engine

MODEL = "posttrain_jax"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
TOOLS = [{"name": "add", "description": "Adds two integers.", "input_schema": SCHEMA}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "add", "description": "Adds two integers.",
                                                "parameters": SCHEMA}}]
RESPONSES_TOOLS = [{"type": "function", "name": "add", "description": "Adds two integers.",
                    "parameters": SCHEMA}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
VERSION = {"anthropic-version": "2023-06-01"}


def _create(client, stream: bool, **kw):
  """A whole message, or the one `messages.stream` assembles from the events (checking that its
  text events join to the final text)."""
  if not stream:
    return client.messages.create(**kw)
  with client.messages.stream(**kw) as s:
    text = "".join(s.text_stream)
    final = s.get_final_message()
  assert text == "".join(b.text for b in final.content if b.type == "text")
  return final


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_use_round_trip_is_recorded_token_exactly(tmp_path, stream):
  """tool_use out, the assistant content echoed as the client got it and a tool_result back: the
  first prompt is the chat template's render of the equivalent chat, and the session rebuilds
  into one sample of exactly what the engine saw and sampled."""
  engine = scripted_engine([CALL, "The sum is 5."])
  with bt.running(engine, tmp_path / "t.db") as (url, proxy):
    client = anthropic_client(url, "agent-1")
    kw = dict(model=MODEL, max_tokens=64, system="Use the tools.", tools=TOOLS)
    messages = [{"role": "user", "content": "Add 2 and 3."}]
    first = _create(client, stream, messages=messages, **kw)
    (use,) = first.content
    assert (first.stop_reason, use.type, use.name, use.input) == (
        "tool_use", "tool_use", "add", {"a": 2, "b": 3})
    assert (first.usage.input_tokens, first.usage.output_tokens) == (
        len(engine.prompts[0]), len(engine.returned[0]))
    messages += [{"role": "assistant", "content": first.content},
                 {"role": "user", "content": [
                     {"type": "tool_result", "tool_use_id": use.id, "content": "5"}]}]
    second = _create(client, stream, messages=messages, **kw)
    assert (second.stop_reason, second.content[0].text) == ("end_turn", "The sum is 5.")
    a, b = proxy.store.calls("default", "agent-1")
    assert (a.id, b.id, b.parent_call) == (first.id, second.id, first.id)
    tok = et.tokenizer("hermes")
    chat = [{"role": "system", "content": "Use the tools."},
            {"role": "user", "content": "Add 2 and 3."}]
    assert tok.decode(engine.prompts[0], skip_special_tokens=False) == tok.apply_chat_template(
        chat, tools=CHAT_TOOLS, tokenize=False, add_generation_prompt=True)
    assert b.messages[-1] == {"role": "tool", "tool_call_id": use.id, "content": "5"}
    bt.check_one_sample(url, "agent-1", engine, proxy.stop_ids[0])


def test_stop_reasons_and_stop_sequences(tmp_path):
  engine = scripted_engine(["Hello there. STOP here."])
  with bt.running(engine, tmp_path / "t.db") as (url, proxy):
    client = anthropic_client(url, "s")
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Hi."}])
    cut = client.messages.create(max_tokens=64, stop_sequences=["nowhere", "STOP"], **kw)
    assert (cut.stop_reason, cut.stop_sequence, cut.content[0].text) == (
        "stop_sequence", "STOP", "Hello there. ")
    streamed = list(client.messages.create(max_tokens=64, stop_sequences=["STOP"], stream=True,
                                           **kw))
    (delta,) = [e for e in streamed if e.type == "message_delta"]
    assert (delta.delta.stop_reason, delta.delta.stop_sequence) == ("stop_sequence", "STOP")
    assert "".join(e.delta.text for e in streamed if e.type == "content_block_delta") == (
        "Hello there. ")
    short = client.messages.create(max_tokens=2, **kw)
    assert (short.stop_reason, short.usage.output_tokens) == ("max_tokens", 2)
    assert client.messages.create(max_tokens=64, **kw).stop_reason == "end_turn"
    rec = proxy.store.calls("default", "s")[0].choices[0]   # the tokens that wrote "STOP"
    assert proxy.builder.decode(rec.token_ids).startswith("Hello there. STOP")
    assert not proxy.builder.decode(rec.token_ids[:-1]).startswith("Hello there. STOP")


@pytest.fixture(scope="module")
def sampler():
  return bt.tiny_sampler()


def test_a_seeded_stream_samples_what_the_whole_message_did_in_every_dialect(tmp_path, sampler):
  """On the embedded sampler (text streamed while it is sampled): the same seed gives the same
  tokens streamed (raw events) or not, and the same prompt and tokens as the same chat sent as
  Chat Completions and as a Responses call: one chat form, one template."""
  with bt.running(sampler, tmp_path / "t.db") as (url, proxy):
    chat = [{"role": "user", "content": "Compute 12+30."}]
    kw = dict(model=MODEL, messages=chat, max_tokens=12,   # this SDK sends temperature as
              extra_body={"temperature": 1.0, "seed": 5})  # an extra, as older ones sent it
    whole = anthropic_client(url, "whole").messages.create(**kw)
    events = list(anthropic_client(url, "stream").messages.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[:2] == ["message_start", "content_block_start"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == whole.content[0].text and types.count("content_block_delta") >= 1
    assert events[-2].delta.stop_reason == whole.stop_reason
    assert events[-2].usage.output_tokens == whole.usage.output_tokens
    openai_client(url, "chat").chat.completions.create(model=MODEL, messages=chat, max_tokens=12,
                                                       temperature=1.0, seed=5)
    openai_client(url, "responses").responses.create(
        model=MODEL, input=chat, max_output_tokens=12, temperature=1.0, extra_body={"seed": 5})
    recs = [proxy.store.calls("default", s)[0] for s in ("whole", "stream", "chat", "responses")]
    assert [r.status for r in recs] == ["complete"] * 4
    assert all(r.prompt_ids == recs[0].prompt_ids for r in recs)
    assert all(r.choices[0].token_ids == recs[0].choices[0].token_ids for r in recs)
    rec = recs[0].choices[0]
    ids = rec.token_ids[:-1] if rec.finish_reason == "stop" else rec.token_ids
    assert proxy.builder.decode(ids) == whole.content[0].text
    assert whole.stop_reason == ("max_tokens" if rec.finish_reason == "length" else "end_turn")
    assert {**recs[1].response, "id": recs[0].id} == recs[0].response   # streamed == whole
    assert recs[0].response["content"] == [c.model_dump(exclude_none=True) for c in whole.content]


def _events(text: str) -> list[tuple[str, dict]]:
  """(event name, data) of a server-sent event body."""
  out = []
  for block in text.strip().split("\n\n"):
    lines = dict(line.split(": ", 1) for line in block.splitlines())
    out.append((lines["event"], json.loads(lines["data"])))
  return out


def test_a_prompt_the_engine_refuses_is_an_error_in_each_dialect_streamed_or_not(tmp_path,
                                                                                 sampler):
  """The engine's own prompt limit (under the proxy's): a 400 in the dialect's shape, or, once
  a stream has begun, the dialect's error events; each call is recorded as an error."""
  cfg = ProxyConfig(max_prompt_tokens=100_000)
  with bt.running(sampler, tmp_path / "t.db", cfg) as (url, proxy):
    long = "1 + " * 150     # ~458 ids: past the engine's max_prompt_len, within the context
    h = {"X-Session-Id": "long", **VERSION}
    msg = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": long}]}
    resp = {"model": MODEL, "max_output_tokens": 4, "input": long}
    r = httpx.post(url + "/v1/messages", json=msg, headers=h)
    assert (r.status_code, r.json()["error"]["type"]) == (400, "invalid_request_error")
    r = httpx.post(url + "/v1/responses", json=resp, headers=h)
    assert (r.status_code, r.json()["error"]["code"]) == (400, "context_length_exceeded")
    r = httpx.post(url + "/v1/messages", json={**msg, "stream": True}, headers=h)
    (start, _), (name, data) = _events(r.text)
    assert (start, name, data["error"]["type"]) == ("message_start", "error",
                                                    "invalid_request_error")
    r = httpx.post(url + "/v1/responses", json={**resp, "stream": True}, headers=h)
    names = [n for n, _ in _events(r.text)]
    assert names == ["response.created", "response.in_progress", "error", "response.failed"]
    failed = _events(r.text)[-1][1]["response"]
    assert (failed["status"], failed["error"]["code"]) == ("failed", "context_length_exceeded")
    assert [c.status for c in proxy.store.calls("default", "long")] == ["error"] * 4


def _post(url, body=None, raw=None, headers=VERSION):
  r = httpx.post(url + "/v1/messages", json=body, content=raw, headers=headers)
  return r.status_code, r.json()


def test_bad_requests_are_anthropic_4xx_and_record_nothing(tmp_path):
  engine = scripted_engine(["ok"])
  cfg = ProxyConfig(max_request_bytes=20_000, max_tokens_limit=100)
  with bt.running(engine, tmp_path / "t.db", cfg) as (url, proxy):
    good = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}

    def user(*blocks):
      return {**good, "messages": [{"role": "user", "content": list(blocks)}]}
    invalid = "invalid_request_error"
    cases = [
        ({k: v for k, v in good.items() if k != "max_tokens"}, 400, invalid, "max_tokens"),
        ({**good, "max_tokens": 1000}, 400, invalid, "max_tokens"),
        ({**good, "messages": [{"role": "system", "content": "x"}]}, 400, invalid,
         "messages[0].role"),
        (user({"type": "image", "source": {}}), 400, invalid, "messages[0].content[0].type"),
        (user({"type": "tool_result", "content": "5"}), 400, invalid,
         "messages[0].content[0].tool_use_id"),
        ({**good, "messages": [*good["messages"], {"role": "assistant", "content": "The"}]},
         400, invalid, "prefill"),
        ({**good, "messages": []}, 400, invalid, "messages"),
        ({**good, "tools": [{"name": "add"}]}, 400, invalid, "tools[0].input_schema"),
        ({**good, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400,
         invalid, "tools[0].type"),
        ({**good, "temperature": 1.5}, 400, invalid, "temperature"),
        ({**good, "tool_choice": {"type": "any"}}, 400, invalid, "tool_choice"),   # no tools
        ({**good, "tool_choice": {"type": "tool", "name": "mul"}, "tools": TOOLS}, 400, invalid,
         "tool_choice.name"),
        ({**good, "thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, invalid,
         "thinking"),
        ({**good, "stop_sequences": "STOP"}, 400, invalid, "stop_sequences"),
        ({**good, "frobnicate": 1}, 400, invalid, "frobnicate"),
        ({**good, "model": "claude-x"}, 404, "not_found_error", "claude-x"),
        ({**good, "system": "x" * 30_000}, 413, "request_too_large", "limit"),
        ([1, 2], 400, invalid, "JSON object"),
    ]
    for body, status, kind, says in cases:
      got, err = _post(url, body)
      assert (got, err["type"], err["error"]["type"]) == (status, "error", kind), (body, err)
      assert says in err["error"]["message"], (says, err)
    got, err = _post(url, raw=b'{"model": ')
    assert (got, err["error"]["type"]) == (400, invalid) and "JSON" in err["error"]["message"]
    got, err = _post(url, good, headers={})
    assert got == 400 and "anthropic-version" in err["error"]["message"]
    client = anthropic_client(url)
    with pytest.raises(anthropic.BadRequestError, match="tool_choice"):
      client.messages.create(tool_choice={"type": "tool", "name": "mul"}, tools=TOOLS, **good)
    with pytest.raises(anthropic.NotFoundError, match="claude-x"):
      client.messages.create(**{**good, "model": "claude-x"})
    assert proxy.store.calls("default") == [] and engine.calls == 0


def test_keys_and_tenants_across_dialects(tmp_path):
  """x-api-key names the tenant as Bearer does: a wrong or missing key is an Anthropic 401, and
  what one tenant records through /v1/messages no other tenant sees, in any dialect."""
  engine = scripted_engine(["hello"])
  cfg = ProxyConfig(api_keys=(("key-a", "acme"), ("key-b", "bobco")))
  with bt.running(engine, tmp_path / "t.db", cfg) as (url, proxy):
    kw = dict(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.AuthenticationError) as e:
      anthropic_client(url, key="nope").messages.create(**kw)
    assert e.value.body["error"]["type"] == "authentication_error"
    assert _post(url, kw)[0] == 401
    anthropic_client(url, "a-task", key="key-a").messages.create(**kw)
    a, b = {"x-api-key": "key-a"}, {"Authorization": "Bearer key-b"}
    assert [s["id"] for s in httpx.get(url + "/v1/sessions", headers=a).json()["data"]] == [
        "a-task"]
    assert httpx.get(url + "/v1/sessions", headers=b).json()["data"] == []
    assert httpx.get(url + "/v1/sessions/a-task", headers=b).status_code == 404
    with pytest.raises(anthropic.AuthenticationError):   # an OpenAI key sent Anthropic's way
      anthropic_client(url, key="Bearer key-a").messages.create(**kw)
    (call,) = proxy.store.calls("acme", "a-task")
    assert call.id.startswith("msg_") and proxy.store.calls("bobco") == []


def test_one_session_mixes_chat_messages_and_responses(tmp_path):
  """A harness that speaks Chat Completions, then Anthropic's Messages, then the Responses API in
  one session (each call sending the whole conversation in its own dialect): every call
  continues the one before, token for token, into one sample."""
  engine = scripted_engine([CALL, "The sum is 5.", "You are welcome."])
  with bt.running(engine, tmp_path / "t.db") as (url, proxy):
    first = openai_client(url, "mix").chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Use the tools."},
                               {"role": "user", "content": "Add 2 and 3."}],
        tools=CHAT_TOOLS, max_tokens=64)
    (tc,) = first.choices[0].message.tool_calls
    second = anthropic_client(url, "mix").messages.create(
        model=MODEL, max_tokens=64, system="Use the tools.", tools=TOOLS, messages=[
            {"role": "user", "content": "Add 2 and 3."},
            {"role": "assistant", "content": [{"type": "tool_use", "id": tc.id, "name": "add",
                                               "input": json.loads(tc.function.arguments)}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tc.id,
                                          "content": [{"type": "text", "text": "5"}]}]}])
    third = openai_client(url, "mix").responses.create(
        model=MODEL, max_output_tokens=64, instructions="Use the tools.", tools=RESPONSES_TOOLS,
        input=[{"role": "user", "content": "Add 2 and 3."},
               {"type": "function_call", "call_id": tc.id, "name": "add",
                "arguments": tc.function.arguments},
               {"type": "function_call_output", "call_id": tc.id, "output": "5"},
               {"role": "assistant", "content": [{"type": "output_text",
                                                  "text": second.content[0].text}]},
               {"role": "user", "content": [{"type": "input_text", "text": "Thanks."}]}])
    assert third.output_text == "You are welcome."
    calls = proxy.store.calls("default", "mix")
    assert [c.id for c in calls] == [first.id, second.id, third.id]
    assert [c.parent_call for c in calls] == [None, first.id, second.id]
    bt.check_one_sample(url, "mix", engine, proxy.stop_ids[0])



def test_a_tool_result_marked_is_error_is_recorded_and_triaged_as_a_tool_error(tmp_path):
  """`is_error: true` is the harness saying its tool failed: the chat has no field for it, so it
  rides on the stored tool message (never rendered: both prompts are the same tokens) and
  triage counts it though the text ("42") reads as no error; a non-boolean is a 400 naming it."""
  from posttrain_jax.byoh.triage import session_features
  engine = scripted_engine(["Retrying."])
  with bt.running(engine, tmp_path / "t.db") as (url, proxy):
    def call(session, **extra):
      return anthropic_client(url, session).messages.create(
          model=MODEL, max_tokens=16, tools=TOOLS, messages=[
              {"role": "user", "content": "Add 2 and 3."},
              {"role": "assistant", "content": [
                  {"type": "tool_use", "id": "t1", "name": "add", "input": {"a": 2, "b": 3}}]},
              {"role": "user", "content": [
                  {"type": "tool_result", "tool_use_id": "t1", "content": "42", **extra}]}])
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[2\]\.content\[0\]\.is_error"):
      call("bad", is_error="yes")
    call("failed", is_error=True)
    call("fine", is_error=False)
    assert proxy.store.sessions("default") and not proxy.store.calls("default", "bad")
    (failed,), (fine,) = proxy.store.calls("default", "failed"), proxy.store.calls("default", "fine")
    assert failed.messages[-1] == {"role": "tool", "tool_call_id": "t1", "content": "42",
                                   "is_error": True}
    assert fine.messages[-1] == {"role": "tool", "tool_call_id": "t1", "content": "42"}
    assert engine.prompts[0] == engine.prompts[1]
    assert session_features("default", "failed", [failed], []).tool_errors == 1
    assert session_features("default", "fine", [fine], []).tool_errors == 0
