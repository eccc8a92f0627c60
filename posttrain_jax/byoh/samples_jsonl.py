"""Traces as training samples, one JSON object a line: the standard form out, and back in.

`export_samples` writes every recorded session rebuilt into its samples (rebuild.py), one line
per sample, in OpenAI's chat fine-tuning form plus what RL needs, token-exact:

    {"messages": [... the chat, tool_calls included ...], "tools": [... OpenAI tools ...],
     "token_ids": [...],            the whole sequence the learner trains on
     "loss_mask": [0/1 ...],        1 on the tokens trained in this sample
     "logprobs": [...],             the behaviour log-prob of each sampled token (0.0 elsewhere)
     "versions": [...],             the policy version that sampled it (-1 elsewhere)
     "spans": [[start, end], ...],  each call's sampled tokens, first call first (a span shared
                                    with an earlier sample of the session -- the history before
                                    an n > 1 fork -- is there with loss_mask 0)
     "finish_reason": "stop",       the last call's
     "grade": 1.0 | null, "feedback": "text" | null,   the session's grade and free text
     "tenant": "...", "session": "...", "sample_index": 0}

Sessions are written tenant by tenant, session ids sorted, samples in rebuild order.

`import_samples` reads such a file back as sessions to learn from: each sample's spans become
a chain of calls (a span marked 0 is the earlier sample's call, reused), the last call carrying
the messages, and the grade and feedback one session-level feedback row; rebuilding an imported
session gives the samples of its lines, so export -> import -> export writes the same file.
Every line is checked first (StoreError "FILE:LINE: field 'x' ..."); one bad line and nothing
of the file is stored, nor is anything if a session of it is already in the store.
"""
from __future__ import annotations

import hashlib
import json
import math
import pathlib
import time
from typing import Any, Optional

from posttrain_jax.byoh import json_text
from posttrain_jax.byoh.rebuild import rebuild_session, session_grade, session_feedback_text
from posttrain_jax.byoh.store import StoreError, TraceStore, iter_sessions

_LISTS = ("token_ids", "loss_mask", "logprobs", "versions")


def sample_lines(store: TraceStore, tenant: Optional[str] = None):
  """The export's objects, in order (module docstring)."""
  for t in ([tenant] if tenant else store.tenants()):
    for session, calls in sorted(iter_sessions(store, t)):
      feedback = store.feedback(t, session)
      samples, _ = rebuild_session(session, calls, feedback)
      for s in samples:
        leaf = next(c for c in calls if c.prompt_ids == s.token_ids[:len(c.prompt_ids)]
                    and any(c.prompt_ids + ch.token_ids == s.token_ids for ch in c.choices))
        finish = next(ch.finish_reason for ch in leaf.choices
                      if leaf.prompt_ids + ch.token_ids == s.token_ids)
        yield {"messages": s.messages, "tools": s.tools or [], "token_ids": s.token_ids,
               "loss_mask": s.loss_mask, "logprobs": s.behaviour_logprobs,
               "versions": s.policy_version, "spans": s.metrics["spans"],
               "finish_reason": finish, "grade": session_grade(feedback),
               "feedback": session_feedback_text(feedback), "tenant": t, "session": session,
               "sample_index": s.metrics["sample_index"]}


def export_samples(store: TraceStore, path: str, tenant: Optional[str] = None) -> int:
  """Writes the samples (of `tenant`, or all) to `path`; returns how many. Written beside it
  and renamed: a failed export leaves no half-written file."""
  out = pathlib.Path(path)
  tmp = out.with_name(out.name + ".tmp")
  n = 0
  try:
    with open(tmp, "w") as f:
      for obj in sample_lines(store, tenant):
        f.write(json.dumps(obj) + "\n")
        n += 1
    tmp.replace(out)
  except BaseException:
    tmp.unlink(missing_ok=True)
    raise
  return n


