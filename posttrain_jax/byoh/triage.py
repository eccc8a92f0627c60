"""Trace triage: per-session features, failure modes, and curated training sets.

The manual trace review the field still does by hand, over a store's sessions:

1. **Features** (`session_features`), one `SessionFeatures` per session, read from what the
   proxy recorded (never re-run): call statuses, the assistant's replies (each sampled choice
   once), the tool calls it made and the tool results the harness sent back (each once, by
   `tool_call_id`), finish reasons, sampled token counts, the grade and the free-text feedback.
2. **Failure modes** (`MODES`, a registry of detectors `fn(features, cfg) -> bool`; a session
   may show several). Built in:

     engine_error    a call our engine failed (status "error"): infrastructure, not the policy
     incomplete      a call cut before it ended (client gone, proxy killed)
     tool_errors     ≥ 1 tool result the harness marked as an error (`is_error`, the Messages
                     API's tool_result field) or that reads as one: it starts with "error" /
                     "exception" (after optional punctuation), holds a Python traceback, or is
                     a JSON object with an "error" key (`TriageConfig.tool_error_patterns`)
     malformed_call  a reply to a request with tools whose text holds a tool call that does not
                     parse in any registered format (envs/tool_calls.py), so no call was returned
     repeated_calls  one tool call (same name, same arguments as canonical JSON) made ≥
                     `repeat_min` times in the session
     loop            a reply whose sampled ids end in a block of p ≤ `loop_max_period` ids repeated
                     ≥ `loop_min_repeats` times, covering ≥ `loop_min_share` of the reply; or the
                     same non-empty reply text ≥ `loop_min_repeats` times in the session
     truncated       a reply that stopped at its token limit (finish_reason "length")
     refusal         a reply matching a refusal pattern (`TriageConfig.refusal_patterns`)
     long            sampled tokens > `long_factor` × the batch's median (a batch-relative outlier)
     low_grade       the latest session grade < `low_grade`
3. **Curated sets** (`curated_sets`): "feedback" (sessions with free-text feedback), "graded",
   "clean" (graded, no mode), and one per failure mode; `write_sets` stores each as JSON lines
   of {"tenant", "session"} that `TraceSourceConfig.sessions` reads (`read_set`), so a run can
   train on exactly "the sessions with feedback" or "failure mode X".

The report (markdown + plots, and precision / recall against planted labels) is in
triage_report.py. Patterns are English heuristics: a detector that misses a phrasing shows up
as lost recall in the planted benchmark (benchmarks/trace_triage.py), not as a silent zero.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import pathlib
import re
from typing import Callable, Iterable, Optional, Sequence

import numpy as np

from posttrain_jax.byoh.rebuild import session_feedback_text, session_grade
from posttrain_jax.byoh.store import CallRecord, Feedback, TraceStore
from posttrain_jax.envs.tool_calls import TOOL_FORMATS
from posttrain_jax.errors import UserError
from posttrain_jax.registry import Registry


class TriageError(UserError, ValueError):
  """A triage setting or set file that cannot be used, with the field or line named."""


@dataclasses.dataclass(frozen=True)
class TriageConfig:
  """Thresholds and patterns of the failure-mode detectors (module docstring)."""
  low_grade: float = 0.5             # a session grade below this is a failure
  repeat_min: int = 3                # repeated_calls: the same call this many times
  loop_min_repeats: int = 4          # loop: a block (or a reply text) repeated this many times
  loop_max_period: int = 32          # loop: longest repeated block, in ids
  loop_min_share: float = 0.5        # loop: the repeated suffix covers this share of the reply
  long_factor: float = 4.0           # long: sampled tokens > this × the batch median
  tool_error_patterns: tuple[str, ...] = (
      r"^\W*(error|exception)\b", r"Traceback \(most recent call last\)",
      r"^\s*\{\s*\"error\"\s*:")
  refusal_patterns: tuple[str, ...] = (
      r"\bI(?:'m| am)? (?:sorry|afraid),? (?:but )?I (?:can(?:no|')t|won't|am unable|'m unable)",
      r"\bI (?:can(?:no|')t|won't|am not able to|am unable to|'m unable to) "
      r"(?:help|assist|comply|do that|provide|share|process)",
      r"\bas an AI\b")
  examples: int = 3                  # report: sessions listed per mode

  def __post_init__(self):
    for name, least in (("repeat_min", 2), ("loop_min_repeats", 2), ("loop_max_period", 1)):
      if getattr(self, name) < least:
        raise TriageError(f"TriageConfig.{name} must be ≥ {least}, got {getattr(self, name)}")
    if not 0 < self.loop_min_share <= 1:
      raise TriageError(f"TriageConfig.loop_min_share must be in (0, 1], got {self.loop_min_share}")
    if self.long_factor <= 1:
      raise TriageError(f"TriageConfig.long_factor must be > 1, got {self.long_factor}")
    for name in ("tool_error_patterns", "refusal_patterns"):
      for p in getattr(self, name):
        try:
          re.compile(p)
        except re.error as e:
          raise TriageError(f"TriageConfig.{name}: {p!r} is not a regular expression ({e})") \
              from None


@dataclasses.dataclass
class SessionFeatures:
  """What one session did, as recorded."""
  tenant: str
  session: str
  calls: int = 0
  statuses: dict[str, int] = dataclasses.field(default_factory=dict)   # complete / incomplete / error
  breaks: dict[str, int] = dataclasses.field(default_factory=dict)     # prompt breaks by reason
  replies: int = 0                   # sampled choices
  sampled_tokens: int = 0
  truncated_replies: int = 0         # finish_reason "length"
  tool_calls: int = 0
  tool_results: int = 0
  tool_errors: int = 0
  malformed_calls: int = 0
  max_call_repeats: int = 0          # most times one identical call was made
  repeated_call: Optional[str] = None   # that call, "name(args)"
  loop_replies: int = 0              # replies ending in a repeated block
  max_reply_repeats: int = 0         # most times one identical non-empty reply text was sent
  refusals: int = 0
  grade: Optional[float] = None
  feedback: Optional[str] = None
  modes: tuple[str, ...] = ()        # filled by `triage`

  @property
  def key(self) -> tuple[str, str]:
    return self.tenant, self.session


def repeated_suffix(ids: Sequence[int], max_period: int) -> tuple[int, int]:
  """(period p, repeats k) of the longest-covering periodic suffix of `ids`: the last k·p ids
  are one block of p ids repeated k times (k ≥ 2, p ≤ max_period; the smallest p on ties);
  (0, 0) if none."""
  n, best = len(ids), (0, 0)
  for p in range(1, min(max_period, n // 2) + 1):
    k, end = 1, n
    while end - (k + 1) * p >= 0 and ids[end - (k + 1) * p:end - k * p] == ids[end - p:end]:
      k += 1
    if k >= 2 and k * p > best[0] * best[1]:
      best = (p, k)
  return best


def _reply_text(call: CallRecord, choice) -> str:
  if choice.message is not None and isinstance(choice.message.get("content"), str):
    return choice.message["content"]
  return choice.text or ""


def _malformed(text: str) -> bool:
  return any(TOOL_FORMATS.get(f).parse(text)[2] for f in TOOL_FORMATS.names())


def session_features(tenant: str, session: str, calls: Sequence[CallRecord],
                     feedback: Sequence[Feedback], cfg: TriageConfig = TriageConfig()
                     ) -> SessionFeatures:
  """The features of one session (calls oldest first; its feedback rows)."""
  f = SessionFeatures(tenant, session, calls=len(calls))
  statuses, breaks = collections.Counter(), collections.Counter()
  call_counts, reply_counts = collections.Counter(), collections.Counter()
  seen_results: set = set()
  err = [re.compile(p, re.IGNORECASE) for p in cfg.tool_error_patterns]
  refuse = [re.compile(p, re.IGNORECASE) for p in cfg.refusal_patterns]
  for call in calls:
    statuses[call.status] += 1
    if call.break_reason:
      breaks[call.break_reason] += 1
    for i, m in enumerate(call.messages or []):
      if m.get("role") != "tool":
        continue
      content = m.get("content") if isinstance(m.get("content"), str) else json.dumps(m.get("content"))
      key = (m.get("tool_call_id") or f"#{i}", content)
      if key in seen_results:
        continue
      seen_results.add(key)
      f.tool_results += 1
      f.tool_errors += m.get("is_error") is True or any(p.search(content) for p in err)
    if call.status != "complete":
      continue
    for choice in call.choices:
      f.replies += 1
      f.sampled_tokens += len(choice.token_ids)
      f.truncated_replies += choice.finish_reason == "length"
      text = _reply_text(call, choice)
      tool_calls = (choice.message or {}).get("tool_calls") or []
      for tc in tool_calls:
        fn = tc.get("function", {})
        try:
          args = json.dumps(json.loads(fn.get("arguments") or "{}"), sort_keys=True)
        except (TypeError, json.JSONDecodeError):
          args = str(fn.get("arguments"))
        call_counts[f"{fn.get('name')}({args})"] += 1
      f.tool_calls += len(tool_calls)
      if call.tools and not tool_calls and text and _malformed(text):
        f.malformed_calls += 1
      ids = list(choice.token_ids)
      if choice.finish_reason == "stop" and ids:
        ids = ids[:-1]             # the stop token the engine ended on closes every reply
      p, k = repeated_suffix(ids, cfg.loop_max_period)
      if k >= cfg.loop_min_repeats and p * k >= cfg.loop_min_share * len(ids):
        f.loop_replies += 1
      if text.strip() and not tool_calls:
        reply_counts[text.strip()] += 1
      f.refusals += bool(text) and any(p.search(text) for p in refuse)
  f.statuses, f.breaks = dict(statuses), dict(breaks)
  if call_counts:
    f.repeated_call, f.max_call_repeats = call_counts.most_common(1)[0]
  f.max_reply_repeats = max(reply_counts.values(), default=0)
  f.grade = session_grade(feedback)
  f.feedback = session_feedback_text(feedback)
  return f


ModeFn = Callable[[SessionFeatures, TriageConfig, dict], bool]
MODES: Registry[ModeFn] = Registry("failure mode")
# What each built-in mode says about a session (the report's legend).
MODE_HELP: dict[str, str] = {}


def _mode(name: str, help_text: str):
  def deco(fn: ModeFn) -> ModeFn:
    MODE_HELP[name] = help_text
    return MODES.register(name)(fn)
  return deco


_mode("engine_error", "a call our engine failed (infrastructure)")(
    lambda f, cfg, batch: f.statuses.get("error", 0) > 0)
_mode("incomplete", "a call cut before it ended (client gone, proxy stopped)")(
    lambda f, cfg, batch: f.statuses.get("incomplete", 0) > 0)
_mode("rejected", "an answer drawn again: it missed the request's forced tool_choice")(
    lambda f, cfg, batch: f.statuses.get("rejected", 0) > 0)
_mode("tool_errors", "a tool result that reads as an error")(
    lambda f, cfg, batch: f.tool_errors > 0)
_mode("malformed_call", "a tool call that does not parse")(
    lambda f, cfg, batch: f.malformed_calls > 0)
_mode("repeated_calls", "the same tool call made again and again")(
    lambda f, cfg, batch: f.max_call_repeats >= cfg.repeat_min)
_mode("loop", "a reply repeating itself, or the same reply sent again and again")(
    lambda f, cfg, batch: f.loop_replies > 0 or f.max_reply_repeats >= cfg.loop_min_repeats)
_mode("truncated", "a reply cut at its token limit")(
    lambda f, cfg, batch: f.truncated_replies > 0)
_mode("refusal", "a reply that refuses")(lambda f, cfg, batch: f.refusals > 0)
_mode("long", "far more sampled tokens than the batch's median session")(
    lambda f, cfg, batch: f.sampled_tokens > cfg.long_factor * batch["median_tokens"])
_mode("low_grade", "graded below TriageConfig.low_grade")(
    lambda f, cfg, batch: f.grade is not None and f.grade < cfg.low_grade)


def triage(features: Sequence[SessionFeatures], cfg: TriageConfig = TriageConfig()
           ) -> list[SessionFeatures]:
  """`features` with `modes` set: every registered mode whose detector fires, by name."""
  batch = {"median_tokens": float(np.median([f.sampled_tokens for f in features]))
           if features else 0.0}
  names = MODES.names()
  return [dataclasses.replace(f, modes=tuple(n for n in names if MODES.get(n)(f, cfg, batch)))
          for f in features]


def store_features(store: TraceStore, tenant: Optional[str] = None,
                   cfg: TriageConfig = TriageConfig()) -> list[SessionFeatures]:
  """Triaged features of every session in `store` (one tenant's, when given), oldest first."""
  out = []
  for t in ([tenant] if tenant else store.tenants()):
    fb: dict[str, list[Feedback]] = collections.defaultdict(list)
    for row in store.feedback(t):
      fb[row.session].append(row)
    for s in reversed(store.sessions(t)):
      out.append(session_features(t, s["id"], store.calls(t, s["id"]), fb[s["id"]], cfg))
  return triage(out, cfg)


def curated_sets(features: Iterable[SessionFeatures]) -> dict[str, list[tuple[str, str]]]:
  """Named session sets: feedback, graded, clean, and mode/<name> for every mode seen."""
  sets: dict[str, list] = {"feedback": [], "graded": [], "clean": []}
  for f in features:
    if f.feedback:
      sets["feedback"].append(f.key)
    if f.grade is not None:
      sets["graded"].append(f.key)
      if not f.modes:
        sets["clean"].append(f.key)
    for m in f.modes:
      sets.setdefault(f"mode/{m}", []).append(f.key)
  return sets


def write_sets(sets: dict[str, list[tuple[str, str]]], out_dir: str | pathlib.Path
               ) -> dict[str, pathlib.Path]:
  """out_dir/<name>.jsonl per set ("mode/loop" → mode_loop.jsonl), each written whole."""
  out_dir = pathlib.Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  paths = {}
  for name, keys in sets.items():
    path = out_dir / (name.replace("/", "_") + ".jsonl")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps({"tenant": t, "session": s}) + "\n" for t, s in keys))
    tmp.replace(path)
    paths[name] = path
  return paths


def read_set(path: str | pathlib.Path) -> set[tuple[str, str]]:
  """The (tenant, session) keys of a set file; a missing file or a bad line is a TriageError
  naming it."""
  path = pathlib.Path(path)
  if not path.is_file():
    raise TriageError(f"{path}: no such session set (launch/triage.py writes them)")
  keys = set()
  for lineno, line in enumerate(path.read_text().splitlines(), 1):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
    except json.JSONDecodeError as e:
      raise TriageError(f"{path}:{lineno}: not JSON ({e.msg})") from None
    if (not isinstance(row, dict) or not isinstance(row.get("tenant"), str)
        or not isinstance(row.get("session"), str)):
      raise TriageError(f"{path}:{lineno}: expected {{\"tenant\": str, \"session\": str}}")
    keys.add((row["tenant"], row["session"]))
  return keys
