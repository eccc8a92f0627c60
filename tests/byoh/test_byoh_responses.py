"""The Responses API (`POST /v1/responses`) of the recording proxy, driven by the official `openai`
client against a real uvicorn server (tests/support/byoh.py).

`ScriptedEngine` is the policy where a test needs a model that writes tool calls (a tiny random
model never does); the embedded JAX sampler on the tiny model where sampling itself is checked.
"""
import json

import httpx
import openai
import pytest

from posttrain_jax.byoh.server import ProxyConfig
from tests.support import byoh as bt
from tests.support import envs as et
from tests.support.byoh import openai_client, scripted_engine

MODEL = "posttrain_jax"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
TOOLS = [{"type": "function", "name": "add", "description": "Adds two integers.",
          "parameters": SCHEMA}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "add", "description": "Adds two integers.",
                                                "parameters": SCHEMA}}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def _streamed(events) -> openai.types.responses.Response:
  """The final response of a raw event stream, after checking the events build it: numbered in
  order, opened and closed, deltas joining to the final text and arguments."""
  types = [e.type for e in events]
  assert types[:2] == ["response.created", "response.in_progress"]
  assert types[-1] == "response.completed"
  assert [e.sequence_number for e in events] == list(range(len(events)))
  final = events[-1].response
  assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == (
      final.output_text)
  args = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
  assert args == [o.arguments for o in final.output if o.type == "function_call"]
  added = [e.item.id for e in events if e.type == "response.output_item.added"]
  done = [e.item for e in events if e.type == "response.output_item.done"]
  assert added == [d.id for d in done] == [o.id for o in final.output]
  return final


def _create(client, stream: bool, **kw):
  if stream:
    return _streamed(list(client.responses.create(stream=True, **kw)))
  return client.responses.create(**kw)


@pytest.mark.parametrize("stream", [False, True])
def test_a_function_tool_round_trip_is_recorded_token_exactly(tmp_path, stream):
  """function_call out, function_call_output back with previous_response_id (no session header:
  the chained call joins the first one's session): the first prompt is the chat template's
  render of the equivalent chat, and the session rebuilds into one sample of exactly what the
  engine saw and sampled."""
  engine = scripted_engine([CALL, "The sum is 5."])
  with bt.running(engine, tmp_path / "t.db") as (url, proxy):
    client = openai_client(url)
    kw = dict(model=MODEL, tools=TOOLS, instructions="Use the tools.", max_output_tokens=64)
    first = _create(client, stream, input="Add 2 and 3.", **kw)
    (fc,) = first.output
    assert (fc.type, fc.name, json.loads(fc.arguments)) == ("function_call", "add",
                                                            {"a": 2, "b": 3})
    assert (first.usage.input_tokens, first.usage.output_tokens) == (
        len(engine.prompts[0]), len(engine.returned[0]))
    second = _create(client, stream, previous_response_id=first.id, input=[
        {"type": "function_call_output", "call_id": fc.call_id, "output": "5"}], **kw)
    assert second.output_text == "The sum is 5." and second.status == "completed"
    assert second.previous_response_id == first.id
    a, b = proxy.store.calls("default")
    assert (a.id, b.id, b.session, b.parent_call) == (first.id, second.id, a.session, first.id)
    tok = et.tokenizer("hermes")
    chat = [{"role": "system", "content": "Use the tools."},
            {"role": "user", "content": "Add 2 and 3."}]
    assert tok.decode(engine.prompts[0], skip_special_tokens=False) == tok.apply_chat_template(
        chat, tools=CHAT_TOOLS, tokenize=False, add_generation_prompt=True)
    assert b.messages[-2]["tool_calls"][0]["function"]["name"] == "add"
    assert b.messages[-1] == {"role": "tool", "tool_call_id": fc.call_id, "content": "5"}
    bt.check_one_sample(url, a.session, engine, proxy.stop_ids[0])


@pytest.fixture(scope="module")
def sampler():
  return bt.tiny_sampler()


def test_a_seeded_stream_samples_what_the_whole_response_did(tmp_path, sampler):
  """On the embedded sampler (text streamed while it is sampled): the same seed gives the same
  tokens streamed or not, and the same as a Chat Completions call of the same chat; what the
  client got is what was recorded."""
  with bt.running(sampler, tmp_path / "t.db") as (url, proxy):
    kw = dict(model=MODEL, input="Compute 12+30.", max_output_tokens=12, temperature=1.0,
              extra_body={"seed": 5})
    whole = openai_client(url, "whole").responses.create(**kw)
    with openai_client(url, "stream").responses.stream(**kw) as s:
      deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
      final = s.get_final_response()
    assert deltas and "".join(deltas) == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    openai_client(url, "chat").chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": kw["input"]}], max_tokens=12,
        temperature=1.0, seed=5)
    (a,), (b,), (c,) = (proxy.store.calls("default", s) for s in ("whole", "stream", "chat"))
    assert a.prompt_ids == b.prompt_ids == c.prompt_ids
    assert a.choices[0].token_ids == b.choices[0].token_ids == c.choices[0].token_ids
    assert b.status == "complete"
    assert b.response["output"] == final.model_dump(exclude_none=True)["output"]
    rec = a.choices[0]
    ids = rec.token_ids[:-1] if rec.finish_reason == "stop" else rec.token_ids
    assert proxy.builder.decode(ids) == whole.output_text
    assert whole.status == ("incomplete" if rec.finish_reason == "length" else "completed")
    assert whole.usage.input_tokens == len(a.prompt_ids)
    other = openai_client(url, "other").responses.create(**{**kw, "extra_body": {"seed": 6}})
    assert proxy.store.calls("default", "other")[0].choices[0].token_ids != rec.token_ids, (
        other.output_text)


