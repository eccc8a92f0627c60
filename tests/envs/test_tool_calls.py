"""Tool-call parsing per chat format: well-formed calls, every malformed kind, round trips."""
import json

import pytest
from hypothesis import given, settings, strategies as st

from posttrain_jax.envs.tool_calls import MALFORMED_REASONS, ToolCall, parse_turn, render_call


def test_hermes_calls_and_content():
  text = ('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
          '\n<tool_call>{"name": "mul", "arguments": "{\\"a\\": 4}"}</tool_call> done')
  t = parse_turn(text, "hermes", turn=3)
  assert t.content == "Let me add.\n\n done"
  assert [(c.name, c.arguments, c.id) for c in t.tool_calls] == [
      ("add", {"a": 2, "b": 3}, "call_3_0"), ("mul", {"a": 4}, "call_3_1")]
  assert t.malformed == ()
  msg = t.message()
  assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"a": 2, "b": 3}


@pytest.mark.parametrize("text,reason", [
    ('<tool_call>{"name": "add", "arguments": {"a": 2}', "unclosed_tag"),
    ('<tool_call>{"name": "a"}<tool_call>{"name": "b"}</tool_call>', "unclosed_tag"),
    ('oops</tool_call>', "stray_close_tag"),
    ('<tool_call>{"name": "add", "arguments": {"a": 2,}}</tool_call>', "invalid_json"),
    ('<tool_call>["add", 2]</tool_call>', "not_an_object"),
    ('<tool_call>{"arguments": {}}</tool_call>', "no_name"),
    ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', "bad_arguments"),
    ('<tool_call>{"name": "add", "arguments": "{not json"}</tool_call>', "bad_arguments"),
])
def test_hermes_malformed(text, reason):
  t = parse_turn(text, "hermes")
  assert [m.reason for m in t.malformed] == [reason] or reason in [m.reason for m in t.malformed]
  assert all(m.reason in MALFORMED_REASONS for m in t.malformed)


def test_hermes_one_good_one_bad():
  t = parse_turn('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{x}</tool_call>',
                 "hermes")
  assert [c.name for c in t.tool_calls] == ["a"] and [m.reason for m in t.malformed] == [
      "invalid_json"]


def test_llama3_json():
  t = parse_turn('{"name": "add", "parameters": {"a": 1, "b": 2}}', "llama3_json")
  assert [(c.name, c.arguments) for c in t.tool_calls] == [("add", {"a": 1, "b": 2})]
  t = parse_turn('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}'
                 '<|eom_id|>', "llama3_json")
  assert [(c.name, c.arguments) for c in t.tool_calls] == [("a", {}), ("b", {"x": 1})]
  plain = parse_turn("The answer is 3.", "llama3_json")
  assert plain.content == "The answer is 3." and not plain.tool_calls and not plain.malformed
  bad = parse_turn('{"name": "add", "parameters": {"a": 1', "llama3_json")
  assert [m.reason for m in bad.malformed] == ["invalid_json"] and not bad.tool_calls
  trailing = parse_turn('{"name": "a", "parameters": {}} and then', "llama3_json")
  assert [c.name for c in trailing.tool_calls] == ["a"]
  assert [m.reason for m in trailing.malformed] == ["invalid_json"]


_names = st.from_regex(r"[a-z_][a-z0-9_]{0,12}", fullmatch=True)
_json = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c,
                                                                         max_size=3), max_leaves=8)


@settings(max_examples=150, deadline=None)
@given(name=_names, args=st.dictionaries(st.text(max_size=6), _json, max_size=4),
       fmt=st.sampled_from(["hermes", "llama3_json"]))
def test_render_then_parse_round_trips(name, args, fmt):
  t = parse_turn(render_call(ToolCall(name, args), fmt), fmt)
  assert [(c.name, c.arguments) for c in t.tool_calls] == [(name, args)] and not t.malformed


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list('<>/{}[]":,; abtool_call|python') + ["\n"]),
                    max_size=80),
       fmt=st.sampled_from(["hermes", "llama3_json"]))
def test_any_text_parses_without_raising(text, fmt):
  t = parse_turn(text, fmt)
  assert all(isinstance(c.arguments, dict) and c.name for c in t.tool_calls)
  assert all(m.reason in MALFORMED_REASONS for m in t.malformed)
