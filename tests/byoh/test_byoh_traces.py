"""The trace store, the prompt splicer and the trajectory rebuilder, without a server.

Prompts are checked against an independent reference: the chat template rendered whole and
tokenised (what a model whose sampled text the template reproduces would see), and, for a model
that sampled a non-canonical tokenisation, against the exact ids it sampled.
"""
import json
import sqlite3

import pytest

from posttrain_jax.byoh.prompts import PromptBuilder, Turn, normalize_messages
from posttrain_jax.byoh.rebuild import rebuild_session
from posttrain_jax.byoh.store import (Choice, Feedback, StoreConfig, StoreError, TraceStore,
                                      SCHEMA_VERSION)
from posttrain_jax.types import Source, Status
from tests.support import envs as et
from tests.support.byoh import recorded_choice

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Adds.",
                                            "parameters": {"type": "object", "properties": {
                                                "a": {"type": "integer"}}}}}]


@pytest.fixture
def store(tmp_path):
  s = TraceStore(StoreConfig(path=str(tmp_path / "t.db")))
  yield s
  s.close()


def _builder():
  tok = et.tokenizer("hermes")
  return tok, PromptBuilder(tok, et.stop_ids(tok, "hermes"))


def _sampled(tok, text, split="bpe"):
  """Ids a model could have sampled for `text`, ending with its end-of-turn token."""
  eng = et.ScriptedEngine(tok, lambda *_: text, et.stop_ids(tok, "hermes")[0], split=split)
  return eng._ids(text) + [eng.stop]


def _turn(call_id, messages, prompt, ids, message, tools=None):
  return Turn(call_id, "chat", messages, tools, prompt.text, prompt.ids,
              [Choice(0, ids, [-0.1] * len(ids), "stop", 3, "", message)])


def test_a_continued_chat_is_spliced_onto_the_sampled_ids():
  """Turn 2's prompt = turn 1's prompt + its sampled ids + the template's glue. When the model
  sampled the template's own rendering, that equals the whole chat rendered and tokenised."""
  tok, b = _builder()
  chat = normalize_messages([{"role": "user", "content": "add 2 and 3"}])
  p1 = b.chat(chat, TOOLS, [])
  assert p1.parent is None and p1.break_reason is None
  assert p1.ids == b.encode(b.render(chat, TOOLS))
  call = '\n<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>'
  ids = _sampled(tok, call)
  echoed = {"role": "assistant", "content": None, "tool_calls": [  # as the openai client echoes
      {"id": "call_x", "type": "function", "function": {"name": "add", "arguments": '{"a":2}'}}]}
  stored = normalize_messages([{"role": "assistant", "content": None, "tool_calls": [
      {"id": "call_y", "type": "function", "function": {"name": "add",
                                                         "arguments": '{"a": 2}'}}]}])[0]
  history = [_turn("c1", chat, p1, ids, stored, TOOLS)]
  chat2 = normalize_messages([*chat, echoed, {"role": "tool", "tool_call_id": "call_x",
                                                "content": "5"}])
  p2 = b.chat(chat2, TOOLS, history)
  assert p2.parent == ("c1", 0) and p2.break_reason is None
  assert p2.ids[:len(p1.ids) + len(ids)] == p1.ids + ids
  # the reference: the chat with the call as sampled, rendered whole (the template reproduces it)
  as_sampled = [*chat, stored, chat2[-1]]
  assert p2.ids == b.encode(b.render(as_sampled, TOOLS))
  assert p2.text == b.render(as_sampled, TOOLS)
  # the harness re-serialised the arguments ('{"a":2}'): rendering its echo would not be what
  # the model sampled; the splice does not depend on it
  assert b.render(chat2, TOOLS) != p2.text


def test_a_non_canonical_sampled_tokenisation_is_kept_not_re_tokenised():
  tok, b = _builder()
  chat = normalize_messages([{"role": "user", "content": "hi"}])
  p1 = b.chat(chat, None, [])
  ids = _sampled(tok, "hello there", split="bytes")
  assert ids[:-1] != b.encode("hello there")        # the model split it its own way
  reply = {"role": "assistant", "content": "hello there"}
  history = [_turn("c1", chat, p1, ids, reply)]
  chat2 = normalize_messages([*chat, reply, {"role": "user", "content": "more"}])
  p2 = b.chat(chat2, None, history)
  assert p2.parent == ("c1", 0)
  assert p2.ids[len(p1.ids):len(p1.ids) + len(ids)] == ids
  assert p2.ids != b.encode(b.render(chat2))          # a fresh tokenisation would differ
  assert b.decode(p2.ids) == b.render(chat2)           # ... but the text is the same


