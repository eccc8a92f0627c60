"""Backpressure: the proxy stops taking new sessions while the learner is behind.

Online (online.py), a session is trained after the sessions ahead of it: with P sessions
trained per step and B ready sessions not trained yet, one begun now is trained about B / P
versions after the version that serves it, so once B >= (max_staleness + 1) * P it would only
be dropped as stale (trace_source.py), and the harness's work would be lost without a word.
The proxy bounds that by admission (as replay.py does for the actors, after AReaL):

    admit a call  iff  pending + new < max_pending_sessions

`pending`: the ready sessions the learner has not trained, as it last reported (`Gate.report`,
every time its version changes; TraceRollouts.update_weights); `new`: the sessions the proxy
began serving since that report (a further call of one of them is always admitted). At the
bound, `ProxyConfig.backpressure` says what a call gets: "reject" -- a 429 at once, with
`Retry-After` (seconds: the learner's last step time, else `retry_after_s`) in the body shape of
the API it spoke; "queue" -- it waits until the learner reports, and is a 429 too after
`queue_timeout_s`. A 429 records nothing (like every 4xx the client caused). The counts are in
/health under "backpressure": calls rejected, calls queued, seconds queued.
`max_pending_sessions` 0 = no bound (today's behaviour: every call is served).
"""
from __future__ import annotations

import asyncio
import math
import threading
import time
from typing import Callable

from posttrain_jax.byoh import openai_api as api

MODES = ("reject", "queue")


class Gate:
  """The admission state; `report()` is called from the learner's thread, `admit()` in the
  proxy's event loop."""

  def __init__(self, mode: str, max_pending_sessions: int, queue_timeout_s: float,
               retry_after_s: float, poll_s: float = 0.02,
               clock: Callable[[], float] = time.monotonic):
    if mode not in MODES:
      raise ValueError(f"ProxyConfig.backpressure is {mode!r}; valid: {MODES}")
    self.mode, self.limit = mode, int(max_pending_sessions)
    self.queue_timeout_s, self.retry_after_s, self.poll_s = queue_timeout_s, retry_after_s, poll_s
    self._clock = clock
    self._lock = threading.Lock()
    self.version, self.pending = 0, 0
    self._new: set[tuple[str, str]] = set()
    self._reported_at = clock()
    self._step_s = 0.0
    self.rejected, self.queued, self.queued_s = 0, 0, 0.0

  def report(self, version: int, pending: int) -> None:
    """The learner is at `version` with `pending` ready sessions it has not trained."""
    with self._lock:
      now = self._clock()
      if version != self.version:
        self._step_s, self._reported_at = now - self._reported_at, now
        self._new.clear()
      self.version, self.pending = int(version), max(int(pending), 0)

  def _try(self, key: tuple[str, str]) -> bool:
    with self._lock:
      if self.limit <= 0 or key in self._new:
        return True
      if self.pending + len(self._new) < self.limit:
        self._new.add(key)
        return True
      return False

  def _reject(self, why: str) -> api.ApiError:
    self.rejected += 1
    wait = self._step_s if self._step_s > 0 else self.retry_after_s
    e = api.ApiError(429, f"the learner is behind ({why}: {self.pending} sessions not trained "
                     f"and {len(self._new)} begun at version {self.version}; the bound is "
                     f"{self.limit}); retry later", None, "learner_behind", "rate_limit_error")
    e.headers = {"Retry-After": str(max(1, math.ceil(wait)))}
    return e

  async def admit(self, tenant: str, session: str) -> None:
    """Returns once the call may be served, else raises the 429 (module docstring)."""
    key = (tenant, session)
    if self._try(key):
      return
    if self.mode == "reject":
      raise self._reject("backpressure=reject")
    self.queued += 1
    t0 = self._clock()
    try:
      while not self._try(key):
        if self._clock() - t0 >= self.queue_timeout_s:
          raise self._reject(f"queued {self.queue_timeout_s:g}s")
        await asyncio.sleep(self.poll_s)
    finally:
      self.queued_s += self._clock() - t0

  def counters(self) -> dict:
    return {"mode": self.mode, "max_pending_sessions": self.limit, "version": self.version,
            "pending": self.pending, "new": len(self._new), "rejected": self.rejected,
            "queued": self.queued, "queued_s": round(self.queued_s, 3)}
