"""The records of the trace store (store.py) and the validation of imported ones.

A call (`CallRecord`, with its sampled `Choice`s, token-exact), a grade or comment
(`Feedback`), and `parse_record`: one JSON line of an export (`TraceStore.export_jsonl`, schema
version SCHEMA_VERSION) checked field by field before anything is stored -- a bad record is one
StoreError naming its field.
"""
from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, Optional

from posttrain_jax.byoh import json_text

SCHEMA_VERSION = 1
CALL_STATUSES = ("complete", "incomplete", "error", "rejected")


class StoreError(ValueError):
  """A record that cannot be stored or read back; the message names the field (and line)."""


@dataclasses.dataclass
class Choice:
  """One sampled continuation of a call, token-exact."""
  index: int
  token_ids: list[int]
  logprobs: list[float]
  finish_reason: str
  version: int
  text: str = ""                  # the text the client received (content; tool calls apart)
  message: Optional[dict[str, Any]] = None   # the assistant message returned (chat calls)

  def to_json(self) -> dict[str, Any]:
    # Not dataclasses.asdict: its recursive deep copy was half of recording a call's end.
    return {"index": self.index, "token_ids": list(self.token_ids),
            "logprobs": list(self.logprobs), "finish_reason": self.finish_reason,
            "version": self.version, "text": self.text,
            "message": None if self.message is None else copy.deepcopy(self.message)}


