"""Chat Completions options beyond sampling, through the real `openai` client and a uvicorn proxy:
`tool_choice` "required" / a named function (prefill + drawing again, misses recorded as
"rejected" and never trained), `top_logprobs`, `response_format`, `parallel_tool_calls` false,
and the validation of these and of `stop` / `seed` (each error names its field, nothing recorded).

`ScriptedEngine` plays the policy where a test must force a tool call or its absence (a tiny
random model never writes one); the embedded sampler on the tiny model checks `top_logprobs`
against the sampled tokens' own log-probs.
"""
import json

import httpx
import openai
import pytest

from posttrain_jax.byoh.server import ProxyConfig
from posttrain_jax.byoh.tool_choice import call_prefill
from posttrain_jax.byoh.store import StoreConfig, TraceStore
from posttrain_jax.byoh.triage import store_features
from tests.support import byoh as bt
from tests.support import envs as et
from tests.support.byoh import anthropic_client, openai_client, scripted_engine

MODEL = "posttrain_jax"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
TOOLS = [{"type": "function", "function": {"name": n, "parameters": SCHEMA}}
         for n in ("add", "mul")]
ADD = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
MUL = '<tool_call>\n{"name": "mul", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
ASK = [{"role": "user", "content": "Add 2 and 3."}]
NO_PREFILL = ProxyConfig(tool_choice_prefill=False)


def _calls(url, session):
  """The session's calls as the store has them (status, reason, choices), oldest first."""
  return httpx.get(f"{url}/v1/sessions/{session}").json()["calls"]


def _samples(url, session):
  return httpx.get(f"{url}/v1/sessions/{session}/samples").json()


def _streamed(stream):
  """(content, [(name, arguments)], finish) of a streamed chat answer."""
  content, calls, finish = "", {}, None
  for ch in stream:
    for c in ch.choices:
      content += c.delta.content or ""
      for tc in c.delta.tool_calls or []:
        calls.setdefault(tc.index, [tc.function.name, ""])[1] += tc.function.arguments or ""
      finish = c.finish_reason or finish
  return content, [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice_is_met_by_drawing_again_and_the_miss_is_never_trained(tmp_path,
                                                                                     stream):
  """The first sample answers in prose, the second calls the tool: the client gets the call;
  the prose is kept as a "rejected" call of the session, and the session's only training
  sample is the accepted call's prompt + what it sampled (graded, still only that one)."""
  engine = scripted_engine(["It is 5, no tool needed.", ADD])
  with bt.running(engine, tmp_path / "t.db", NO_PREFILL) as (url, proxy):
    client = openai_client(url, "s")
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=64,
              seed=5)
    if stream:
      content, calls, finish = _streamed(client.chat.completions.create(stream=True, **kw))
    else:
      r = client.chat.completions.create(**kw)
      msg, finish = r.choices[0].message, r.choices[0].finish_reason
      content, calls = msg.content, [(t.function.name, t.function.arguments)
                                     for t in msg.tool_calls]
    assert finish == "tool_calls" and not content
    assert [(n, json.loads(a)) for n, a in calls] == [("add", {"a": 2, "b": 3})]
    assert engine.calls == 2 and engine.prompts[0] == engine.prompts[1]   # a new draw, same prompt
    got = _calls(url, "s")
    assert [c["status"] for c in got] == ["complete", "rejected"]
    assert got[1]["id"] == got[0]["id"] + "-rejected-1" and "no tool call" in got[1]["reason"]
    rejected = proxy.store.call(got[1]["id"])
    assert rejected.choices[0].token_ids == engine.returned[0]      # the miss, token-exact
    assert rejected.prompt_ids == engine.prompts[0]
    httpx.post(f"{url}/v1/sessions/s/feedback", json={"grade": 1.0})
    samples = _samples(url, "s")
    assert samples["stats"]["rejected"] == 1 and samples["stats"]["samples"] == 1
    (s,) = samples["samples"]
    assert s["token_ids"] == engine.prompts[1] + engine.returned[1] and s["reward"] == 1.0
    assert proxy.counts["rejected"] == 1
    (f,) = store_features(proxy.store)     # triage: the model's miss, not an engine error
    assert "rejected" in f.modes and "engine_error" not in f.modes


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_choice_never_met_is_a_422_naming_it_and_nothing_is_trained(tmp_path, stream):
  engine = scripted_engine(["no", "still no", "never"])
  with bt.running(engine, tmp_path / "t.db", NO_PREFILL) as (url, proxy):
    client = openai_client(url, "s")
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=16)
    if stream:
      body = httpx.post(url + "/v1/chat/completions", json={**kw, "stream": True},
                        headers={"X-Session-Id": "s"}).text
      err = [json.loads(line[6:]) for line in body.splitlines()
             if line.startswith("data: {")][-1]["error"]
    else:
      with pytest.raises(openai.UnprocessableEntityError) as e:
        client.chat.completions.create(**kw)
      err = e.value.body
    assert (err["param"], err["code"]) == ("tool_choice", "tool_choice_unsatisfied")
    assert "3 samples" in err["message"] and "tool_choice_retries=2" in err["message"]
    assert engine.calls == 3                       # 1 + tool_choice_retries draws
    got = _calls(url, "s")
    assert [c["status"] for c in got] == ["rejected"] * 3
    assert [c["id"] for c in got[1:]] == [got[0]["id"] + f"-rejected-{k}" for k in (1, 2)]
    assert proxy.store.call(got[0]["id"]).choices[0].token_ids == engine.returned[2]
    httpx.post(f"{url}/v1/sessions/s/feedback", json={"grade": 1.0})
    samples = _samples(url, "s")
    assert samples["samples"] == [] and samples["stats"]["rejected"] == 3


