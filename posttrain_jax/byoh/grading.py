"""Batch grader jobs: score stored sessions with a registered trace grader, as feedback rows.

A trace grader reads a session's calls (store.CallRecord, oldest first) and returns a `Verdict`
(a grade, a rubric and/or free text), or None when it cannot judge the session (counted as
"ungradable", never scored 0: a session we cannot grade is not a failure of the policy).

    @register_trace_grader("name", ConfigClass)
    def grade(calls, cfg) -> Optional[Verdict]: ...

`grade_sessions` runs one over a tenant's sessions (or every tenant's) and stores each verdict as
feedback with source "grader:<name>" and id "grader:<name>:<tenant>/<session>", so running a
job twice stores nothing twice; `regrade=True` re-scores sessions that grew since.

Built in: "reference" — the harness put the expected answer in the request's OpenAI
`metadata` ({"reference": "42"}) on any call of the session; the last complete call's first
answer is graded against it with a task-bank grader (graders/, "numeric" by default).
"""
from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Callable, Optional, Sequence

from posttrain_jax.byoh.store import CallRecord, Feedback, TraceStore
from posttrain_jax.graders import make_grader
from posttrain_jax.tasks.task import Task
from posttrain_jax.registry import Registry


@dataclasses.dataclass(frozen=True)
class Verdict:
  grade: Optional[float] = None
  rubric: Optional[dict[str, float]] = None
  text: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class TraceGraderSpec:
  name: str
  fn: Callable[[Sequence[CallRecord], Any], Optional[Verdict]]
  config_cls: type


TRACE_GRADERS: Registry[TraceGraderSpec] = Registry("trace grader")


def register_trace_grader(name: str, config_cls: type):
  def deco(fn):
    TRACE_GRADERS.register(name)(TraceGraderSpec(name, fn, config_cls))
    return fn
  return deco


def grade_sessions(store: TraceStore, name: str, cfg: Any = None, *,
                   tenant: Optional[str] = None, regrade: bool = False) -> collections.Counter:
  """Runs trace grader `name` over stored sessions; counts graded / ungradable / skipped."""
  spec = TRACE_GRADERS.get(name)
  cfg = spec.config_cls() if cfg is None else cfg
  source = f"grader:{name}"
  counts: collections.Counter = collections.Counter()
  for t in ([tenant] if tenant else store.tenants()):
    graded_sessions = {f.session for f in store.feedback(t) if f.source == source}
    for s in store.sessions(t):
      if s["id"] in graded_sessions and not regrade:
        counts["skipped"] += 1
        continue
      calls = [c for c in store.calls(t, s["id"]) if c.status == "complete"]
      verdict = spec.fn(calls, cfg) if calls else None
      if verdict is None:
        counts["ungradable"] += 1
        continue
      fid = f"{source}:{t}/{s['id']}" + (f"@{len(calls)}" if regrade else "")
      new = store.add_feedback(Feedback(id=fid, tenant=t, session=s["id"], call_id=None,
                                        created=time.time(), grade=verdict.grade,
                                        rubric=verdict.rubric, text=verdict.text,
                                        source=source))
      counts["graded" if new else "skipped"] += 1
  return counts


@dataclasses.dataclass(frozen=True)
class ReferenceConfig:
  """Grade the final answer against `metadata[key]` of the session's requests."""
  key: str = "reference"          # the request metadata field holding the expected answer
  grader: str = "numeric"         # a task-bank grader (graders/)


@register_trace_grader("reference", ReferenceConfig)
def _reference(calls: Sequence[CallRecord], cfg: ReferenceConfig) -> Optional[Verdict]:
  refs = [c.request.get("metadata", {}).get(cfg.key) for c in calls
          if isinstance(c.request.get("metadata"), dict)]
  refs = [r for r in refs if isinstance(r, str) and r]
  if not refs or not calls[-1].choices:
    return None
  answer = calls[-1].choices[0].text
  prompt = (calls[-1].messages or [{"role": "user", "content": calls[-1].prompt_text}])
  task = Task(id=calls[-1].session, prompt=[m for m in prompt if m["role"] == "user"][-1:]
              or "?", answer=refs[-1])
  result = make_grader(cfg.grader)(answer, task)
  return Verdict(grade=float(result.reward),
                 text=None if result.parse_ok else "no answer could be read from the reply")