@dataclasses.dataclass
class CallRecord:
  """A call as read back: the `calls` row joined with its result (if any)."""
  id: str
  tenant: str
  session: str
  created: float
  kind: str                       # "chat" | "completion"
  request: dict[str, Any]
  messages: Optional[list[dict[str, Any]]]   # the normalised chat (chat calls)
  tools: Optional[list[dict[str, Any]]]
  prompt_text: str
  prompt_ids: list[int]
  parent_call: Optional[str] = None
  parent_choice: Optional[int] = None
  break_reason: Optional[str] = None
  status: str = "incomplete"      # "complete" | "incomplete" | "error" | "rejected"
  reason: Optional[str] = None    # why incomplete / error
  finished: Optional[float] = None
  response: Optional[dict[str, Any]] = None
  choices: list[Choice] = dataclasses.field(default_factory=list)
  latency_s: Optional[float] = None

  def to_json(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d["choices"] = [c.to_json() for c in self.choices]
    return d


@dataclasses.dataclass(frozen=True)
class Feedback:
  id: str
  tenant: str
  session: str
  call_id: Optional[str]
  created: float
  grade: Optional[float]
  rubric: Optional[dict[str, float]]
  text: Optional[str]
  source: str                     # "api" | "grader:<name>" | "import"


_CALL_FIELDS = {f.name: f for f in dataclasses.fields(CallRecord)}
_FEEDBACK_FIELDS = {f.name for f in dataclasses.fields(Feedback)}
_CHOICE_FIELDS = {f.name for f in dataclasses.fields(Choice)}
_KINDS = ("chat", "completion")
_INT32 = 1 << 31                  # prompt ids are stored as int32
_INT64 = 1 << 63                  # SQLite INTEGER


def _is_int(v: Any) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _check_ids(value: Any, field: str) -> None:
  if not isinstance(value, list) or not all(_is_int(v) and 0 <= v < _INT32 for v in value):
    raise StoreError(f"field {field!r} must be a list of token ids (integers in [0, 2**31))")


def _check_logprobs(value: Any, field: str) -> None:
  if not isinstance(value, list) or not all(
      isinstance(v, (int, float)) and not isinstance(v, bool) and v == v for v in value):
    raise StoreError(f"field {field!r} must be a list of numbers")


def _check_str(r: dict, k: str, *, empty: bool = False, null: bool = False) -> None:
  v = r[k]
  if v is None and null:
    return
  if not isinstance(v, str) or (not empty and not v):
    what = "a string" if empty else "a non-empty string"
    raise StoreError(f"field {k!r} must be {what}" + (" or null" if null else ""))


def _check_number(r: dict, k: str, *, null: bool = False) -> None:
  """A finite number (SQLite stores NaN as NULL: a NaN time would be a NULL one)."""
  v = r[k]
  if v is None and null:
    return
  ok = isinstance(v, (int, float)) and not isinstance(v, bool)
  if ok and _is_int(v):
    ok = -_INT64 <= v < _INT64
  if not ok or not math.isfinite(v):
    raise StoreError(f"field {k!r} must be a finite number" + (" or null" if null else ""))


def _check_type(r: dict, k: str, kind: type, what: str, *, null: bool = False) -> None:
  if not (isinstance(r[k], kind) or (null and r[k] is None)):
    raise StoreError(f"field {k!r} must be {what}" + (" or null" if null else ""))


def _parse_feedback(r: dict) -> dict:
  missing = _FEEDBACK_FIELDS - set(r)
  if missing:
    raise StoreError(f"feedback record lacks field {sorted(missing)[0]!r}")
  for k in ("id", "tenant", "session", "source"):
    _check_str(r, k)
  _check_str(r, "call_id", null=True)
  _check_number(r, "created")
  if r["grade"] is not None:
    try:
      _check_number(r, "grade")
    except StoreError:
      raise StoreError("field 'grade' must be a number or null") from None
  rubric = r["rubric"]
  if rubric is not None and not (isinstance(rubric, dict) and all(
      isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
      for v in rubric.values())):
    raise StoreError("field 'rubric' must be an object of criterion -> finite number, or null")
  _check_str(r, "text", empty=True, null=True)
  return r


def _parse_choice(c: Any, i: int) -> None:
  f = f"choices[{i}]"
  if not isinstance(c, dict) or set(c) != _CHOICE_FIELDS:
    raise StoreError(f"field {f!r} must be an object with {sorted(_CHOICE_FIELDS)}")
  for k in ("index", "version"):
    if not _is_int(c[k]) or not 0 <= c[k] < _INT64:
      raise StoreError(f"field '{f}.{k}' must be a non-negative integer")
  _check_ids(c["token_ids"], f"{f}.token_ids")
  _check_logprobs(c["logprobs"], f"{f}.logprobs")
  if len(c["token_ids"]) != len(c["logprobs"]):
    raise StoreError(f"field {f!r}: {len(c['token_ids'])} ids but "
                     f"{len(c['logprobs'])} log-probs")
  for k in ("finish_reason", "text"):
    if not isinstance(c[k], str):
      raise StoreError(f"field '{f}.{k}' must be a string")
  if c["message"] is not None and not isinstance(c["message"], dict):
    raise StoreError(f"field '{f}.message' must be an object or null")


def _parse_call(r: dict) -> dict:
  missing = set(_CALL_FIELDS) - set(r)
  if missing:
    raise StoreError(f"call record lacks field {sorted(missing)[0]!r}")
  for k in ("id", "tenant", "session", "kind"):
    _check_str(r, k)
  if r["kind"] not in _KINDS:
    raise StoreError(f"field 'kind' is {r['kind']!r}; valid: {_KINDS}")
  _check_str(r, "prompt_text", empty=True)
  _check_number(r, "created")
  _check_type(r, "request", dict, "an object")
  _check_type(r, "messages", list, "a list", null=True)
  _check_type(r, "tools", list, "a list", null=True)
  _check_ids(r["prompt_ids"], "prompt_ids")
  for k in ("parent_call", "break_reason", "reason"):
    _check_str(r, k, empty=True, null=True)
  if r["parent_choice"] is not None and not (_is_int(r["parent_choice"]) and
                                             0 <= r["parent_choice"] < _INT64):
    raise StoreError("field 'parent_choice' must be a non-negative integer or null")
  if not isinstance(r["status"], str) or r["status"] not in CALL_STATUSES:
    raise StoreError(f"field 'status' is {r['status']!r}; valid: {CALL_STATUSES}")
  _check_number(r, "finished", null=True)
  _check_number(r, "latency_s", null=True)
  _check_type(r, "response", dict, "an object", null=True)
  if not isinstance(r["choices"], list):
    raise StoreError("field 'choices' must be a list")
  for i, c in enumerate(r["choices"]):
    _parse_choice(c, i)
  if r["finished"] is None:
    # no finish time: no result row is written, so the call reads back as incomplete with
    # nothing sampled; a status or choices saying otherwise would be dropped silently
    if r["status"] != "incomplete":
      raise StoreError(f"field 'finished' is null on a {r['status']} call")
    for k, empty in (("choices", []), ("response", None), ("latency_s", None)):
      if r[k] != empty or (r[k] is not None and empty is None):
        raise StoreError(f"field {k!r} is set on a call without a result (finished is null)")
  return r


def parse_record(line: bytes | str) -> tuple[str, dict]:
  """One exported line, validated (StoreError names the field): every value that reaches a
  SQLite column has that column's type, so the import's transaction cannot fail midway."""
  try:
    r = json_text.loads(line)
  except json_text.JsonTextError as e:
    raise StoreError(str(e)) from None
  if not isinstance(r, dict):
    raise StoreError("a record must be a JSON object")
  version = r.get("schema_version")
  if not _is_int(version) or version != SCHEMA_VERSION:
    raise StoreError(f"field 'schema_version' is {version!r}; this code reads {SCHEMA_VERSION}")
  kind = r.get("type")
  if kind == "feedback":
    return kind, _parse_feedback(r)
  if kind != "call":
    raise StoreError(f"field 'type' is {kind!r}; valid: 'call', 'feedback'")
  return kind, _parse_call(r)