@pytest.mark.parametrize("edit,reason", [
    (lambda c: [{"role": "system", "content": "be brief"}, *c[1:]], "system_prompt_changed"),
    (lambda c: [c[0], {"role": "user", "content": "edited"}, *c[2:]], "history_edited"),
    (lambda c: [c[0], c[1], {"role": "assistant", "content": "not what you said"}, c[3]],
     "history_edited"),
    (lambda c: [{"role": "user", "content": "a different task"}], "sub_agent"),
    (lambda c: c[:2], "repeated_prompt"),
])
def test_a_chat_that_continues_nothing_starts_over_and_says_why(edit, reason):
  tok, b = _builder()
  chat = normalize_messages([{"role": "system", "content": "you help"},
                             {"role": "user", "content": "hi"}])
  p1 = b.chat(chat, None, [])
  reply = {"role": "assistant", "content": "hello"}
  history = [_turn("c1", chat, p1, _sampled(tok, "hello"), reply)]
  full = chat + [reply, {"role": "user", "content": "more"}]
  edited = normalize_messages(edit(full))
  p = b.chat(edited, None, history)
  assert p.parent is None
  assert p.ids == b.encode(b.render(edited))
  assert p.break_reason == reason


def test_changed_tools_start_over():
  tok, b = _builder()
  chat = normalize_messages([{"role": "user", "content": "hi"}])
  p1 = b.chat(chat, TOOLS, [])
  reply = {"role": "assistant", "content": "hello"}
  history = [_turn("c1", chat, p1, _sampled(tok, "hello"), reply, TOOLS)]
  p = b.chat(normalize_messages([*chat, reply, {"role": "user", "content": "x"}]), None, history)
  assert p.parent is None and p.break_reason == "tools_changed"


def test_messages_are_refused_with_the_field_named():
  from posttrain_jax.byoh.prompts import MessageError
  for bad, param in [([], "messages"), ([{"role": "bot", "content": "x"}], "messages[0].role"),
                     ([{"role": "user", "content": [{"type": "image_url"}]}],
                      "messages[0].content[0]"),
                     ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "",
                                                          "tool_calls": [{"function": {}}]}],
                      "messages[1].tool_calls[0]")]:
    with pytest.raises(MessageError) as e:
      normalize_messages(bad)
    assert e.value.param == param


def _record(store, cid, session, prompt, choices, tenant="t1", status="complete", **kw):
  store.begin_call(call_id=cid, tenant=tenant, session=session, kind="chat",
                   request={"model": "m"}, prompt_text="p", prompt_ids=prompt,
                   messages=[{"role": "user", "content": "x"}], **kw)
  if status:
    store.end_call(cid, status=status, choices=choices, response={"id": cid}, latency_s=0.01)




def test_store_reads_back_what_it_wrote_and_keeps_tenants_apart(store):
  _record(store, "a", "s1", [1, 2, 3], [recorded_choice(0, [4, 5]), recorded_choice(1, [6])])
  _record(store, "b", "s1", [1, 2, 3, 4, 5, 7], [], status=None)          # cut: no result
  _record(store, "c", "s2", [9], [recorded_choice(0, [8])], tenant="t2")
  a = store.call("a")
  assert a.prompt_ids == [1, 2, 3] and [c.token_ids for c in a.choices] == [[4, 5], [6]]
  assert a.choices[0].logprobs == [-0.5, -0.51] and a.status == "complete"
  assert store.call("b").status == "incomplete"
  assert [c.id for c in store.calls("t1", "s1")] == ["a", "b"]
  assert [c.id for c in store.calls("t1", status="complete")] == ["a"]
  assert store.calls("t2", "s1") == [] and store.call("a", tenant="t2") is None
  assert [s["id"] for s in store.sessions("t1")] == ["s1"]
  with pytest.raises(StoreError, match="UNIQUE"):  # append-only: a call ends once
    store.end_call("a", status="complete")
  assert store.add_feedback(Feedback("f1", "t1", "s1", None, 1.0, 0.5, None, "ok", "api"))
  assert not store.add_feedback(Feedback("f1", "t1", "s1", None, 2.0, 0.9, None, "x", "api"))
  assert [f.grade for f in store.feedback("t1", "s1")] == [0.5]