def _int(v: Any) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _check(r: Any) -> dict:
  """One line's object, validated; StoreError names the field."""
  if not isinstance(r, dict):
    raise StoreError("a sample must be a JSON object")
  for k in ("tenant", "session"):
    if not isinstance(r.get(k), str) or not r[k]:
      raise StoreError(f"field {k!r} must be a non-empty string")
  if not isinstance(r.get("messages"), list) or not all(
      isinstance(m, dict) and isinstance(m.get("role"), str) for m in r["messages"]):
    raise StoreError("field 'messages' must be a list of messages (objects with a 'role')")
  if not isinstance(r.get("tools"), list) or not all(isinstance(t, dict) for t in r["tools"]):
    raise StoreError("field 'tools' must be a list of tool objects")
  ids = r.get("token_ids")
  if not isinstance(ids, list) or not all(_int(t) and 0 <= t < 1 << 31 for t in ids):
    raise StoreError("field 'token_ids' must be a list of token ids (integers in [0, 2**31))")
  n = len(ids)
  for k in _LISTS[1:]:
    if not isinstance(r.get(k), list) or len(r[k]) != n:
      raise StoreError(f"field {k!r} must be a list as long as 'token_ids' ({n})")
  if not all(m in (0, 1) and _int(m) for m in r["loss_mask"]):
    raise StoreError("field 'loss_mask' must hold only 0 and 1")
  if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
             for x in r["logprobs"]):
    raise StoreError("field 'logprobs' must hold finite numbers")
  if not all(_int(v) and v >= -1 for v in r["versions"]):
    raise StoreError("field 'versions' must hold integers >= -1")
  spans, end = r.get("spans"), 0
  if not isinstance(spans, list) or not spans:
    raise StoreError("field 'spans' must be a non-empty list of [start, end] pairs")
  inside = [False] * n
  for i, sp in enumerate(spans):
    if not (isinstance(sp, list) and len(sp) == 2 and all(_int(x) for x in sp)
            and end <= sp[0] <= sp[1] <= n):
      raise StoreError(f"field 'spans[{i}]' must be [start, end] with {end} <= start <= end "
                       f"<= {n} (in order, not overlapping)")
    end = sp[1]
    part = range(sp[0], sp[1])
    if len({r["loss_mask"][t] for t in part}) > 1:
      raise StoreError(f"field 'loss_mask' must be all 0 or all 1 over spans[{i}]")
    if any(r["versions"][t] < 0 for t in part) or len({r["versions"][t] for t in part}) > 1:
      raise StoreError(f"field 'versions' must be one version >= 0 over spans[{i}]")
    for t in part:
      inside[t] = True
  if spans[-1][1] != n:
    raise StoreError(f"field 'spans' must end at the end of 'token_ids' ({n})")
  for t in range(n):
    if not inside[t] and (r["loss_mask"][t] or r["versions"][t] != -1 or r["logprobs"][t]):
      field = ("loss_mask" if r["loss_mask"][t] else "versions" if r["versions"][t] != -1
               else "logprobs")
      raise StoreError(f"field {field!r} at token {t}: outside the spans it must be "
                       f"{ {'loss_mask': 0, 'versions': -1, 'logprobs': 0.0}[field] }")
  if any(r["loss_mask"][t] == 0 for t in range(spans[-1][0], n)):
    raise StoreError("field 'loss_mask' must be 1 over the last span (the sample's own call)")
  if not isinstance(r.get("finish_reason"), str):
    raise StoreError("field 'finish_reason' must be a string")
  g = r.get("grade")
  if g is not None and (not isinstance(g, (int, float)) or isinstance(g, bool)
                        or not math.isfinite(g)):
    raise StoreError("field 'grade' must be a finite number or null")
  if r.get("feedback") is not None and not isinstance(r["feedback"], str):
    raise StoreError("field 'feedback' must be a string or null")
  return r


def _id(*parts) -> str:
  return "imp-" + hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:24]


def import_samples(store: TraceStore, path: str) -> int:
  """Stores the samples of `path` as sessions (module docstring); returns how many calls."""
  t0, records, streams = time.time(), [], {}
  seen: dict[tuple[str, str], int] = {}       # session -> its first line
  graded: dict[tuple[str, str], tuple] = {}   # session -> its (grade, feedback)
  with open(path, "rb") as f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        try:
          r = _check(json_text.loads(line))
        except json_text.JsonTextError as e:
          raise StoreError(str(e)) from None
        key = (r["tenant"], r["session"])
        if key not in seen and store.has_session(*key):
          raise StoreError(f"field 'session': {r['session']!r} of tenant {r['tenant']!r} is "
                           f"already in the store")
        if key in seen and (r["grade"], r["feedback"]) != graded[key]:
          field = "grade" if r["grade"] != graded[key][0] else "feedback"
          raise StoreError(f"field {field!r} differs from line {seen[key]}'s, of the same "
                           f"session (a session has one grade and one feedback)")
        seen.setdefault(key, lineno)
        graded.setdefault(key, (r["grade"], r["feedback"]))
        ids, known = r["token_ids"], streams.setdefault(key, set())
        last = len(r["spans"]) - 1
        for i, (s, e) in enumerate(r["spans"]):
          stream = tuple(ids[:e])
          # a span trained in an earlier sample is that sample's call (an empty one: if any)
          shared = r["loss_mask"][s] == 0 if e > s else (i < last and stream in known)
          if shared:
            if stream not in known:
              raise StoreError(f"field 'loss_mask' is 0 over spans[{i}], but no earlier "
                               f"sample of session {r['session']!r} has that call")
            continue
          known.add(stream)
          messages, msg = None, None
          if i == last and r["messages"]:
            messages, msg = r["messages"][:-1], r["messages"][-1]
          choice = {"index": 0, "token_ids": ids[s:e], "logprobs": r["logprobs"][s:e],
                    "finish_reason": r["finish_reason"] if i == last else "stop",
                    "version": r["versions"][s], "text": "", "message": msg}
          created = t0 + 1e-5 * len(records)
          records.append(("call", {
              "id": _id(*key, lineno, i), "tenant": key[0], "session": key[1],
              "created": created, "kind": "chat" if r["messages"] else "completion",
              "request": {"imported_from": str(path)}, "messages": messages,
              "tools": (r["tools"] or None) if i == last else None, "prompt_text": "",
              "prompt_ids": ids[:s], "parent_call": None, "parent_choice": None,
              "break_reason": None, "finished": created, "status": "complete",
              "reason": None, "response": None, "choices": [choice], "latency_s": None}))
        if seen[key] == lineno and (r["grade"] is not None or r["feedback"]):
          records.append(("feedback", {
              "id": _id(*key, "feedback"), "tenant": key[0], "session": key[1], "call_id": None,
              "created": t0, "grade": r["grade"], "rubric": None, "text": r["feedback"],
              "source": "import"}))
      except StoreError as e:
        raise StoreError(f"{path}:{lineno}: {e}; nothing of {path} was stored") from None
  store.insert_records(records, str(path))
  return sum(k == "call" for k, _ in records)
