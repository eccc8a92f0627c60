"""A recorded session → training samples, merged by token prefix.

Every complete call is a node per choice: `stream = prompt_ids + choice.token_ids`. A call whose
prompt ids start with an earlier node's stream continues it (the longest such stream is its
parent); its choices are that node's children. A call with no parent starts a new tree, and
the reason the proxy recorded for it (prompts.py: history edited, system prompt changed,
sub-agent, ...) is counted.

Each leaf becomes one sample: the leaf's stream, with loss mask 1 on the sampled span of every
node on its path. A span shared by several leaves (the history before an `n > 1` fork) is
trained in the first sample only, so every sampled token is trained exactly once. Only
"complete" calls are used: an incomplete one (client gone, proxy killed) or one our engine
failed is counted and left out, never trained as if whole.

The session's grade is the reward of all its samples (the latest session-level grade wins;
`None` if ungraded), and its free-text feedback (session and per-call, oldest first) their
`feedback`.
"""
from __future__ import annotations

import collections
from typing import Optional, Sequence

from posttrain_jax.byoh.store import CallRecord, Feedback
from posttrain_jax.types import Source, Status, Trajectory


def session_grade(feedback: Sequence[Feedback]) -> Optional[float]:
  grades = [f.grade for f in feedback if f.call_id is None and f.grade is not None]
  return grades[-1] if grades else None


def session_feedback_text(feedback: Sequence[Feedback]) -> Optional[str]:
  texts = [f.text for f in feedback if f.text]
  return "\n".join(texts) if texts else None


def rebuild_session(session: str, calls: Sequence[CallRecord],
                    feedback: Sequence[Feedback] = ()) -> tuple[list[Trajectory],
                                                                collections.Counter]:
  """The session's training samples and counts: samples, calls, incomplete, error,
  break/<reason>, sampled_tokens."""
  stats: collections.Counter = collections.Counter()
  nodes: list[tuple[CallRecord, int]] = []          # (call, choice index) in call order
  streams: list[list[int]] = []
  parent_of: dict[int, Optional[int]] = {}
  for call in calls:
    stats["calls"] += 1
    if call.status != "complete":
      stats[call.status] += 1
      continue
    parent, best = None, -1
    for i, s in enumerate(streams):
      if len(s) > best and call.prompt_ids[:len(s)] == s:
        parent, best = i, len(s)
    if parent is None and call.break_reason:
      stats[f"break/{call.break_reason}"] += 1
    for c in call.choices:
      parent_of[len(nodes)] = parent
      nodes.append((call, c.index))
      streams.append(call.prompt_ids + list(c.token_ids))
  has_child = {p for p in parent_of.values() if p is not None}
  reward = session_grade(feedback)
  text = session_feedback_text(feedback)
  trained: set[int] = set()
  out = []
  for leaf in range(len(nodes)):
    if leaf in has_child:
      continue
    path, n = [], leaf
    while n is not None:
      path.append(n)
      n = parent_of[n]
    ids = streams[leaf]
    mask, logps, versions = [0] * len(ids), [0.0] * len(ids), [-1] * len(ids)
    for n in path:
      call, j = nodes[n]
      choice = next(c for c in call.choices if c.index == j)
      start = len(call.prompt_ids)
      for t, lp in enumerate(choice.logprobs):
        logps[start + t] = float(lp)
        versions[start + t] = int(choice.version)
        mask[start + t] = 0 if n in trained else 1
      trained.add(n)
    call, j = nodes[leaf]
    choice = next(c for c in call.choices if c.index == j)
    messages = list(call.messages or [])
    if choice.message is not None:
      messages.append(choice.message)
    traj = Trajectory(
        id=f"{session}/{len(out)}", task_id=session, token_ids=list(ids), loss_mask=mask,
        behaviour_logprobs=logps, policy_version=versions, group_id=None, source=Source.BYOH,
        messages=messages, tools=call.tools or None, reward=reward, feedback=text,
        status=Status.TRUNCATED if choice.finish_reason == "length" else Status.OK,
        # one episode: advantages count a session once (advantages.py, sample_index 0)
        metrics={"calls": len(path), "tenant": call.tenant, "sample_index": len(out),
                 "samples": 0, "episode_id": f"{call.tenant}/{session}",
                 # [start, end) of each call's sampled tokens on the path, first call first
                 "spans": [[len(nodes[n][0].prompt_ids), len(streams[n])]
                           for n in reversed(path)]})
    out.append(traj)
    stats["sampled_tokens"] += sum(mask)
  for t in out:
    t.metrics["samples"] = len(out)
  stats["samples"] = len(out)
  return out, stats