def test_a_call_of_another_function_than_the_named_one_is_a_miss(tmp_path):
  engine = scripted_engine([ADD, MUL])
  with bt.running(engine, tmp_path / "t.db", NO_PREFILL) as (url, proxy):
    r = openai_client(url, "s").chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=64,
        tool_choice={"type": "function", "function": {"name": "mul"}})
    assert [t.function.name for t in r.choices[0].message.tool_calls] == ["mul"]
    complete, rejected = _calls(url, "s")
    assert rejected["status"] == "rejected" and "'add', not 'mul'" in rejected["reason"]
    assert proxy.store.call(rejected["id"]).choices[0].message["tool_calls"][0][
        "function"]["name"] == "add"


def test_a_forced_call_is_prefilled_as_prompt_tokens_and_the_session_stays_token_exact(
    tmp_path):
  """Default config: the assistant turn starts with the call's opening up to the named
  function's arguments key; the engine saw it as prompt, only the arguments on are sampled (and
  trained); the harness's next turn continues the call token-exactly (one sample, no break)."""
  tok = et.tokenizer("hermes")
  prefill = call_prefill("hermes", "mul")
  assert prefill == '<tool_call>\n{"name": "mul", "arguments":'
  assert call_prefill("hermes", None) == '<tool_call>\n{"name":'
  assert call_prefill("llama3_json", "mul") == '{"name": "mul", "parameters":'
  engine = scripted_engine([' {"a": 2, "b": 3}}\n</tool_call>', "It is 6."])
  with bt.running(engine, tmp_path / "t.db") as (url, proxy):
    client = openai_client(url, "s")
    kw = dict(model=MODEL, tools=TOOLS, max_tokens=64)
    r = client.chat.completions.create(
        messages=ASK, tool_choice={"type": "function", "function": {"name": "mul"}}, **kw)
    (tc,) = r.choices[0].message.tool_calls
    assert (tc.function.name, json.loads(tc.function.arguments)) == ("mul", {"a": 2, "b": 3})
    ids = list(tok(prefill, add_special_tokens=False)["input_ids"])
    assert engine.prompts[0][-len(ids):] == ids
    assert r.usage.prompt_tokens == len(engine.prompts[0])
    client.chat.completions.create(messages=[*ASK, r.choices[0].message.model_dump(
        exclude_none=True), {"role": "tool", "tool_call_id": tc.id, "content": "6"}], **kw)
    s = bt.check_one_sample(url, "s", engine, et.stop_ids(tok, "hermes")[0])
    start = len(engine.prompts[0])
    assert s["loss_mask"][start - len(ids):start] == [0] * len(ids)   # the prefill: never trained


