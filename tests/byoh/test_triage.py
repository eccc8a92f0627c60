"""Trace triage over sessions recorded through the real proxy (uvicorn + SQLite) with the official
`openai` client as the harness; the policy's replies are scripted (benchmarks/trace_triage.py's
`record`), so each session's failure modes are known exactly, distractors included."""
import importlib.util
import json
import math
import pathlib
import random
import subprocess
import sys

import pytest

from posttrain_jax.byoh import triage, triage_report
from posttrain_jax.byoh.store import StoreConfig, TraceStore

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _bench():
  spec = importlib.util.spec_from_file_location("trace_triage", ROOT / "benchmarks" /
                                                "trace_triage.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def _call(oid):
  return '<tool_call>\n' + json.dumps({"name": "lookup_order",
                                       "arguments": {"order_id": oid}}) + "\n</tool_call>"


OK = '{"order_id": 5, "status": "shipped"}'
ANSWER = "Order 5 arrives in 3 days."


def _plan(session, steps, tool_results=(), grade=None, feedback=None):
  n_tools = sum(a == "tool" for _, a in steps)
  return {"session": session, "order": 5, "modes": [], "steps": steps,
          "tool_results": list(tool_results) or [OK] * n_tools, "grade": grade,
          "feedback": feedback}


# (plan, the modes triage must find); "long" is batch-relative: 4× the median session.
CASES = [
    (_plan("s0000", [(_call(5), "tool"), (ANSWER, "normal")], grade=1.0), ()),
    (_plan("s0001", [(_call(5), "tool"), (ANSWER, "normal")],
           ['Traceback (most recent call last):\n  File "x.py"\nKeyError: 5']), ("tool_errors",)),
    (_plan("s0002", [(_call(5), "tool"), (ANSWER, "normal")],      # "error" in passing
           ['{"status": "shipped", "note": "an error in the address was fixed"}'],
           feedback="Fine, but the customer wanted euros."), ()),
    (_plan("s0003", [(_call(5), "tool")] * 3 + [(ANSWER, "normal")]), ("repeated_calls",)),
    (_plan("s0004", [(_call(5 + k), "tool") for k in range(3)] + [(ANSWER, "normal")]), ()),
    (_plan("s0005", [(_call(5)[:-14] + "\n</tool_call>", "retry"), (ANSWER, "normal")]),
     ("malformed_call",)),
    (_plan("s0006", [(_call(5), "tool"), ("Sure. " + "Let me check. " * 8, "loop")]), ("loop",)),
    (_plan("s0007", [(_call(5), "tool"), ("Ha ha, order 5 arrives soon.", "normal")]), ()),
    (_plan("s0008", [(_call(5), "tool"), ("I'm sorry, but I can't help with that.", "r")],
           grade=0.0), ("low_grade", "refusal")),
    (_plan("s0009", [(_call(5), "tool"), ("Sorry for the wait! " + ANSWER, "normal")]), ()),
    (_plan("s0010", [(_call(5), "tool"), (ANSWER * 3, "truncated")]), ("truncated",)),
    (_plan("s0011", [(_call(5), "tool"), ("x", "engine_error")]), ("engine_error",)),
    (_plan("s0012", [(_call(5), "tool"), (ANSWER, "incomplete")]), ("incomplete",)),
    (_plan("s0013", [(_call(5), "tool"), ("\n".join(f"Line {k}: parcel {k * 7} left hub {k}."
                                                    for k in range(40)), "long")]), ("long",)),
]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
  db = tmp_path_factory.mktemp("triage") / "t.db"
  _bench().record([p for p, _ in CASES], str(db))
  store = TraceStore(StoreConfig(path=str(db)))
  yield db, store
  store.close()


def test_every_planted_mode_is_found_and_no_distractor_is_flagged(recorded):
  _, store = recorded
  got = {f.session: f.modes for f in triage.store_features(store)}
  assert got == {p["session"]: tuple(sorted(m)) for p, m in CASES}


def test_features_count_each_recorded_event_once(recorded):
  _, store = recorded
  f = {f.session: f for f in triage.store_features(store)}
  rep = f["s0003"]      # 3 identical lookups: each result is in every later call's history
  assert (rep.calls, rep.tool_calls, rep.tool_results, rep.replies) == (4, 3, 3, 4)
  assert rep.max_call_repeats == 3 and rep.repeated_call == 'lookup_order({"order_id": 5})'
  assert f["s0004"].max_call_repeats == 1 and f["s0004"].tool_calls == 3
  assert f["s0011"].statuses == {"complete": 1, "error": 1}
  assert f["s0012"].statuses == {"complete": 1, "incomplete": 1}
  assert f["s0010"].truncated_replies == 1 and f["s0000"].grade == 1.0
  assert f["s0002"].feedback == "Fine, but the customer wanted euros."
  calls = store.calls("default", "s0000")
  assert rep.sampled_tokens > 0 and f["s0000"].sampled_tokens == sum(
      len(c.token_ids) for call in calls for c in call.choices)


def test_repeated_suffix_matches_a_brute_force_search():
  rng = random.Random(0)
  for _ in range(300):
    ids = [rng.randrange(3) for _ in range(rng.randrange(0, 30))]
    if rng.random() < 0.5:
      block = [rng.randrange(5) for _ in range(rng.randint(1, 4))]
      ids += block * rng.randint(2, 6)
    best = (0, 0)
    for p in range(1, 9):
      for k in range(2, len(ids) // p + 1):
        tail = ids[len(ids) - k * p:]
        if all(tail[i] == tail[i % p] for i in range(len(tail))) and k * p > best[0] * best[1]:
          best = (p, k)
    assert triage.repeated_suffix(ids, 8) == best, ids


def test_evaluate_counts_hits_misses_and_false_alarms():
  f = [triage.SessionFeatures("t", "a", modes=("loop",)),
       triage.SessionFeatures("t", "b", modes=("loop", "refusal")),
       triage.SessionFeatures("t", "c", modes=())]
  labels = {("t", "a"): {"loop"}, ("t", "c"): {"loop", "truncated"}}
  r = triage_report.evaluate(f, labels)
  assert r["loop"] == {"tp": 1, "fp": 1, "fn": 1, "precision": 0.5, "recall": 0.5}
  assert r["refusal"]["precision"] == 0.0 and math.isnan(r["refusal"]["recall"])
  assert math.isnan(r["truncated"]["precision"]) and r["truncated"]["recall"] == 0.0


def test_sets_round_trip_and_a_bad_set_file_names_its_line(tmp_path):
  f = [triage.SessionFeatures("t", "a", grade=1.0, feedback="good"),
       triage.SessionFeatures("t", "b", grade=0.0, modes=("low_grade",)),
       triage.SessionFeatures("u", "c", feedback="wrong currency", modes=("refusal",))]
  sets = triage.curated_sets(f)
  assert sets == {"feedback": [("t", "a"), ("u", "c")], "graded": [("t", "a"), ("t", "b")],
                  "clean": [("t", "a")], "mode/low_grade": [("t", "b")],
                  "mode/refusal": [("u", "c")]}
  paths = triage.write_sets(sets, tmp_path)
  assert paths["mode/refusal"].name == "mode_refusal.jsonl"
  assert triage.read_set(paths["feedback"]) == {("t", "a"), ("u", "c")}
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"tenant": "t", "session": "a"}\n{"tenant": "t"}\n')
  with pytest.raises(triage.TriageError, match=r"bad.jsonl:2: expected"):
    triage.read_set(bad)
  with pytest.raises(triage.TriageError, match="no such session set"):
    triage.read_set(tmp_path / "missing.jsonl")


def test_config_errors_name_the_field():
  with pytest.raises(triage.TriageError, match="TriageConfig.repeat_min"):
    triage.TriageConfig(repeat_min=1)
  with pytest.raises(triage.TriageError, match="TriageConfig.refusal_patterns"):
    triage.TriageConfig(refusal_patterns=("(unclosed",))


def test_cli_writes_the_report_plot_and_sets(recorded, tmp_path):
  db, _ = recorded
  out = tmp_path / "report"
  r = subprocess.run([sys.executable, str(ROOT / "launch" / "triage.py"), f"--store={db}",
                      f"--out={out}"], capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr
  assert r.stdout.strip().splitlines()[-1] == (
      f"RESULT sessions={len(CASES)} flagged={sum(bool(m) for _, m in CASES)} feedback=1")
  md = (out / "triage.md").read_text()
  assert "| `repeated_calls` | 1 | 7.1% |" in md and "euros (1)" in md
  assert (out / "triage.png").read_bytes()[:4] == b"\x89PNG"
  assert triage.read_set(out / "sets" / "mode_loop.jsonl") == {("default", "s0006")}
  assert triage.read_set(out / "sets" / "feedback.jsonl") == {("default", "s0002")}
  missing = subprocess.run([sys.executable, str(ROOT / "launch" / "triage.py"),
                            f"--store={tmp_path / 'none.db'}"], capture_output=True, text=True)
  assert missing.returncode == 1 and missing.stderr.strip() == (
      f"error: --store={tmp_path / 'none.db'}: no such file")
