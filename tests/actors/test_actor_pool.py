"""Actor pool and AsyncRollouts with fake engines: retries, requeue, then infra_error (never
reward 0), back-pressure, shutdown that does not hang, version tags, and state/restore without
loss."""
import asyncio
import itertools
import random
import threading
import time

import jax.numpy as jnp
import pytest

from posttrain_jax.actors.episode import RetryConfig, WorkItem
from posttrain_jax.actors.pool import ActorPool, AsyncRollouts, PoolConfig
from posttrain_jax.actors.rollout import RolloutConfig, TaskEpisode
from posttrain_jax.engines.base import Completion
from posttrain_jax.graders import GradeResult
from posttrain_jax.tasks import Task
from posttrain_jax.replay import ReplayConfig, ReplayQueue
from posttrain_jax.types import Status
from tests.support.fake_engine import FakeEngine, Tokenizer, grader, tasks

G = 3










def episode(engine):
  return TaskEpisode(engine, Tokenizer(), grader, RolloutConfig(group_size=G, max_tokens=6),
                     stop_token_ids=[1])


def pool_of(queue, engine, retry=RetryConfig(backoff_s=0.001), **cfg):
  return ActorPool(queue, episode(engine), PoolConfig(**cfg), retry, group_size=G)


class RecordingQueue(ReplayQueue):
  def __init__(self, *a, **k):
    super().__init__(*a, **k)
    self.pushed = []

  def put(self, trajectories, claim=None, timeout=None):
    self.pushed.append(list(trajectories))
    super().put(trajectories, claim=claim, timeout=timeout)


def run_pool(pool, until, timeout=20.0):
  """Runs the pool on a fresh loop until `until()` holds, then stops it; returns stop seconds."""
  async def main():
    task = asyncio.create_task(pool.run())
    t0 = time.monotonic()
    while not until() and time.monotonic() - t0 < timeout:
      await asyncio.sleep(0.01)
    t1 = time.monotonic()
    pool.stop()
    await task
    return time.monotonic() - t1
  return asyncio.run(main())


def add_tasks(queue, n):
  for i, t in enumerate(tasks(n)):
    queue.add_work(i, WorkItem(i, t).to_dict())


def test_engine_errors_are_retried_requeued_then_infra_error_never_reward_zero():
  always = tuple(Tokenizer().apply_chat_template([{"content": "3+3="}]))
  engine = FakeEngine(fail=lambda key, nth: key == (always,) or nth == 1)
  q = RecordingQueue(ReplayConfig(max_staleness=None), group_size=G)
  add_tasks(q, 6)
  pool = pool_of(q, engine, RetryConfig(max_retries=2, backoff_s=0.001, max_requeues=1),
                 concurrency=3)
  run_pool(pool, lambda: pool.counters["groups"] == 6)
  by_task = {g[0].task_id: g for g in q.pushed}
  assert sorted(by_task) == [f"t{i}" for i in range(6)]
  for tid, group in by_task.items():
    assert len(group) == G and len({t.group_id for t in group}) == 1
    if tid == "t3":       # every attempt failed: infra_error, no reward at all
      assert all(t.status is Status.INFRA_ERROR and t.reward is None for t in group)
      assert "engine unreachable" in group[0].metrics["error"]
    else:                 # first attempt failed, the retry worked
      assert all(t.status is Status.OK and t.reward is not None for t in group)
      assert all(t.metrics["attempt"] == 1 for t in group)
  assert by_task["t3"][0].metrics["requeues"] == 1   # requeued once, then given up
  assert engine.calls[(always,)] == 2 * 3             # (1 + 2 retries) before and after the requeue
  c = pool.counters
  assert (c["engine_errors"], c["retries"], c["requeued"], c["given_up"]) == (5 + 6, 5 + 4, 1, 1)
  s = q.stats()
  assert s["replay/dropped_infra"] == G and s["replay/generated"] == 6 * G
  assert s["replay/total/unaccounted"] == 0


