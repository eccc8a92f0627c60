"""First-come first-served turns at the device, so a long decode cannot hold it.

On an accelerator the programs that threads dispatch run one after another on the device's
stream: a request decoding 4096 tokens in one `while_loop` holds the device for all of them, and
a 10-token request dispatched meanwhile waits for the whole loop. The embedded sampler instead
decodes in segments of a few dozen steps, each taken as a turn here: a thread joins the queue,
runs its segment when it reaches the head (at most `slots` at once), waits for the device to
finish it, and leaves; a long request rejoins the *back* of the queue for its next segment. A
request that arrives while a long one decodes therefore waits for at most one segment of each
request ahead of it, not for their whole answers.

On CPU, XLA runs programs of different threads side by side, so the sampler takes no turns
there by default (`slots` = None: a turn is free).
"""
from __future__ import annotations

import collections
import contextlib
import threading
from typing import Iterator, Optional


class Turns:
  """A FIFO queue of at most `slots` concurrent holders (None: no limit, no queue)."""

  def __init__(self, slots: Optional[int]):
    if slots is not None and slots < 1:
      raise ValueError(f"Turns: slots={slots}; at least 1 (or None for no limit)")
    self.slots = slots
    self._cv = threading.Condition()
    self._queue: collections.deque = collections.deque()   # waiting, oldest first
    self._running = 0
    self.taken = 0                  # turns taken so far (tests and metrics read it)

  @contextlib.contextmanager
  def turn(self) -> Iterator[None]:
    if self.slots is None:
      with self._cv:
        self.taken += 1
      yield
      return
    me = object()
    with self._cv:
      self._queue.append(me)
      while self._queue[0] is not me or self._running >= self.slots:
        self._cv.wait()
      self._queue.popleft()
      self._running += 1
      self.taken += 1
      self._cv.notify_all()       # the next in line may fit in a free slot too
    try:
      yield
    finally:
      with self._cv:
        self._running -= 1
        self._cv.notify_all()

  def waiting(self) -> int:
    """Threads queued for a turn now (not counting those holding one)."""
    with self._cv:
      return len(self._queue)
