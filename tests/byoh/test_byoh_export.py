"""Traces as training samples (byoh/samples_jsonl.py, launch/export_traces.py): sessions recorded
by the real proxy (the openai client as the harness) export to one OpenAI-form line per sample,
token-exact against the proxy's own rebuild; export -> import into a fresh store -> export
writes the same bytes; a malformed line is one error naming its line and field, and nothing
of that file is stored."""
import json
import pathlib
import re
import subprocess
import sys

import httpx
import pytest

from posttrain_jax.byoh.samples_jsonl import import_samples
from posttrain_jax.byoh.server import ProxyConfig
from posttrain_jax.byoh.store import StoreConfig, StoreError, TraceStore
from tests.support import byoh as bt

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODEL = "posttrain_jax"
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Adds.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


def _record(db):
  """Tenant "acme": a tool-using session (graded), and a session forked after its first answer
  (two samples sharing the first call, graded, the second sampled at version 3); tenant "bob":
  a session with feedback text and no grade. Returns the proxy's own /samples of each."""
  texts = [CALL, "5", "Hi.", "More.", "Other."]
  cfg = ProxyConfig(api_keys=(("ka", "acme"), ("kb", "bob")))
  with bt.running(bt.scripted_engine(texts), db, cfg) as (url, proxy):
    tool = bt.openai_client(url, "tool", key="ka")
    msgs = [{"role": "user", "content": "Add 2 and 3."}]
    r = tool.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, max_tokens=40)
    (tc,) = r.choices[0].message.tool_calls
    msgs += [r.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": tc.id, "content": "5"}]
    tool.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, max_tokens=40)
    fork = bt.openai_client(url, "fork", key="ka")
    first = [{"role": "user", "content": "Hello."}]
    a = fork.chat.completions.create(model=MODEL, messages=first, max_tokens=20).choices[0]
    for ask in ("Go on.", "Say more."):
      if ask == "Say more.":
        proxy.engine.version = 3
      fork.chat.completions.create(model=MODEL, max_tokens=20, messages=first + [
          a.message.model_dump(exclude_none=True), {"role": "user", "content": ask}])
    bt.openai_client(url, "text", key="kb").chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=20)
    for key, session, body in [("ka", "tool", {"grade": 1.0}), ("ka", "fork", {"grade": 0.5}),
                               ("kb", "text", {"text": "too short"})]:
      assert httpx.post(f"{url}/v1/sessions/{session}/feedback", json=body,
                        headers={"Authorization": f"Bearer {key}"}).status_code == 200
    return {s: httpx.get(f"{url}/v1/sessions/{s}/samples",
                         headers={"Authorization": f"Bearer {k}"}).json()["samples"]
            for k, s in [("ka", "tool"), ("ka", "fork"), ("kb", "text")]}


def _cli(*args):
  return subprocess.run([sys.executable, str(ROOT / "launch" / "export_traces.py"), *args],
                        capture_output=True, text=True, cwd=ROOT)


def test_export_import_export_is_identical_and_token_exact(tmp_path):
  db = tmp_path / "traces.db"
  served = _record(db)
  out = tmp_path / "a.jsonl"
  r = _cli(f"--db={db}", f"--out={out}")
  assert r.returncode == 0 and "RESULT exported=4" in r.stdout, r.stderr
  lines = [json.loads(x) for x in out.read_text().splitlines()]
  assert [(x["tenant"], x["session"], x["sample_index"]) for x in lines] == [
      ("acme", "fork", 0), ("acme", "fork", 1), ("acme", "tool", 0), ("bob", "text", 0)]
  for x in lines:                              # the proxy's own rebuild, token for token
    s = served[x["session"]][x["sample_index"]]
    assert (x["token_ids"], x["loss_mask"], x["logprobs"], x["versions"]) == (
        s["token_ids"], s["loss_mask"], s["behaviour_logprobs"], s["policy_version"])
  fork0, fork1, tool, text = lines
  assert fork1["loss_mask"][slice(*fork1["spans"][0])] == [0] * (
      fork1["spans"][0][1] - fork1["spans"][0][0])       # the shared first call, trained once
  assert set(fork1["versions"][slice(*fork1["spans"][1])]) == {3}
  assert (fork0["grade"], tool["grade"], text["grade"], text["feedback"]) == (
      0.5, 1.0, None, "too short")
  assert tool["tools"] == TOOLS and tool["messages"][1]["tool_calls"][0]["function"] == {
      "name": "add", "arguments": '{"a": 2, "b": 3}'}
  assert [m["role"] for m in tool["messages"]] == ["user", "assistant", "tool", "assistant"]

  fresh, again = tmp_path / "fresh.db", tmp_path / "b.jsonl"
  r = _cli(f"--db={fresh}", f"--import={out}")
  assert r.returncode == 0 and "RESULT imported_calls=" in r.stdout, r.stderr
  r = _cli(f"--db={fresh}", f"--out={again}")
  assert r.returncode == 0, r.stderr
  assert again.read_bytes() == out.read_bytes()
  r = _cli(f"--db={fresh}", f"--import={out}")            # the sessions are there already
  assert r.returncode != 0 and "a.jsonl:1: field 'session'" in r.stderr


@pytest.mark.parametrize("line,field,change", [
    (2, "versions", lambda x: x.update(versions=x["versions"][:-1])),
    (3, "loss_mask", lambda x: x["loss_mask"].__setitem__(0, 1)),
    (1, "spans[0]", lambda x: x.update(spans=[[5, 2]] + x["spans"][1:])),
    (4, "grade", lambda x: x.update(grade="good")),
    (2, "loss_mask", lambda x: x.update(session="other")),   # its shared call is in no sample
    (2, "grade", lambda x: x.update(grade=0.9)),             # one session, two grades
])
def test_a_malformed_line_names_line_and_field_and_stores_nothing(tmp_path, line, field, change):
  db = tmp_path / "traces.db"
  _record(db)
  src = TraceStore(StoreConfig(path=str(db)))
  from posttrain_jax.byoh.samples_jsonl import export_samples
  good = tmp_path / "a.jsonl"
  export_samples(src, str(good))
  src.close()
  rows = [json.loads(x) for x in good.read_text().splitlines()]
  change(rows[line - 1])
  bad = tmp_path / "bad.jsonl"
  bad.write_text("".join(json.dumps(x) + "\n" for x in rows))
  fresh = TraceStore(StoreConfig(path=str(tmp_path / "fresh.db")))
  with pytest.raises(StoreError, match=rf"bad\.jsonl:{line}: field '{re.escape(field)}'"):
    import_samples(fresh, str(bad))
  assert fresh.tenants() == [] and fresh.feedback("acme") == []   # all or nothing
  fresh.close()
