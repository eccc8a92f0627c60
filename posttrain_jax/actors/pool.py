"""The asynchronous actor pool, and `AsyncRollouts`: a rollout source that trains while it samples.

    worker (asyncio, `concurrency` of them):
        claim work items from the replay queue (admission: capacity + bounded staleness)
        run the episode (actors/episode.py; a plain `run` in a thread, a coroutine awaited)
        on our failure: retry with capped exponential backoff (RetryConfig); a task whose every
            attempt failed goes back to the backlog (requeued, counted) up to `max_requeues`
            times, then its group is pushed as `infra_error` (never reward 0; the queue drops it
            as "infra"); a task that can never run is dropped as "invalid"
        push the graded group to the queue (atomically releasing the claim)

`AsyncRollouts` runs the pool on its own event loop in a background thread and offers the
trainer the rollout-source interface of `SyncRollouts` (update_weights / collect / metrics /
state / restore / close):

- `update_weights(params, version)` installs the weights in the engine and sets the queue's
  version. For an engine that keeps a reference to the arrays it is given (the embedded JAX
  sampler) it first makes a device copy (`copy_weights=True`): the learner donates its buffers to
  the next step while the pool is still sampling; that copy is the whole cost of weight sync for
  the JAX sampler. Engines that copy on update themselves (vLLM, a server) take the weights as
  given (`copy_weights=False`). Generation does not stop for the learner: an episode already
  running finishes on the weights it started with, and its tokens carry that version (the loss
  corrects them when a correction is configured). (An engine may still serialise an update with
  its own running call: VLLMEngine's update waits for the generate in progress.)
- `collect(step)` returns the next `prompts_per_step` complete groups from the queue, waiting as
  needed; order and composition are not deterministic (which groups finish first depends on
  timing), sampling seeds are: they derive from (seed, draw index, attempt).
- Tasks are drawn from the bank only in the caller's thread (in update_weights and collect, as
  many as admission allows), never in the pool's, so the task iterator's state and `state()`
  taken between two calls are consistent.

What a checkpoint guarantees (trainer: state() saved beside the task iterator after a step):
every task drawn before the save is, in the saved state, exactly one of: trained (in the saved
weights), dropped (counted, by reason), queued as a complete group (saved with its trajectories),
or not finished (saved as backlog: claimed or not, it is re-run from scratch after a restore,
under the same group id, with new samples). Work done after the save is lost with the process and
redone (tasks drawn after the save are drawn again from the restored iterator). So across a
resume no trajectory is trained twice and no drawn task disappears; what is *not* reproduced is
which samples an unfinished group gets, and the order in which groups are delivered.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
import threading
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from posttrain_jax.actors.episode import (
    Episode, InvalidTaskError, RetryConfig, WorkItem, all_infra, drop_invalid, episode_metrics,
    infra_group, requeue_or_give_up)
from posttrain_jax.actors.rollout import DataExhaustedError, draw_task, exhausted
from posttrain_jax.actors.source import SourceBase, check_kind
from posttrain_jax.engines.base import Engine, engine_metrics
from posttrain_jax.tasks import Task
from posttrain_jax.replay import ReplayConfig, ReplayQueue
from posttrain_jax.types import Trajectory


@dataclasses.dataclass(frozen=True)
class PoolConfig:
  """The actor pool (async mode). Retries and requeues: `RLPhaseConfig.retry` (RetryConfig)."""
  concurrency: int = 2            # episodes in flight at once; size to the engine's capacity
  tasks_per_episode: int = 1      # tasks a worker batches into one episode (one group each)
  shutdown_grace_s: float = 10.0  # close(): wait this long for episodes in flight, then cancel
  collect_timeout_s: float = 600.0  # collect() fails (naming queue state) if a batch takes longer
  poll_s: float = 0.05            # idle workers / a waiting collect re-check at least this often

  def __post_init__(self):
    for name in ("concurrency", "tasks_per_episode"):
      if getattr(self, name) < 1:
        raise ValueError(f"PoolConfig.{name} must be ≥ 1, got {getattr(self, name)}")
    for name in ("shutdown_grace_s", "collect_timeout_s", "poll_s"):
      if getattr(self, name) < 0:
        raise ValueError(f"PoolConfig.{name} must be ≥ 0, got {getattr(self, name)}")

# ------------------------------------------------------------------ engine busy meter

class MeteredEngine:
  """Wraps an engine; measures the time at least one `generate` call is running."""

  def __init__(self, engine: Engine):
    self.engine = engine
    self._lock = threading.Lock()
    self._active = 0
    self._since = 0.0
    self._busy = 0.0

  @property
  def version(self) -> int:
    return self.engine.version

  def update_weights(self, weights, version: int) -> None:
    self.engine.update_weights(weights, version)

  def generate(self, *args, **kwargs):
    with self._lock:
      if self._active == 0:
        self._since = time.perf_counter()
      self._active += 1
    try:
      return self.engine.generate(*args, **kwargs)
    finally:
      with self._lock:
        self._active -= 1
        if self._active == 0:
          self._busy += time.perf_counter() - self._since

  def busy_seconds(self) -> float:
    """Seconds (so far) during which the engine had at least one call running."""
    with self._lock:
      return self._busy + (time.perf_counter() - self._since if self._active else 0.0)


# ------------------------------------------------------------------ the pool

class _DaemonThreads(concurrent.futures.ThreadPoolExecutor):
  """One daemon thread per call: an engine call that hangs can never block shutdown or exit."""

  def submit(self, fn, /, *args, **kwargs):
    future: concurrent.futures.Future = concurrent.futures.Future()

    def work():
      if not future.set_running_or_notify_cancel():
        return
      try:
        future.set_result(fn(*args, **kwargs))
      except BaseException as e:  # noqa: BLE001 -- handed to the awaiting coroutine
        future.set_exception(e)

    threading.Thread(target=work, daemon=True, name="actor-episode").start()
    return future

  def shutdown(self, wait=True, *, cancel_futures=False):
    del wait, cancel_futures


class ActorPool:
  """`concurrency` asyncio workers: claim -> episode (retries, requeue) -> push. `await run()`
  until `stop()` (callable from any thread); then in-flight episodes get `shutdown_grace_s` to
  finish and push, the rest are cancelled and their work items returned to the queue's backlog.
  Work item payloads are `WorkItem.to_dict()`; each item's group has `group_size` members."""

  def __init__(self, queue: ReplayQueue, episode: Episode, cfg: PoolConfig = PoolConfig(),
               retry: RetryConfig = RetryConfig(), *, group_size: int, seed: int = 0):
    self.queue, self.episode, self.cfg, self.retry = queue, episode, cfg, retry
    self.group_size, self.seed = group_size, seed
    self.counters = {"episodes": 0, "groups": 0, "engine_errors": 0, "retries": 0,
                     "requeued": 0, "given_up": 0, "invalid": 0,
                     "cancelled_episodes": 0}   # cumulative
    self._stop_requested = threading.Event()
    self._loop: Optional[asyncio.AbstractEventLoop] = None
    self._wake: Optional[asyncio.Event] = None
    self._stop: Optional[asyncio.Event] = None
    self._stopping = False
    self._executor = _DaemonThreads(max_workers=1)

  def stop(self) -> None:
    """Asks the pool to shut down gracefully (thread-safe; returns at once)."""
    self._stop_requested.set()
    loop = self._loop
    if loop is not None:
      try:
        loop.call_soon_threadsafe(self._stop.set)
      except RuntimeError:  # the loop already ended
        pass

  async def run(self) -> None:
    self._wake, self._stop = asyncio.Event(), asyncio.Event()
    self._loop = asyncio.get_running_loop()   # after the events: stop() may use it at once
    if self._stop_requested.is_set():
      self._stop.set()
    self.queue.add_listener(self._on_queue_change)
    workers = [asyncio.create_task(self._worker(i), name=f"actor-{i}")
               for i in range(self.cfg.concurrency)]
    stop_wait = asyncio.create_task(self._stop.wait())
    try:
      done, _ = await asyncio.wait([stop_wait, *workers], return_when=asyncio.FIRST_COMPLETED)
      failed = [t for t in done if t is not stop_wait and t.exception() is not None]
      self._stopping = True
      self._wake.set()
      if not failed:
        _, pending = await asyncio.wait(workers, timeout=self.cfg.shutdown_grace_s)
      else:
        pending = [t for t in workers if not t.done()]
      for t in pending:
        t.cancel()
      await asyncio.gather(*workers, return_exceptions=True)
      if failed:
        raise failed[0].exception()
    finally:
      stop_wait.cancel()
      self.queue.remove_listener(self._on_queue_change)

  def _on_queue_change(self) -> None:
    try:
      self._loop.call_soon_threadsafe(self._wake.set)
    except RuntimeError:  # loop closed
      pass

  async def _claim(self) -> list:
    items = self.queue.try_claim(self.cfg.tasks_per_episode)
    if items or self._stopping:
      return items
    self._wake.clear()
    items = self.queue.try_claim(self.cfg.tasks_per_episode)  # no wake-up lost in between
    if not items:
      try:
        await asyncio.wait_for(self._wake.wait(), self.cfg.poll_s)
      except asyncio.TimeoutError:
        pass
    return items

  async def _worker(self, wid: int) -> None:
    del wid
    while not self._stopping:
      claimed = await self._claim()
      if not claimed:
        continue
      keys = [k for k, _ in claimed]
      items = [WorkItem.from_dict(p) for _, p in claimed]
      try:
        results = await self._attempts(items)
      except asyncio.CancelledError:
        self.queue.unclaim(keys)
        self.counters["cancelled_episodes"] += 1
        raise
      except BaseException:
        self.queue.unclaim(keys)
        raise
      self.counters["episodes"] += 1
      for key, item in zip(keys, items):
        kind, group = results[item.draw]
        if kind == "invalid":
          self.queue.drop_work(key, "invalid")
          self.counters["invalid"] += 1
          continue
        if kind == "failed":
          again = requeue_or_give_up(item, self.retry)
          if again is not None:
            self.queue.requeue(key, again.to_dict())
            self.counters["requeued"] += 1
            continue
          self.counters["given_up"] += 1
        self.queue.put(group, claim=key)
        self.counters["groups"] += 1

  async def _attempts(self, items: list[WorkItem]) -> dict[int, tuple[str, list[Trajectory]]]:
    """draw -> ("ok" | "failed" | "invalid", group): retries with backoff (RetryConfig); a
    "failed" group is the infra group of the last error, or an episode's all-infra group."""
    out: dict[int, tuple[str, list[Trajectory]]] = {}
    todo, attempt = list(items), 0
    while todo:
      seed = (self.seed * 1_000_003 + todo[0].draw * 7919 + attempt) % (2**31)
      try:
        if inspect.iscoroutinefunction(self.episode.run):
          groups = await self.episode.run(todo, seed)
        else:
          groups = await self._loop.run_in_executor(self._executor, self.episode.run, todo, seed)
      except InvalidTaskError as e:
        todo, bad = drop_invalid(todo, e)
        out[bad.draw] = ("invalid", [])
        continue
      except Exception as e:  # noqa: BLE001 -- engine / network: ours, retried, never reward 0
        self.counters["engine_errors"] += 1
        if attempt < self.retry.max_retries:
          attempt += 1
          self.counters["retries"] += 1
          await asyncio.sleep(self.retry.delay(attempt))
          continue
        for item in todo:
          out[item.draw] = ("failed", infra_group(item, self.group_size, e,
                                                  self.episode.engine.version))
        return out
      if len(groups) != len(todo):
        raise RuntimeError(f"episode {type(self.episode).__name__} returned {len(groups)} groups "
                           f"for {len(todo)} work items")
      for item, group in zip(todo, groups):
        for t in group:
          t.metrics["attempt"] = attempt
        out[item.draw] = ("failed" if all_infra(group) else "ok", group)
      return out
    return out