def test_parallel_tool_calls_false_cuts_after_the_first_call(tmp_path):
  """Two calls sampled: the client gets the first, the recorded ids are the sampled ones up to
  the end of that call (a prefix, as a stop string cuts), and the next turn continues them."""
  engine = scripted_engine([ADD + "\n" + MUL, "Done."])
  tok = et.tokenizer("hermes")
  with bt.running(engine, tmp_path / "t.db") as (url, proxy):
    client = openai_client(url, "s")
    kw = dict(model=MODEL, tools=TOOLS, max_tokens=256)
    both = openai_client(url, "other").chat.completions.create(messages=ASK, **kw)
    assert len(both.choices[0].message.tool_calls) == 2          # absent: as the model wrote
    engine.calls = 0
    r = client.chat.completions.create(messages=ASK, parallel_tool_calls=False, **kw)
    (tc,) = r.choices[0].message.tool_calls
    assert tc.function.name == "add" and r.choices[0].finish_reason == "tool_calls"
    (call,) = proxy.store.calls("default", "s")
    kept = call.choices[0].token_ids
    sampled = engine.returned[-1]
    assert len(kept) < len(sampled) and sampled[:len(kept)] == kept
    text = tok.decode(kept, skip_special_tokens=False)
    assert text.rstrip().endswith("</tool_call>") and text.count("<tool_call>") == 1
    client.chat.completions.create(messages=[*ASK, r.choices[0].message.model_dump(
        exclude_none=True), {"role": "tool", "tool_call_id": tc.id, "content": "5"}], **kw)
    got = _samples(url, "s")
    assert not [k for k in got["stats"] if k.startswith("break/")]
    (s,) = got["samples"]
    assert s["token_ids"] == engine.prompts[-1] + engine.returned[-1]
    assert engine.prompts[-1][:len(call.prompt_ids) + len(kept)] == call.prompt_ids + kept


def test_forced_tool_choice_in_the_messages_and_responses_dialects(tmp_path):
  """Anthropic's {type: any} / {type: tool} with disable_parallel_tool_use, and the Responses
  API's "required", go through the same drawing again."""
  engine = scripted_engine(["prose", ADD + "\n" + MUL, "prose", MUL])
  tools = [{"name": t["function"]["name"], "input_schema": SCHEMA} for t in TOOLS]
  with bt.running(engine, tmp_path / "t.db", NO_PREFILL) as (url, proxy):
    m = anthropic_client(url, "m").messages.create(
        model=MODEL, max_tokens=256, tools=tools, messages=ASK,
        tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert [(b.type, b.name) for b in m.content] == [("tool_use", "add")]
    r = openai_client(url, "r").responses.create(
        model=MODEL, input="Multiply.", tool_choice={"type": "function", "name": "mul"},
        tools=[{"type": "function", "name": t["function"]["name"], "parameters": SCHEMA}
               for t in TOOLS])
    assert [(o.type, o.name) for o in r.output] == [("function_call", "mul")]
    assert [c["status"] for c in _calls(url, "m")] == ["complete", "rejected"]
    assert [c["status"] for c in _calls(url, "r")] == ["complete", "rejected"]


class _GuidedEngine(et.ScriptedEngine):
  """A scripted policy that declares guided decoding and reports what it was asked for."""
  guided_decoding = True

  def generate(self, prompts, sp, n=1, seed=None):
    self.asked = sp.response_format
    return super().generate(prompts, sp, n, seed)


def test_response_format_is_refused_where_the_engine_cannot_constrain_decoding(tmp_path):
  engine = scripted_engine(['{"a": 1}'])
  kw = dict(model=MODEL, messages=ASK, max_tokens=8)
  fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": SCHEMA}}
  with bt.running(engine, tmp_path / "t.db") as (url, proxy):
    client = openai_client(url, "s")
    for bad in ({"type": "json_object"}, fmt):
      with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(response_format=bad, **kw)
      assert (e.value.body["param"], e.value.body["code"]) == (
          "response_format", "unsupported_parameter")
    assert client.chat.completions.create(response_format={"type": "text"}, **kw).choices
    assert engine.calls == 1
  tok = et.tokenizer("hermes")
  guided = _GuidedEngine(tok, lambda _, k: '{"a": 1}', et.stop_ids(tok, "hermes")[0])
  with bt.running(guided, tmp_path / "g.db") as (url, proxy):
    r = openai_client(url, "s").chat.completions.create(response_format=fmt, **kw)
    assert json.loads(r.choices[0].message.content) == {"a": 1}
    assert json.loads(guided.asked) == fmt


@pytest.fixture(scope="module")
def sampler():
  return bt.tiny_sampler()


def test_top_logprobs_are_the_sampling_distributions_top_k(tmp_path, sampler):
  """Greedy: k alternatives per token, most likely first, the first being the sampled token with
  its log-prob; streamed, the same lists; k = 21 or without logprobs is a 400 naming the field;
  an engine that returns no alternatives refuses the field rather than ignore it."""
  with bt.running(sampler, tmp_path / "t.db") as (url, proxy):
    client = openai_client(url, "s")
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Compute 12+30."}],
              max_tokens=8, temperature=0.0, logprobs=True, top_logprobs=3)
    whole = client.chat.completions.create(**kw)
    content = whole.choices[0].logprobs.content
    assert len(content) == len(proxy.store.call(whole.id).choices[0].token_ids)
    for t in content:
      tops = [x.logprob for x in t.top_logprobs]
      assert len(tops) == 3 and tops == sorted(tops, reverse=True)
      assert (t.top_logprobs[0].token, t.top_logprobs[0].logprob) == (t.token, t.logprob)
    streamed = [(t.token, [(x.token, x.logprob) for x in t.top_logprobs])
                for ch in client.chat.completions.create(stream=True, **kw)
                if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert streamed == [(t.token, [(x.token, x.logprob) for x in t.top_logprobs])
                        for t in content]
    for bad in (dict(top_logprobs=21), dict(logprobs=False, top_logprobs=2)):
      with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**{**kw, **bad})
      assert e.value.body["param"] == "top_logprobs"
  engine = scripted_engine(["ok"])
  with bt.running(engine, tmp_path / "u.db") as (url, proxy):
    with pytest.raises(openai.BadRequestError) as e:
      openai_client(url).chat.completions.create(**kw)
    assert (e.value.body["param"], e.value.body["code"]) == ("top_logprobs",
                                                             "unsupported_parameter")
    assert engine.calls == 0