def test_a_choice_as_json_is_its_every_field_copied():
  """Choice.to_json is hand-written (asdict's deep copy was slow): it must stay every field,
  and a change to what it returns must not reach the choice."""
  import dataclasses
  c = Choice(index=1, token_ids=[5, 6], logprobs=[-0.5, -0.25], finish_reason="tool_calls",
             version=3, text="x", message={"role": "assistant", "content": None, "tool_calls": [
                 {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]})
  d = c.to_json()
  assert d == dataclasses.asdict(c)
  d["token_ids"].append(7)
  d["message"]["tool_calls"][0]["function"]["name"] = "g"
  assert c.token_ids == [5, 6] and c.message["tool_calls"][0]["function"]["name"] == "f"


def test_export_then_import_is_identical_and_bad_lines_name_their_field(store, tmp_path):
  _record(store, "a", "s1", [1, 2, 3], [recorded_choice(0, [4, 5])])
  _record(store, "b", "s1", [1, 2, 3, 4, 5, 6], [recorded_choice(0, [7], version=2)], parent_call="a",
          parent_choice=0)
  _record(store, "c", "s1", [1], [], status=None)
  store.add_feedback(Feedback("f1", "t1", "s1", "b", 3.0, None, {"helpful": 1.0}, "fine", "api"))
  path = tmp_path / "x.jsonl"
  assert store.export_jsonl(str(path)) == 4
  lines = path.read_text().splitlines()
  bad = dict(json.loads(lines[0]), id="z", prompt_ids=[1, "2"])
  lines += ["{not json", json.dumps(bad), json.dumps({**json.loads(lines[0]), "id": "y",
                                                       "schema_version": 99})]
  path.write_text("\n".join(lines) + "\n")
  other = TraceStore(StoreConfig(path=str(tmp_path / "o.db")))
  stored, errors = other.import_jsonl(str(path))
  assert stored == 4 and len(errors) == 3
  assert errors[0].startswith(f"{path}:5: not JSON")
  assert "prompt_ids" in errors[1] and f"{path}:6:" in errors[1]
  assert "schema_version" in errors[2]
  for cid in "abc":
    assert other.call(cid).to_json() == store.call(cid).to_json()
  assert other.feedback("t1") == store.feedback("t1")
  assert other.import_jsonl(str(path))[0] == 0       # importing again adds nothing
  other.close()


def test_a_store_from_a_newer_schema_is_refused(tmp_path):
  db = sqlite3.connect(str(tmp_path / "n.db"))
  db.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
  db.close()
  with pytest.raises(StoreError, match="schema version"):
    TraceStore(StoreConfig(path=str(tmp_path / "n.db")))


def test_rebuild_merges_by_token_prefix_and_trains_each_sampled_token_once(store):
  """a (n=2: choices A0, A1) -> b continues A1 -> c continues b; d is a sub-agent; e was cut;
  f continues A1 again (a retry of b). Samples: [A0], [d], [A1 b c], [A1 f], A1's span trained
  in the first of them only."""
  _record(store, "a", "s", [1, 2], [recorded_choice(0, [3, 4], 1), recorded_choice(1, [5, 6], 1)])
  _record(store, "b", "s", [1, 2, 5, 6, 7], [recorded_choice(0, [8], 2)])
  _record(store, "d", "s", [20, 21], [recorded_choice(0, [22], 2)], break_reason="sub_agent")
  _record(store, "c", "s", [1, 2, 5, 6, 7, 8, 9, 9], [recorded_choice(0, [10, 11], 3, "length")])
  _record(store, "e", "s", [1, 2, 5, 6, 7, 8, 9, 9, 10, 11, 12], [], status=None)
  _record(store, "f", "s", [1, 2, 5, 6, 99], [recorded_choice(0, [14], 3)])
  store.add_feedback(Feedback("g1", "t1", "s", None, 1.0, 0.25, None, "too slow", "api"))
  store.add_feedback(Feedback("g2", "t1", "s", None, 2.0, 0.75, None, None, "api"))
  store.add_feedback(Feedback("g3", "t1", "s", "b", 3.0, 0.0, None, "wrong tool", "api"))
  trajs, stats = rebuild_session("s", store.calls("t1", "s"), store.feedback("t1", "s"))
  by_ids = {tuple(t.token_ids): t for t in trajs}
  assert set(by_ids) == {(1, 2, 3, 4), (1, 2, 5, 6, 7, 8, 9, 9, 10, 11), (20, 21, 22),
                         (1, 2, 5, 6, 99, 14)}
  long = by_ids[(1, 2, 5, 6, 7, 8, 9, 9, 10, 11)]
  assert long.loss_mask == [0, 0, 1, 1, 0, 1, 0, 0, 1, 1]
  assert long.policy_version == [-1, -1, 1, 1, -1, 2, -1, -1, 3, 3]
  assert long.behaviour_logprobs[2:4] == [-0.5, -0.51] and long.behaviour_logprobs[8] == -0.5
  assert long.status is Status.TRUNCATED and long.source is Source.BYOH
  assert by_ids[(1, 2, 3, 4)].loss_mask == [0, 0, 1, 1]
  assert by_ids[(1, 2, 5, 6, 99, 14)].loss_mask == [0, 0, 0, 0, 0, 1]   # A1 trained in c's
  assert {t.reward for t in trajs} == {0.75}                  # the latest session grade
  assert {t.feedback for t in trajs} == {"too slow\nwrong tool"}
  assert stats["samples"] == 4 and stats["incomplete"] == 1 and stats["break/sub_agent"] == 1
  assert stats["sampled_tokens"] == sum(sum(t.loss_mask) for t in trajs) == 2 + 1 + 5 + 1
