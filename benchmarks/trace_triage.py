"""Trace triage on planted failure modes: precision and recall of each mode in the report.

A batch of support-agent sessions is recorded through the real proxy (uvicorn, SQLite store) with
the official `openai` client as the harness, exactly as a production agent would call it. What
the *policy* writes is scripted per session (a tiny random model never writes tool calls), and
each session's plan plants failure modes independently:

  tool phase   tool_errors (the harness's order service answers one call with an error),
               repeated_calls (the same lookup 3–4 times), malformed_call (a broken <tool_call>)
  final call   at most one of: refusal, loop (a sentence repeated 6–10 times), truncated
               (max_tokens 8), long (a 60-line answer), engine_error (the policy's engine
               raises: a 503), incomplete (the harness times out and leaves)
  grading      low_grade (grade ≤ 0.2; 80 % of sessions are graded), free-text feedback (40 %)

Distractors that must NOT be flagged are planted too: tool results that mention "error" in
passing, the same tool called with different arguments, "Sorry for the wait", a short "ha ha".
Some refusals are phrased outside the detector's patterns on purpose ("That's not something I'm
able to do"), so refusal recall measures the patterns' reach rather than being 1 by
construction. Then `triage` runs on the store and the report scores every mode against the
plan. Ends with `RESULT sessions=… macro_precision=… macro_recall=… min_recall=…` (macro over
the planted modes) and writes the report, its plot and the curated sets beside `--out`.

    python benchmarks/trace_triage.py [--sessions 300] [--seed 0] [--out FILE.json] [--smoke]

`--smoke`: 12 sessions (8 of the modes planted; seconds, for CI).
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import random
import re
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._meta import run_info, write_result  # noqa: E402

TOOLS = [{"type": "function", "function": {
    "name": "lookup_order", "description": "Looks an order up by id.",
    "parameters": {"type": "object", "properties": {"order_id": {"type": "integer"}},
                   "required": ["order_id"]}}}]
ANSWERS = ["Your order {o} has shipped; it should arrive in {d} days.",
           "Order {o} is on its way and will arrive within {d} days.",
           "I checked order {o}: it left the depot and arrives in {d} days."]
REFUSALS_MATCHED = ["I'm sorry, but I can't help with refunds for order {o}.",
                    "I cannot provide details about order {o}.",
                    "I am unable to process that request for order {o}."]
REFUSALS_UNMATCHED = ["That's not something I'm able to do for order {o}.",
                      "Unfortunately, order {o} is outside what I can handle."]
DISTRACTOR_ANSWERS = ["Sorry for the wait! Order {o} has shipped and arrives in {d} days.",
                      "Ha ha, good question: order {o} arrives in {d} days.",
                      "I can't wait for order {o} to reach you: {d} days to go."]
TOOL_ERRORS = ["Error: order service unavailable (HTTP 503)",
               'Traceback (most recent call last):\n  File "orders.py", line 12, in lookup\n'
               "KeyError: {o}",
               '{{"error": "timeout after 30s"}}',
               "ERROR - connection refused"]
TOOL_OK = '{{"order_id": {o}, "status": "shipped", "total": 31.5, "currency": "USD"}}'
TOOL_DISTRACTORS = ['{{"order_id": {o}, "status": "shipped", "note": "an error in the carrier '
                    'address was corrected"}}',
                    "No errors found for order {o}; status: shipped."]
FEEDBACK = ["The customer wanted the refund in euros.",
            "Should have checked the refund policy before answering.",
            "Answer was correct but the customer wanted the refund faster.",
            "Too long; the customer asked for a one-line status."]
LOOP = "Let me check that order for you. "


def plan_sessions(n: int, seed: int) -> list[dict]:
  """Per session: its planted modes, the policy's replies, and what the harness does."""
  rng = random.Random(seed)
  plans = []
  for i in range(n):
    o, d = rng.randint(100, 999), rng.randint(2, 9)
    modes: set[str] = set()
    if rng.random() < 0.15:
      modes.add("tool_errors")
    if rng.random() < 0.15:
      modes.add("repeated_calls")
    if rng.random() < 0.12:
      modes.add("malformed_call")
    final = rng.choices(["normal", "refusal", "loop", "truncated", "long", "engine_error",
                         "incomplete"], [0.46, 0.1, 0.1, 0.1, 0.08, 0.08, 0.08])[0]
    if final != "normal":
      modes.add(final)
    graded = rng.random() < 0.8
    low = graded and rng.random() < 0.25
    if low:
      modes.add("low_grade")
    call = lambda oid: ('<tool_call>\n' + json.dumps({"name": "lookup_order",
                                                      "arguments": {"order_id": oid}})
                        + "\n</tool_call>")
    steps = []                 # (policy reply, what the harness answers it with)
    if "malformed_call" in modes:
      steps.append((call(o)[:-len("}\n</tool_call>")] + "\n</tool_call>", "retry"))
    if "repeated_calls" in modes:
      steps += [(call(o), "tool")] * rng.randint(3, 4)
    elif rng.random() < 0.3:   # distractor: one tool, different arguments each time
      steps += [(call(o + k), "tool") for k in range(3)]
    else:
      steps.append((call(o), "tool"))
    tool_results = [TOOL_OK] * sum(a == "tool" for _, a in steps)
    if "tool_errors" in modes:
      tool_results[rng.randrange(len(tool_results))] = rng.choice(TOOL_ERRORS)
    elif rng.random() < 0.25:
      tool_results[rng.randrange(len(tool_results))] = rng.choice(TOOL_DISTRACTORS)
    if final == "refusal":
      text = rng.choice(REFUSALS_MATCHED + REFUSALS_UNMATCHED)
    elif final == "loop":
      text = "Sure. " + LOOP * rng.randint(6, 10)
    elif final == "long":
      text = "\n".join(f"Line {k}: parcel {o}-{k} left hub {rng.randint(1, 99)} on day "
                       f"{rng.randint(1, 30)}." for k in range(60))
    elif final == "normal" and rng.random() < 0.3:
      text = rng.choice(DISTRACTOR_ANSWERS)
    else:
      text = rng.choice(ANSWERS)
    steps.append((text.format(o=o, d=d), final))
    plans.append({"session": f"s{i:04d}", "order": o, "modes": sorted(modes), "steps": steps,
                  "tool_results": [r.format(o=o) for r in tool_results],
                  "grade": (rng.choice([0.0, 0.2]) if low else rng.choice([0.7, 0.9, 1.0]))
                  if graded else None,
                  "feedback": rng.choice(FEEDBACK) if rng.random() < 0.4 else None})
  return plans