def test_slow_engine_back_pressure_and_prompt_graceful_shutdown():
  engine = FakeEngine(delay=0.15)
  q = ReplayQueue(ReplayConfig(capacity=3, max_staleness=None), group_size=G)
  add_tasks(q, 20)
  pool = pool_of(q, engine, concurrency=4, shutdown_grace_s=5.0)
  seen = []

  def until():
    d = q.depth()
    seen.append(d["ready_groups"] + d["in_flight"])
    return d["ready_groups"] == 3
  run_pool(pool, until)
  assert max(seen) <= 3                           # never more than capacity started or waiting
  time.sleep(0.3)
  assert q.depth()["ready_groups"] == 3           # producers wait: nobody consumed
  # graceful: episodes in flight at stop() finish and are pushed, none is cancelled
  got = q.get(2)
  pool2 = pool_of(q, engine, concurrency=4, shutdown_grace_s=5.0)
  run_pool(pool2, lambda: q.depth()["in_flight"] == 2)
  assert pool2.counters["cancelled_episodes"] == 0 and q.depth()["in_flight"] == 0
  d = q.depth()
  assert len(got) + d["ready_groups"] + d["backlog"] == 20


def test_shutdown_does_not_hang_on_a_stuck_engine():
  release = threading.Event()
  engine = FakeEngine(block=release)
  q = ReplayQueue(ReplayConfig(capacity=8, max_staleness=None), group_size=G)
  add_tasks(q, 5)
  pool = pool_of(q, engine, concurrency=2, shutdown_grace_s=0.2)
  try:
    stop_s = run_pool(pool, lambda: q.depth()["in_flight"] == 2)
    assert stop_s < 2.0
    assert pool.counters["cancelled_episodes"] == 2
    d = q.depth()                                 # the cancelled work is back in the backlog
    assert d["in_flight"] == 0 and d["backlog"] == 5 and d["ready_groups"] == 0
  finally:
    release.set()


def test_async_rollouts_versions_staleness_and_resume_without_loss():
  engine = FakeEngine(delay=0.02)
  replay = ReplayConfig(capacity=16, max_staleness=1)
  params = {"w": jnp.ones((4, 4))}
  src = AsyncRollouts(episode(engine), tasks(), G, prompts_per_step=2, replay=replay,
                      pool=PoolConfig(concurrency=2))
  trained = []
  try:
    for v in range(4):
      src.update_weights(params, v)
      got_tasks, trajs = src.collect(v)
      assert len(got_tasks) == 2 and len(trajs) == 2 * G
      for t in trajs:
        versions = {x for x in t.policy_version if x >= 0}
        assert versions and max(versions) <= v and v - min(versions) <= 1
      trained += [t.id for t in trajs]
      m = src.metrics()
      assert 0.0 <= m["pool/engine_idle_frac"] <= 1.0 and m["replay/total/unaccounted"] == 0
      assert m["weight_sync/gb"] == pytest.approx(64e-9)
    state = src.state()
  finally:
    src.close()
  assert not src._thread.is_alive()
  # what the saved state holds, plus what was trained, covers every draw once
  queued = [t["id"] for g in state["queue"]["ready"] for t in g["trajectories"]]
  backlog = [k for k, _ in state["queue"]["backlog"]]
  draws = sorted([int(i.split("/")[0]) for i in trained + queued][::G] + backlog)
  assert len(set(trained + queued)) == len(trained + queued)
  assert draws == list(range(state["next_draw"]))
  # resume (as the trainer does, at the next version): the saved groups are trained or dropped
  # as stale (counted), the unfinished work is re-run under the same group ids, new draws go on
  resumed = AsyncRollouts(episode(FakeEngine()), tasks(start=state["next_draw"]), G,
                          prompts_per_step=2, replay=replay, pool=PoolConfig(concurrency=2))
  resumed.restore(state)
  after = []
  try:
    for v in (4, 5):
      resumed.update_weights(params, v)
      after += [t.id for t in resumed.collect(v)[1]]
    end = resumed.state()
  finally:
    resumed.close()
  end_ids = set(after) | {t["id"] for g in end["queue"]["ready"] for t in g["trajectories"]}
  end_backlog = {k for k, _ in end["queue"]["backlog"]}
  saved_ids = set(queued) | {f"{k}/t{k}/{j}" for k in backlog for j in range(G)}
  assert len(after) == len(set(after)) and not set(after) & set(trained)
  missing = {i for i in saved_ids - end_ids if int(i.split("/")[0]) not in end_backlog}
  stale = end["queue"]["total"]["dropped_stale"] - state["queue"]["total"]["dropped_stale"]
  assert len(missing) == stale                    # nothing saved vanished without a count
  totals = resumed.metrics()
  assert totals["replay/total/unaccounted"] == 0
  assert totals["replay/total/trained"] == len(trained) + len(after)