def _post(url, body=None, raw=None, headers=None):
  r = httpx.post(url + "/v1/responses", json=body, content=raw, headers=headers or {})
  return r.status_code, r.json()


def test_bad_requests_are_responses_4xx_and_record_nothing(tmp_path):
  engine = scripted_engine(["ok"])
  cfg = ProxyConfig(max_request_bytes=20_000, max_prompt_tokens=200, max_tokens_limit=100)
  with bt.running(engine, tmp_path / "t.db", cfg) as (url, proxy):
    good = {"model": MODEL, "input": "x"}
    cases = [
        ({**good, "input": [{"role": "robot", "content": "x"}]}, 400, "input[0].role"),
        ({**good, "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": "http://x/y.png"}]}]}, 400,
         "input[0].content[0]"),
        ({**good, "input": [{"type": "reasoning", "summary": []}]}, 400, "input[0].type"),
        ({**good, "input": [{"type": "function_call", "name": "add", "arguments": "{}"}]}, 400,
         "input[0].call_id"),
        ({**good, "input": []}, 400, "input"),
        ({"model": MODEL}, 400, "input"),
        ({**good, "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
        ({**good, "tools": [{"type": "function", "parameters": SCHEMA}]}, 400, "tools[0].name"),
        ({**good, "temperature": "hot"}, 400, "temperature"),
        ({**good, "max_output_tokens": 10_000}, 400, "max_output_tokens"),
        ({**good, "tool_choice": "required"}, 400, "tool_choice"),   # no tools to call
        ({**good, "tool_choice": {"type": "function", "name": "mul"}, "tools": TOOLS}, 400,
         "tool_choice.name"),
        ({**good, "text": {"format": {"type": "json_object"}}}, 400, "text"),
        ({**good, "stream": "yes"}, 400, "stream"),
        ({**good, "frobnicate": 1}, 400, "frobnicate"),
        ({**good, "previous_response_id": 7}, 400, "previous_response_id"),
        ({**good, "previous_response_id": "resp_nope"}, 404, "previous_response_id"),
        ({**good, "model": "gpt-4o"}, 404, "model"),
        ({"input": "x"}, 400, "model"),
        ({**good, "input": "word " * 400}, 400, "messages"),
        ({**good, "input": "x" * 30_000}, 413, None),
        ([1, 2], 400, None),
    ]
    for body, status, param in cases:
      got, err = _post(url, body)
      assert (got, err["error"]["param"]) == (status, param), (body, err)
      assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["message"]
      assert err["error"]["type"] == "invalid_request_error"
    got, err = _post(url, raw=b'{"model": ')
    assert got == 400 and "not valid JSON" in err["error"]["message"]
    client = openai_client(url)
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
      client.responses.create(model=MODEL, input="x", tools=TOOLS,
                              tool_choice={"type": "function", "name": "mul"})
    with pytest.raises(openai.NotFoundError, match="resp_nope"):
      client.responses.create(model=MODEL, input="x", previous_response_id="resp_nope")
    assert proxy.store.calls("default") == [] and engine.calls == 0


def test_keys_tenants_and_stored_responses(tmp_path):
  """A wrong or missing key is a 401; another tenant's response id is a 404 and records
  nothing; store=false responses are recorded but cannot be continued; instructions are not
  carried over to the next response (so its chat, without them, starts a new sample)."""
  engine = scripted_engine(["hello"])
  cfg = ProxyConfig(api_keys=(("key-a", "acme"), ("key-b", "bobco")))
  with bt.running(engine, tmp_path / "t.db", cfg) as (url, proxy):
    kw = dict(model=MODEL, max_output_tokens=8)
    with pytest.raises(openai.AuthenticationError):
      openai_client(url, key="nope").responses.create(input="hi", **kw)
    got, err = _post(url, {"input": "hi", **kw})
    assert got == 401 and err["error"]["type"] == "authentication_error"
    a, b = openai_client(url, key="key-a"), openai_client(url, key="key-b")
    first = a.responses.create(input="hi", instructions="Be brief.", **kw)
    with pytest.raises(openai.NotFoundError):
      b.responses.create(input="more", previous_response_id=first.id, **kw)
    assert proxy.store.calls("bobco") == []
    a.responses.create(input="more", previous_response_id=first.id, **kw)
    private = a.responses.create(input="secret", store=False, **kw)
    with pytest.raises(openai.NotFoundError):
      a.responses.create(input="again", previous_response_id=private.id, **kw)
    chat = a.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "c"}],
                                     max_tokens=4)
    with pytest.raises(openai.NotFoundError):   # a chat completion is not a stored response
      a.responses.create(input="again", previous_response_id=chat.id, **kw)
    c1, c2, c3, _ = proxy.store.calls("acme")
    assert c1.messages[0] == {"role": "system", "content": "Be brief."}
    assert [m["role"] for m in c2.messages] == ["user", "assistant", "user"]
    assert (c2.session, c2.parent_call) == (c1.session, None) and c2.break_reason
    assert c3.id == private.id and c3.status == "complete"