class PlantedPolicy:
  """The policy behind the proxy: each session's scripted replies, in order (an engine error
  or a stall where the plan says so)."""

  def __init__(self, plans: list[dict]):
    from tests.support import envs as et
    self.tok = et.tokenizer("hermes")
    self.queues = {p["session"]: [s for s in p["steps"]] for p in plans}
    self.engine = et.ScriptedEngine(self.tok, self._script, et.stop_ids(self.tok, "hermes")[0])

  def _script(self, prompt_text: str, k: int) -> str:
    from posttrain_jax.engines.base import EngineError
    session = re.search(r"\[(s\d{4})\]", prompt_text).group(1)
    text, action = self.queues[session].pop(0)
    if action == "engine_error":
      raise EngineError("planted: the policy's engine failed")
    if action == "incomplete":
      time.sleep(0.6)            # the harness gives up after 0.2 s
    return text


def record(plans: list[dict], db_path: str) -> None:
  """Runs every planned session through a real proxy into `db_path`."""
  import httpx
  import openai
  from tests.support import byoh as bt

  policy = PlantedPolicy(plans)
  with bt.running(policy.engine, db_path) as (url, _):
    for p in plans:
      client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                             default_headers={"X-Session-Id": p["session"]})
      messages = [{"role": "system", "content": "You are a support agent. Use the tools."},
                  {"role": "user", "content": f"[{p['session']}] Where is my order "
                                              f"{p['order']}?"}]
      results = list(p["tool_results"])
      for _, action in p["steps"]:
        kw = dict(model="posttrain_jax", messages=messages, tools=TOOLS, tool_choice="auto",
                  max_tokens=8 if action == "truncated" else 4096)
        try:
          if action == "incomplete":
            client.with_options(timeout=0.2).chat.completions.create(**kw)
          else:
            msg = client.chat.completions.create(**kw).choices[0].message
        except (openai.APITimeoutError, openai.InternalServerError, openai.APIStatusError):
          break                  # the harness gives up on this session
        messages.append(msg.model_dump(exclude_none=True, exclude={"refusal"}))
        if action == "retry":
          messages.append({"role": "user", "content": "That did not work; try again."})
        elif action == "tool":
          for tc in msg.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": tc.id, "content": results.pop(0)})
      time.sleep(0.7 if p["steps"][-1][1] == "incomplete" else 0)   # let the stall end
      body = {k: p[k] for k in ("grade", "feedback") if p[k] is not None}
      if "feedback" in body:
        body["text"] = body.pop("feedback")
      if body:
        r = httpx.post(f"{url}/v1/sessions/{p['session']}/feedback", json=body)
        r.raise_for_status()


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--sessions", type=int, default=300)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--out", default="runs/trace_triage.json")
  ap.add_argument("--smoke", action="store_true", help="12 sessions (seconds, for CI)")
  args = ap.parse_args()
  info = run_info(smoke=args.smoke)
  if args.smoke:
    args.sessions = 12
  from posttrain_jax.byoh import triage, triage_report
  from posttrain_jax.byoh.store import StoreConfig, TraceStore

  out = pathlib.Path(args.out)
  report_dir = out.with_suffix("")
  report_dir.mkdir(parents=True, exist_ok=True)
  db = report_dir / "planted.db"
  for suffix in ("", "-wal", "-shm"):
    pathlib.Path(str(db) + suffix).unlink(missing_ok=True)
  plans = plan_sessions(args.sessions, args.seed)
  t0 = time.perf_counter()
  record(plans, str(db))
  t_record = time.perf_counter() - t0
  store = TraceStore(StoreConfig(path=str(db)))
  t0 = time.perf_counter()
  features = triage.store_features(store)
  t_triage = time.perf_counter() - t0
  labels = {("default", p["session"]): set(p["modes"]) for p in plans}
  scores = triage_report.evaluate(features, labels)
  paths = triage_report.write_report(features, report_dir, labels=labels)
  print(f"{'mode':<16}{'planted':>8}{'flagged':>8}{'precision':>10}{'recall':>8}")
  for m, r in scores.items():
    print(f"{m:<16}{r['tp'] + r['fn']:>8}{r['tp'] + r['fp']:>8}{r['precision']:>10.3f}"
          f"{r['recall']:>8.3f}")
  planted = {m: r for m, r in scores.items() if r["tp"] + r["fn"]}
  prec = [r["precision"] for r in planted.values() if not math.isnan(r["precision"])]
  rec = [r["recall"] for r in planted.values()]
  fb_set = {k for k in triage.read_set(report_dir / "sets" / "feedback.jsonl")}
  fb_want = {("default", p["session"]) for p in plans if p["feedback"]}
  result = {"sessions": len(features), "record_s": round(t_record, 2),
            "triage_s": round(t_triage, 3), "scores": scores,
            "macro_precision": sum(prec) / len(prec) if prec else math.nan,
            "macro_recall": sum(rec) / len(rec) if rec else math.nan,
            "min_recall": min(rec, default=math.nan), "feedback_set_exact": fb_set == fb_want,
            "report": [str(p) for p in paths[:2]]}
  write_result(str(out), info, result)
  print(f"recorded {len(plans)} sessions in {t_record:.1f} s; triage {t_triage:.2f} s; "
        f"feedback set exact: {fb_set == fb_want}; report {paths[0]}")
  print(f"RESULT sessions={len(features)} macro_precision={result['macro_precision']:.3f} "
        f"macro_recall={result['macro_recall']:.3f} min_recall={result['min_recall']:.3f}")


if __name__ == "__main__":
  main()
