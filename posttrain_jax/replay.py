"""The replay queue between actors and learner: bounded, staleness-aware, group-complete,
accounted, persisted.

Work flows through three places, all behind one lock (so a snapshot of them is consistent):

    backlog  work items not started (a task drawn from the bank, with a key and a JSON payload)
    in flight  work items an actor has claimed and is running
    ready    complete groups of graded trajectories waiting for the learner

Versions. The learner's current policy version v is set with `set_version(v)`. A trajectory's
version is the *oldest* `policy_version` of its sampled tokens (weights may change mid-episode);
a group's version is the oldest of its members'. At delivery, a group with
v − version > max_staleness is dropped ("stale").

Bounded staleness by admission (AReaL, Fu et al. 2025): rather than generate and drop, an actor
may *start* a group only when, if groups were consumed in the order they start, it would be
consumed at most max_staleness versions after the version that samples it. With P groups per
learner step, c groups delivered since the version became v and A groups ready or in flight,
the next group to start would be consumed at version v + ⌊(c + A)/P⌋, so admission requires

    c + A < (max_staleness + 1) · P.

(Relative to the current version, so version numbers may start anywhere or jump.)

Groups finish out of order (a slow rollout is overtaken), so admission alone does not bound
staleness: the delivery-time check is the guarantee, admission only keeps the drops rare.
Delivering the oldest groups first (`order="oldest_first"`) gives a slow group its turn before it
goes stale, instead of starving it (tinker-cookbook PR #822: discard-and-requeue drifts training
toward fast, easy problems); the trained-vs-generated length statistics make any such drift
visible.

Back-pressure: ready + in-flight + incomplete groups never exceed `capacity`; `claim` grants
nothing beyond it and an unclaimed `put` waits for room.

Groups. A group (the G samples of one prompt, `group_id`) is released only when complete: all G
members in (`group_size`), or, without a `group_size`, whatever one `put` brings for that id.
Trajectories without a `group_id` are groups of one. When a group completes:
1. `infra_error` members are dropped ("infra"): our failures are never trained on, never in a
   baseline;
2. if fewer than `min_scored` members remain (1 for a group of one), the rest are dropped too,
   also as "infra": a group baseline from one sample is no baseline, and the cause was ours;
3. the group filter (a name in `GROUP_FILTERS`, e.g. DAPO's "zero_variance") may drop the group
   ("filter");
4. otherwise it is ready.

Accounting: every trajectory put is counted once as generated and ends up counted once as
trained (delivered), dropped by one reason (stale, infra, filter), or still queued, so

    generated = trained + dropped_stale + dropped_infra + dropped_filter + queued

at every moment (`stats()` reports the terms and their difference, `unaccounted`, which is 0).
Response lengths (sampled tokens) of what was generated (infra errors excluded) and of what was
trained are reported as mean / p50 / p90, per window and in total.

Persistence: `state()` is a JSON-able snapshot of backlog, in-flight work (saved as backlog: it is
re-run after a restore), ready and incomplete groups, version and every counter; `restore()`
loads it into a fresh queue. A checkpoint that holds this snapshot and the task iterator's state
taken at the same moment resumes without losing or duplicating any work item or trajectory.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from collections import Counter
from typing import Any, Callable, Optional, Sequence

import numpy as np

from posttrain_jax.registry import Registry
from posttrain_jax.types import Trajectory

DROP_REASONS = ("stale", "infra", "filter", "invalid")
ORDERS = ("oldest_first", "fifo")
STATE_FORMAT = 1

GroupFilter = Callable[[Sequence[Trajectory]], bool]   # scored members -> keep?
GROUP_FILTERS: Registry[GroupFilter] = Registry("group filter")


def register_group_filter(name: str):
  """Registers `fn(scored_members) -> keep` under `name` (for ReplayConfig.filter)."""
  return GROUP_FILTERS.register(name)


@register_group_filter("none")
def _keep_all(members: Sequence[Trajectory]) -> bool:
  del members
  return True


@register_group_filter("zero_variance")
def _has_reward_variance(members: Sequence[Trajectory]) -> bool:
  """DAPO dynamic sampling: a group whose rewards are all equal has no advantage signal."""
  rewards = {t.reward for t in members}
  return len(rewards) > 1


@dataclasses.dataclass(frozen=True)
class ReplayConfig:
  """The replay queue between actors and learner (async mode)."""
  capacity: int = 64              # groups ready + in flight + incomplete; producers wait beyond it
  max_staleness: Optional[int] = 1  # drop groups more than this many versions behind; None = never
  admission: bool = True          # don't start groups that would be consumed too stale (AReaL)
  min_scored: int = 2             # non-infra members a group needs to be trained (else all "infra")
  filter: str = "none"            # group filter in GROUP_FILTERS: "none" | "zero_variance" (DAPO)
  order: str = "oldest_first"     # delivery order: "oldest_first" (version, then arrival) | "fifo"

  def __post_init__(self):
    if self.capacity < 1:
      raise ValueError(f"ReplayConfig.capacity must be ≥ 1, got {self.capacity}")
    if self.max_staleness is not None and self.max_staleness < 0:
      raise ValueError(
          f"ReplayConfig.max_staleness must be ≥ 0 or None, got {self.max_staleness}")
    if self.min_scored < 1:
      raise ValueError(f"ReplayConfig.min_scored must be ≥ 1, got {self.min_scored}")
    GROUP_FILTERS.get(self.filter)
    if self.order not in ORDERS:
      raise ValueError(f"ReplayConfig.order is {self.order!r}; valid: {ORDERS}")


@dataclasses.dataclass
class Group:
  """A complete group as delivered: its scored members and the work item that produced it."""
  group_id: str
  trajectories: list[Trajectory]
  version: Optional[int]          # oldest sampled-token version (None: no sampled token)
  payload: Any = None             # the claimed work item's payload (None for unclaimed puts)
  seq: int = 0                    # arrival order
  staleness: Optional[int] = None  # learner version − version, set at delivery


class QueueClosed(RuntimeError):
  """The queue was closed (shutdown); nothing more will be delivered or accepted."""


def trajectory_version(t: Trajectory) -> Optional[int]:
  """The oldest policy version among the tokens the policy sampled (None if none)."""
  versions = [v for v in t.policy_version if v >= 0]
  return min(versions) if versions else None


def response_len(t: Trajectory) -> int:
  """Tokens the policy sampled (counted by version tag, so masked truncations count too)."""
  return sum(1 for v in t.policy_version if v >= 0)


def _percentile(counts: Counter, q: float) -> float:
  """Nearest-rank percentile of a {value: count} histogram (NaN when empty)."""
  total = sum(counts.values())
  if total == 0:
    return float("nan")
  rank = max(1, int(np.ceil(q / 100.0 * total)))
  seen = 0
  for value in sorted(counts):
    seen += counts[value]
    if seen >= rank:
      return float(value)
  return float(max(counts))


def _len_stats(prefix: str, counts: Counter) -> dict[str, float]:
  n = sum(counts.values())
  mean = sum(k * c for k, c in counts.items()) / n if n else float("nan")
  return {f"{prefix}_mean": mean, f"{prefix}_p50": _percentile(counts, 50),
          f"{prefix}_p90": _percentile(counts, 90)}


def _new_counters() -> dict[str, Any]:
  c: dict[str, Any] = {"generated": 0, "trained": 0, "generated_groups": 0, "trained_groups": 0}
  for r in DROP_REASONS:
    c[f"dropped_{r}"] = 0
    c[f"dropped_groups_{r}"] = 0
  c["gen_len"] = Counter()
  c["trained_len"] = Counter()
  c["staleness"] = Counter()
  return c


class ReplayQueue:
  """Thread-safe; producers and the consumer may live in different threads (or event loops).

  groups_per_step: P, the groups the learner consumes per version (for admission; None = no
  staleness admission, only capacity). group_size: G, members that complete a group (None = a
  `put` brings whole groups).
  """

  def __init__(self, cfg: ReplayConfig = ReplayConfig(), *, group_size: Optional[int] = None,
               groups_per_step: Optional[int] = None):
    self.cfg = cfg
    self.group_size = group_size
    self.groups_per_step = groups_per_step
    self._filter = GROUP_FILTERS.get(cfg.filter)
    self._cond = threading.Condition()
    self._listeners: list[Callable[[], None]] = []
    self._version = 0
    self._consumed_at_version = 0              # groups delivered since the version last changed
    self._seq = 0
    self._backlog: dict[Any, Any] = {}         # key -> payload, insertion order = claim order
    self._inflight: dict[Any, Any] = {}        # key -> payload
    self._ready: list[Group] = []
    self._pending: dict[str, list[Trajectory]] = {}   # incomplete groups
    self._pending_payload: dict[str, Any] = {}
    self._closed = False
    self._total = _new_counters()
    self._window = _new_counters()

  # ------------------------------------------------------------------ versions
  @property
  def version(self) -> int:
    return self._version

  def set_version(self, version: int) -> None:
    """The learner's current policy version; ready groups now too stale are dropped."""
    with self._cond:
      if int(version) != self._version:
        self._consumed_at_version = 0
      self._version = int(version)
      self._sweep_stale()
      self._changed()

  def transaction(self):
    """A context manager holding the queue's (re-entrant) lock: calls made inside it are seen by
    other threads as one step, e.g. set_version + work_wanted + add_work, so no actor claims a
    half-filled backlog."""
    return self._cond

  # ------------------------------------------------------------------ work items (producers)
  def add_work(self, key, payload) -> None:
    """Queues a work item (e.g. a drawn task); `key` must be new and `payload` JSON-able."""
    with self._cond:
      if key in self._backlog or key in self._inflight:
        raise ValueError(f"work item {key!r} is already queued or in flight")
      self._backlog[key] = payload
      self._changed()

  def admissible(self) -> int:
    """How many more groups may start now (capacity and staleness admission)."""
    with self._cond:
      return self._admissible()

  def work_wanted(self) -> int:
    """Work items to add so the backlog covers everything admissible now (≥ 0)."""
    with self._cond:
      return max(0, self._admissible() - len(self._backlog))

  def try_claim(self, max_items: int = 1) -> list[tuple[Any, Any]]:
    """Up to `max_items` (key, payload) work items, as many as admission allows; never waits."""
    with self._cond:
      if self._closed:
        return []
      n = min(max_items, self._admissible(), len(self._backlog))
      out = []
      for key in list(self._backlog)[:n]:
        payload = self._backlog.pop(key)
        self._inflight[key] = payload
        out.append((key, payload))
      if out:
        self._changed()
      return out

  def claim(self, max_items: int = 1, timeout: Optional[float] = None) -> list[tuple[Any, Any]]:
    """Like `try_claim` but waits (up to `timeout` s) until something is admissible."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with self._cond:
      while True:
        out = self.try_claim(max_items)
        if out or self._closed:
          return out
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
          return []
        self._cond.wait(remaining)

  def requeue(self, key, payload) -> None:
    """Returns claimed item `key` to the *end* of the backlog with a new payload (every attempt
    of its episode failed on our side; it runs again after the work already waiting)."""
    with self._cond:
      if key not in self._inflight:
        raise KeyError(f"work item {key!r} is not in flight")
      del self._inflight[key]
      self._backlog[key] = payload
      self._changed()

  def drop_work(self, key, reason: str) -> None:
    """Releases claimed item `key` without a group, counted as a dropped group for `reason`
    (e.g. "invalid": a task that can never run, such as a prompt longer than the engine's
    limit). No trajectory was generated, so the trajectory accounting is unchanged."""
    with self._cond:
      if reason not in DROP_REASONS:
        raise ValueError(f"drop reason {reason!r}; valid: {DROP_REASONS}")
      if key not in self._inflight:
        raise KeyError(f"work item {key!r} is not in flight")
      del self._inflight[key]
      self._count("generated_groups", 1)
      self._count(f"dropped_groups_{reason}", 1)
      self._changed()

  def unclaim(self, keys: Sequence) -> None:
    """Returns claimed items to the front of the backlog (an actor gave up: shutdown)."""
    with self._cond:
      back = {k: self._inflight.pop(k) for k in keys if k in self._inflight}
      self._backlog = {**back, **self._backlog}
      self._changed()

  # ------------------------------------------------------------------ trajectories (producers)
  def put(self, trajectories: Sequence[Trajectory], claim=None, timeout: Optional[float] = None
          ) -> None:
    """Adds graded trajectories. With `claim` (a key from `claim`) the work item is released in
    the same atomic step, and room was reserved when it was claimed, so this never waits. Without
    one, waits (up to `timeout` s, then TimeoutError) while the queue is at capacity."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with self._cond:
      if claim is None:
        while self._room() <= 0 and not self._closed:
          remaining = None if deadline is None else deadline - time.monotonic()
          if remaining is not None and remaining <= 0:
            raise TimeoutError(f"replay queue full ({self.cfg.capacity} groups, "
                               "ReplayConfig.capacity) and nobody consumed within the timeout")
          self._cond.wait(remaining)
      if self._closed:
        raise QueueClosed("put on a closed replay queue")
      payload = None
      if claim is not None:
        if claim not in self._inflight:
          raise KeyError(f"work item {claim!r} is not in flight (claimed twice, or never)")
        payload = self._inflight.pop(claim)
      for t in trajectories:
        self._count("generated", 1)
        if t.trainable:
          self._count_len("gen_len", response_len(t))
        gid = t.group_id if t.group_id is not None else f"\x00{t.id}"
        self._pending.setdefault(gid, []).append(t)
        if payload is not None:
          self._pending_payload[gid] = payload
      for gid in dict.fromkeys(t.group_id if t.group_id is not None else f"\x00{t.id}"
                               for t in trajectories):
        members = self._pending[gid]
        singleton = gid.startswith("\x00")
        if singleton or self.group_size is None or len(members) >= self.group_size:
          del self._pending[gid]
          self._complete(None if singleton else gid, members,
                         self._pending_payload.pop(gid, payload))
      self._changed()

  # ------------------------------------------------------------------ delivery (consumer)
  def get(self, n: int, timeout: Optional[float] = None) -> list[Group]:
    """Up to `n` complete groups in delivery order; waits until there are `n` or `timeout` s
    have passed (then returns fewer, maybe none). Groups are counted as trained here."""
    deadline = None if timeout is None else time.monotonic() + timeout
    out: list[Group] = []
    with self._cond:
      while True:
        self._sweep_stale()
        while self._ready and len(out) < n:
          out.append(self._deliver())
        if out:
          self._changed()
        if len(out) >= n or self._closed:
          return out
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
          return out
        self._cond.wait(remaining)

  def close(self) -> None:
    """Wakes every waiter; later puts raise QueueClosed, gets return what is ready."""
    with self._cond:
      self._closed = True
      self._changed()

  def add_listener(self, fn: Callable[[], None]) -> None:
    """`fn()` is called (under the lock: keep it tiny, e.g. `loop.call_soon_threadsafe`)
    after every change, so an event loop can wait for room without polling."""
    with self._cond:
      self._listeners.append(fn)

  def remove_listener(self, fn: Callable[[], None]) -> None:
    with self._cond:
      if fn in self._listeners:
        self._listeners.remove(fn)

  # ------------------------------------------------------------------ reporting
  def depth(self) -> dict[str, int]:
    with self._cond:
      return {"ready_groups": len(self._ready), "in_flight": len(self._inflight),
              "backlog": len(self._backlog), "incomplete_groups": len(self._pending),
              "queued": self._queued()}

  def stats(self, reset_window: bool = True) -> dict[str, float]:
    """Counters since the last reset (`replay/...`) and in total (`replay/total/...`)."""
    with self._cond:
      out: dict[str, float] = {}
      for prefix, c in (("replay/", self._window), ("replay/total/", self._total)):
        for k in ("generated", "trained", *(f"dropped_{r}" for r in DROP_REASONS),
                  "generated_groups", "trained_groups",
                  *(f"dropped_groups_{r}" for r in DROP_REASONS)):
          out[prefix + k] = float(c[k])
        out.update(_len_stats(prefix + "gen_len", c["gen_len"]))
        out.update(_len_stats(prefix + "trained_len", c["trained_len"]))
        st = c["staleness"]
        n = sum(st.values())
        out[prefix + "staleness_mean"] = (sum(k * v for k, v in st.items()) / n if n
                                          else float("nan"))
        out[prefix + "staleness_max"] = float(max(st)) if n else float("nan")
      queued = self._queued()
      t = self._total
      out["replay/queued"] = float(queued)
      out["replay/total/unaccounted"] = float(
          t["generated"] - t["trained"] - sum(t[f"dropped_{r}"] for r in DROP_REASONS) - queued)
      out["replay/ready_groups"] = float(len(self._ready))
      out["replay/in_flight_groups"] = float(len(self._inflight))
      out["replay/backlog_groups"] = float(len(self._backlog))
      out["replay/version"] = float(self._version)
      if reset_window:
        self._window = _new_counters()
      return out

  # ------------------------------------------------------------------ persistence
  def state(self) -> dict:
    """A JSON-able snapshot; in-flight work is saved as backlog (re-run after restore)."""
    with self._cond:
      backlog = list(self._inflight.items()) + list(self._backlog.items())
      return {
          "format": STATE_FORMAT, "version": self._version, "seq": self._seq,
          "consumed_at_version": self._consumed_at_version,
          "backlog": [[k, p] for k, p in backlog],
          "ready": [{"group_id": g.group_id, "version": g.version, "payload": g.payload,
                     "seq": g.seq, "trajectories": [t.to_dict() for t in g.trajectories]}
                    for g in self._ready],
          "incomplete": [{"group_id": gid, "payload": self._pending_payload.get(gid),
                          "trajectories": [t.to_dict() for t in ms]}
                         for gid, ms in self._pending.items()],
          "total": _counters_json(self._total), "window": _counters_json(self._window),
      }

  def restore(self, state: dict) -> None:
    """Loads `state()` output into this (fresh) queue."""
    with self._cond:
      if (self._backlog or self._inflight or self._ready or self._pending
          or self._total["generated"]):
        raise RuntimeError("ReplayQueue.restore needs a fresh queue (this one has work or counts)")
      if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise ValueError(f"not a replay queue state of format {STATE_FORMAT}: "
                         f"{str(state)[:80]!r}")
      self._version = int(state["version"])
      self._consumed_at_version = int(state["consumed_at_version"])
      self._seq = int(state["seq"])
      self._backlog = {_key(k): p for k, p in state["backlog"]}
      self._ready = [Group(g["group_id"], [Trajectory.from_dict(t) for t in g["trajectories"]],
                           g["version"], g["payload"], g["seq"]) for g in state["ready"]]
      for g in state["incomplete"]:
        self._pending[g["group_id"]] = [Trajectory.from_dict(t) for t in g["trajectories"]]
        if g["payload"] is not None:
          self._pending_payload[g["group_id"]] = g["payload"]
      self._total = _counters_from_json(state["total"])
      self._window = _counters_from_json(state["window"])
      self._changed()

  # ------------------------------------------------------------------ internals (lock held)
  def _changed(self) -> None:
    self._cond.notify_all()
    for fn in self._listeners:
      fn()

  def _queued(self) -> int:
    return (sum(len(g.trajectories) for g in self._ready)
            + sum(len(ms) for ms in self._pending.values()))

  def _room(self) -> int:
    return self.cfg.capacity - len(self._ready) - len(self._inflight) - len(self._pending)

  def _admissible(self) -> int:
    room = self._room()
    if (self.cfg.admission and self.cfg.max_staleness is not None
        and self.groups_per_step is not None):
      limit = (self.cfg.max_staleness + 1) * self.groups_per_step
      ahead = (self._consumed_at_version + len(self._ready) + len(self._inflight)
               + len(self._pending))
      room = min(room, limit - ahead)
    return max(room, 0)

  def _count(self, key: str, n: int) -> None:
    self._total[key] += n
    self._window[key] += n

  def _count_len(self, key: str, length: int) -> None:
    self._total[key][length] += 1
    self._window[key][length] += 1

  def _drop(self, reason: str, trajectories: Sequence[Trajectory]) -> None:
    """Counts `trajectories` as dropped for `reason` (the one place drops happen)."""
    if trajectories:
      self._count(f"dropped_{reason}", len(trajectories))

  def _complete(self, gid: Optional[str], members: list[Trajectory], payload) -> None:
    infra = [t for t in members if not t.trainable]
    scored = [t for t in members if t.trainable]
    self._drop("infra", infra)
    need = 1 if gid is None else self.cfg.min_scored
    self._count("generated_groups", 1)
    if len(scored) < need:
      self._drop("infra", scored)
      self._count("dropped_groups_infra", 1)
      return
    if not self._filter(scored):
      self._drop("filter", scored)
      self._count("dropped_groups_filter", 1)
      return
    versions = [v for v in map(trajectory_version, scored) if v is not None]
    self._ready.append(Group(gid if gid is not None else scored[0].id, scored,
                             min(versions) if versions else None, payload, self._seq))
    self._seq += 1

  def _too_stale(self, g: Group) -> bool:
    return (self.cfg.max_staleness is not None and g.version is not None
            and self._version - g.version > self.cfg.max_staleness)

  def _sweep_stale(self) -> None:
    keep = []
    for g in self._ready:
      if self._too_stale(g):
        self._drop("stale", g.trajectories)
        self._count("dropped_groups_stale", 1)
      else:
        keep.append(g)
    self._ready = keep

  def _deliver(self) -> Group:
    if self.cfg.order == "oldest_first":
      i = min(range(len(self._ready)), key=lambda j: (
          self._ready[j].version if self._ready[j].version is not None else self._version,
          self._ready[j].seq))
    else:
      i = 0
    g = self._ready.pop(i)
    g.staleness = 0 if g.version is None else self._version - g.version
    self._count("trained", len(g.trajectories))
    self._count("trained_groups", 1)
    self._consumed_at_version += 1
    self._total["staleness"][g.staleness] += 1
    self._window["staleness"][g.staleness] += 1
    for t in g.trajectories:
      self._count_len("trained_len", response_len(t))
    return g


def _key(k):
  return tuple(k) if isinstance(k, list) else k


def _counters_json(c: dict) -> dict:
  return {k: ({str(a): b for a, b in v.items()} if isinstance(v, Counter) else v)
          for k, v in c.items()}


def _counters_from_json(d: dict) -> dict:
  c = _new_counters()
  for k, v in d.items():
    c[k] = Counter({int(a): b for a, b in v.items()}) if isinstance(c.get(k), Counter) else v
  return c