def test_bad_options_are_400s_naming_their_field_and_record_nothing(tmp_path):
  engine = scripted_engine(["ok"])
  good = {"model": MODEL, "messages": ASK, "max_tokens": 4}
  tools = {**good, "tools": TOOLS}
  cases = [
      ({**tools, "tool_choice": "sometimes"}, "tool_choice"),
      ({**tools, "tool_choice": {"type": "function"}}, "tool_choice.function.name"),
      ({**tools, "tool_choice": {"type": "function", "function": {"name": "div"}}},
       "tool_choice.function.name"),
      ({**good, "tool_choice": {"type": "function", "function": {"name": "add"}}},
       "tool_choice"),
      ({**tools, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
      ({**good, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
      ({**good, "logprobs": True, "top_logprobs": 1.5}, "top_logprobs"),
      ({**good, "response_format": {"type": "xml"}}, "response_format"),
      ({**good, "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
      ({**good, "response_format": {"type": "json_schema", "json_schema": {
          "name": "x", "schema": []}}}, "response_format.json_schema.schema"),
      ({**good, "stop": ""}, "stop"),
      ({**good, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
      ({**good, "stop": ["a", 1]}, "stop"),
      ({**good, "seed": -1}, "seed"),
      ({**good, "seed": "7"}, "seed"),
      ({**good, "seed": 2 ** 63}, "seed"),
  ]
  with bt.running(engine, tmp_path / "t.db") as (url, proxy):
    for body, param in cases:
      r = httpx.post(url + "/v1/chat/completions", json=body)
      assert (r.status_code, r.json()["error"]["param"]) == (400, param), (body, r.json())
    client = openai_client(url, "ok")
    r = client.chat.completions.create(stop=["a", "b", "c", "d"], seed=2 ** 63 - 1,
                                       parallel_tool_calls=True, tool_choice="none",
                                       tools=TOOLS, **{k: good[k] for k in good})
    assert r.choices[0].message.content == "ok" and engine.calls == 1
  store = TraceStore(StoreConfig(path=str(tmp_path / "t.db")))
  assert [c.session for c in store.calls("default")] == ["ok"]
  store.close()
