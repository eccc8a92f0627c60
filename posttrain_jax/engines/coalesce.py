"""Concurrent calls batched into one: the proxy's answer to an engine that decodes a call's
prompts as one batch but is handed one request at a time.

A proxy thread per request calls `engine.generate([prompt], sampling, n)`. The embedded
sampler (and vLLM's synchronous `LLM.generate`, under its lock) then decode at batch 1 however
many harness threads wait: on a 2-core CPU, SmolLM2-135M served 0.29 calls/s to 8 concurrent
clients. `Coalescer(engine)` gathers concurrent calls with the same sampling parameters and n
into groups and issues each group as one `generate`:

    a caller      joins the open group of its (sampling, n), or opens one and leads it
    the leader    waits for the previous group of that key to finish (arrivals meanwhile join
                  its group), then `window_s` more, closes the group and issues it as one call
                  of up to `max_batch` prompts; every caller gets its own prompts' completions

So under load a group is as large as what arrived while the last one decoded, and a lone call
waits only `window_s`. Every completion carries the version its group was sampled with.

Seeded calls are never grouped: which rows a seed's random stream lands on depends on the batch
(a seeded call must reproduce, streamed or not, alone or not), so they go to the engine as they
came, as do calls whose sampling parameters cannot be hashed. A failed group is retried by each
of its callers alone, so an error (a prompt too long for the engine, a dead engine) reaches the
caller it belongs to and no other. Everything else (stream, update_weights, version, fork, ...)
is the engine's own.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Optional, Sequence

from posttrain_jax.engines.base import Completion, SamplingParams


@dataclasses.dataclass
class _Group:
  prompts: list = dataclasses.field(default_factory=list)
  after: Optional["_Group"] = None         # the group of the same key issued before this one
  done: threading.Event = dataclasses.field(default_factory=threading.Event)
  result: Optional[list] = None
  error: Optional[BaseException] = None


class Coalescer:
  """`engine` with concurrent unseeded generate calls batched (module docstring)."""

  def __init__(self, engine, window_s: float = 0.002, max_batch: int = 64):
    if window_s < 0 or max_batch < 1:
      raise ValueError(f"Coalescer: window_s >= 0 and max_batch >= 1, got {window_s}, {max_batch}")
    self.inner, self.window_s, self.max_batch = engine, window_s, max_batch
    self._lock = threading.Lock()
    self._open: dict = {}    # key -> its group still joinable
    self._last: dict = {}    # key -> its newest group not yet done (both hold active keys only)
    # generate calls received, calls issued to the engine, the most requests in one of those
    self._counts = {"requests": 0, "engine_calls": 0, "largest": 0}

  def __getattr__(self, name: str) -> Any:
    return getattr(self.inner, name)

  def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, n: int = 1,
               seed: Optional[int] = None) -> list[list[Completion]]:
    key = (sampling, n)
    try:
      hash(key)
    except TypeError:
      key = None
    if seed is not None or key is None or len(prompts) >= self.max_batch:
      return self._alone(prompts, sampling, n, seed)
    with self._lock:
      self._counts["requests"] += 1
      group = self._open.get(key)
      lead = group is None or len(group.prompts) + len(prompts) > self.max_batch
      if lead:
        group = self._open[key] = _Group(after=self._last.get(key))
        self._last[key] = group
      start = len(group.prompts)
      group.prompts += [list(p) for p in prompts]
    if lead:
      self._lead(key, group, sampling, n)
    else:
      group.done.wait()
    if group.error is not None:   # each caller retries alone: the error finds its owner
      return self._alone(prompts, sampling, n, None, counted=True)
    return group.result[start:start + len(prompts)]

  def _lead(self, key, group: _Group, sampling: SamplingParams, n: int) -> None:
    try:
      if group.after is not None:   # the previous group of this key decodes; ours fills
        group.after.done.wait()
        group.after = None
      if self.window_s:
        time.sleep(self.window_s)
      with self._lock:
        if self._open.get(key) is group:
          del self._open[key]
        self._count(len(group.prompts))
      group.result = self.inner.generate(group.prompts, sampling, n)
    except BaseException as e:  # noqa: BLE001 -- handed to every caller of the group
      group.error = e
    finally:
      with self._lock:
        if self._last.get(key) is group:
          del self._last[key]
      group.done.set()

  def _alone(self, prompts, sampling, n, seed, counted: bool = False):
    with self._lock:
      self._counts["requests"] += 0 if counted else 1
      self._count(1)
    return self.inner.generate(prompts, sampling, n, seed)

  def _count(self, requests: int) -> None:   # under self._lock
    self._counts["engine_calls"] += 1
    self._counts["largest"] = max(self._counts["largest"], requests)

  def coalesce_stats(self) -> dict[str, float]:
    """Requests received, engine calls issued, their ratio, and the most requests in one call."""
    with self._lock:
      c = dict(self._counts)
    return {**c, "requests_per_call": c["requests"] / max(c["engine_calls"], 1)}