# ------------------------------------------------------------------ the rollout source

def _nbytes(tree) -> int:
  return sum(int(getattr(x, "nbytes", 0)) for x in jax.tree.leaves(tree))


class AsyncRollouts(SourceBase):
  """The rollout-source protocol (actors/source.py) backed by an ActorPool + ReplayQueue running
  while the learner trains (see the module docstring for what is guaranteed); its samples may
  be up to `replay.max_staleness` versions old, so `off_policy`."""
  off_policy = True

  def __init__(self, episode: Episode, tasks, group_size: int, prompts_per_step: int,
               seed: int = 0, replay: ReplayConfig = ReplayConfig(),
               pool: PoolConfig = PoolConfig(), retry: RetryConfig = RetryConfig(),
               copy_weights: bool = True):
    # the episode's engine is metered (engine idle fraction): it is wrapped in place
    self.engine = episode.engine = MeteredEngine(episode.engine)
    self.episode = episode
    self.copy_weights = copy_weights
    self.tasks = tasks
    self.prompts_per_step = prompts_per_step
    self.pool_cfg = pool
    self.queue = ReplayQueue(replay, group_size=group_size, groups_per_step=prompts_per_step)
    self.pool = ActorPool(self.queue, episode, pool, retry, group_size=group_size, seed=seed)
    self._exhausted = False
    self._next_draw = 0
    self._thread: Optional[threading.Thread] = None
    self._error: Optional[BaseException] = None
    self._closed = False
    self._window_t = time.perf_counter()
    self._window_busy = 0.0
    self._window_pool = dict(self.pool.counters)
    self._sync = {"s": 0.0, "bytes": 0}
    self._collect_wait_s = 0.0

  # ------------------------------------------------------------------ the source interface
  def update_weights(self, params, version: int) -> None:
    """Installs `params` (a copy, see copy_weights) as `version`; generation continues."""
    t0 = time.perf_counter()
    own = params
    if self.copy_weights:
      own = jax.tree.map(jnp.copy, params)
      jax.block_until_ready(own)
    self.engine.update_weights(own, version)
    stats = getattr(self.engine.engine, "last_weight_sync", None)   # engines that measure it
    self._sync = {"s": time.perf_counter() - t0,
                  "bytes": getattr(stats, "bytes", None) or _nbytes(own)}
    self._top_up(version)
    self._start()

  def collect(self, step: int) -> tuple[list[Task], list[Trajectory]]:
    """The next prompts_per_step complete groups (tasks and their trajectories)."""
    del step
    self._start()
    t0 = time.perf_counter()
    groups = []
    while len(groups) < self.prompts_per_step:
      self._check_alive()
      self._top_up()
      groups += self.queue.get(self.prompts_per_step - len(groups), timeout=self.pool_cfg.poll_s)
      if self._exhausted and len(groups) < self.prompts_per_step and self._drained():
        raise exhausted(self._next_draw)
      if time.perf_counter() - t0 > self.pool_cfg.collect_timeout_s and \
          len(groups) < self.prompts_per_step:
        drops = {k: v for k, v in self.queue.stats(reset_window=False).items()
                 if "total/dropped_" in k}
        raise TimeoutError(
            f"AsyncRollouts.collect: {len(groups)}/{self.prompts_per_step} groups after "
            f"{self.pool_cfg.collect_timeout_s} s (PoolConfig.collect_timeout_s); queue "
            f"{self.queue.depth()}, pool {self.pool.counters}, drops {drops}")
    self._top_up()
    self._collect_wait_s = time.perf_counter() - t0
    tasks = [WorkItem.from_dict(g.payload).task for g in groups]
    return tasks, [t for g in groups for t in g.trajectories]

  def metrics(self) -> dict[str, float]:
    """Since the last call: replay/* (drops by reason, staleness, lengths, depth), pool/*
    (engine idle fraction, retries, errors), weight_sync/*."""
    out = self.queue.stats()
    busy = self.engine.busy_seconds()
    now = time.perf_counter()   # read after busy: busy time never exceeds wall time
    wall = now - self._window_t
    idle = 1.0 - (busy - self._window_busy) / wall if wall > 0 else 0.0
    out["pool/engine_idle_frac"] = min(max(idle, 0.0), 1.0)
    self._window_t, self._window_busy = now, busy
    counters = dict(self.pool.counters)
    for k, v in counters.items():
      out[f"pool/{k}"] = float(v - self._window_pool.get(k, 0))
      out[f"pool/total/{k}"] = float(v)
    self._window_pool = counters
    d_episodes = out["pool/episodes"]
    out["pool/tasks_per_episode"] = out["pool/groups"] / d_episodes if d_episodes else float("nan")
    out["pool/collect_wait_s"] = self._collect_wait_s
    out.update(episode_metrics(self.pool.episode))  # the episode's own filters (multi-turn)
    out.update(engine_metrics(self.engine.engine))  # e.g. a fleet's servers in service
    out["weight_sync/s"] = self._sync["s"]
    out["weight_sync/gb"] = self._sync["bytes"] / 1e9
    out["weight_sync/s_per_gb"] = (self._sync["s"] / (self._sync["bytes"] / 1e9)
                                   if self._sync["bytes"] else float("nan"))
    return out

  def state(self) -> dict:
    """Queue contents, unfinished work (re-run after restore), counters, next draw index.
    Take it in the thread that calls collect/update_weights, beside the task iterator's state."""
    return {"kind": "async", "next_draw": self._next_draw, "queue": self.queue.state(),
            "pool": dict(self.pool.counters)}

  def start_at(self, next_draw: int, requeued: Sequence[WorkItem] = ()) -> None:
    """Continues a synchronous source (rl.mode="auto" turning async): the next task drawn is
    draw `next_draw`, and `requeued` (its failed items waiting for a re-run) are queued first."""
    if self._thread is not None:
      raise RuntimeError("AsyncRollouts.start_at must be called before the pool starts")
    self._next_draw = int(next_draw)
    with self.queue.transaction():
      for item in requeued:
        self.queue.add_work(item.draw, item.to_dict())

  def restore(self, state: dict) -> None:
    """Loads `state()` output; must come before the first update_weights / collect."""
    if self._thread is not None:
      raise RuntimeError("AsyncRollouts.restore must be called before the pool starts")
    if not check_kind(state, "async"):
      return
    self._next_draw = int(state["next_draw"])
    self.queue.restore(state["queue"])
    self.pool.counters.update(state.get("pool", {}))
    self._window_pool = dict(self.pool.counters)

  def saved_note(self) -> str:
    q = self.queue.state()
    return (f"{len(q['ready'])} finished groups saved, {len(q['backlog'])} unfinished tasks "
            "saved to re-run")

  def close(self) -> None:
    """Graceful: stop claiming, let episodes finish (PoolConfig.shutdown_grace_s), join."""
    if self._closed:
      return
    self._closed = True
    self.pool.stop()
    if self._thread is not None:
      self._thread.join(self.pool_cfg.shutdown_grace_s + 10.0)
    self.queue.close()

  # ------------------------------------------------------------------ internals
  def _start(self) -> None:
    if self._thread is None and not self._closed:
      self._thread = threading.Thread(target=self._thread_main, daemon=True, name="actor-pool")
      self._thread.start()

  def _thread_main(self) -> None:
    try:
      asyncio.run(self.pool.run())
    except BaseException as e:  # noqa: BLE001 -- surfaced in the trainer's thread by collect
      self._error = e

  def _check_alive(self) -> None:
    if self._error is not None:
      raise RuntimeError(f"the actor pool died: {type(self._error).__name__}: {self._error}"
                         ) from self._error
    if self._closed:
      raise RuntimeError("AsyncRollouts.collect after close()")

  def _top_up(self, version: Optional[int] = None) -> None:
    """Draws as many tasks as the queue would let actors start now (caller's thread only), in one
    queue transaction (with the version change, if any) so actors claim whole batches."""
    with self.queue.transaction():
      if version is not None:
        self.queue.set_version(version)
      for _ in range(0 if self._exhausted else self.queue.work_wanted()):
        try:
          task = draw_task(self.tasks, self._next_draw)
        except DataExhaustedError:  # finish what is queued first; collect then raises
          self._exhausted = True
          break
        item = WorkItem(self._next_draw, task)
        self._next_draw += 1
        self.queue.add_work(item.draw, item.to_dict())

  def _drained(self) -> bool:
    d = self.queue.depth()
    return d["ready_groups"] == d["in_flight"] == d["backlog"] == d["incomplete_groups"] == 0
