"""Replay queue: back-pressure, staleness (admission and drops), complete groups, accounting
that adds up under a random workload, length statistics, and state/restore."""
import json
import random
import threading
import time

import numpy as np
import pytest

from posttrain_jax.replay import (GROUP_FILTERS, QueueClosed, ReplayConfig, ReplayQueue,
                                  register_group_filter)
from posttrain_jax.types import Status, Trajectory


def traj(gid, j, reward=1.0, version=0, length=3, status=Status.OK, versions=None):
  versions = versions or [version] * length
  n = len(versions)
  return Trajectory(id=f"{gid}/{j}", task_id=gid, group_id=gid, token_ids=[1, 2] + [5] * n,
                    loss_mask=[0, 0] + [1] * n, behaviour_logprobs=[0.0, 0.0] + [-1.0] * n,
                    policy_version=[-1, -1] + list(versions),
                    reward=None if status is Status.INFRA_ERROR else reward, status=status)


def group(gid, rewards=(0.0, 1.0), version=0, length=3, infra=()):
  return [traj(gid, j, r, version, length, Status.INFRA_ERROR if j in infra else Status.OK)
          for j, r in enumerate(rewards)]


def test_config_errors_name_the_field():
  with pytest.raises(ValueError, match="ReplayConfig.capacity"):
    ReplayConfig(capacity=0)
  with pytest.raises(ValueError, match="ReplayConfig.max_staleness"):
    ReplayConfig(max_staleness=-1)
  with pytest.raises(KeyError, match="unknown group filter 'dapo'.*zero_variance"):
    ReplayConfig(filter="dapo")
  with pytest.raises(ValueError, match="ReplayConfig.order"):
    ReplayConfig(order="lifo")


def test_put_waits_when_full_and_resumes_when_consumed():
  q = ReplayQueue(ReplayConfig(capacity=2, max_staleness=None))
  q.put(group("a"))
  q.put(group("b"))
  with pytest.raises(TimeoutError, match="capacity"):
    q.put(group("c"), timeout=0.05)
  done = threading.Event()

  def producer():
    q.put(group("c"))
    done.set()

  th = threading.Thread(target=producer)
  th.start()
  time.sleep(0.2)
  assert not done.is_set()            # blocked: 2 ready groups = capacity
  assert [g.group_id for g in q.get(1)] == ["a"]
  assert done.wait(2.0)               # room freed -> the producer got in
  th.join()
  assert [g.group_id for g in q.get(2)] == ["b", "c"]


def test_claims_reserve_room_and_never_exceed_capacity():
  q = ReplayQueue(ReplayConfig(capacity=3, max_staleness=None))
  for k in range(5):
    q.add_work(k, {"k": k})
  assert [k for k, _ in q.try_claim(2)] == [0, 1]
  q.put(group("x"))                   # unclaimed producer takes the third slot
  assert q.try_claim(5) == []         # 2 in flight + 1 ready = capacity
  assert q.claim(1, timeout=0.05) == []
  q.put(group("g0"), claim=0)         # releasing a claim never waits, even when full
  assert q.depth()["in_flight"] == 1 and q.depth()["ready_groups"] == 2
  q.get(2)
  assert [k for k, _ in q.try_claim(5)] == [2, 3]
  q.unclaim([3])
  assert [k for k, _ in q.try_claim(1)] == [3]   # back at the front of the backlog
  with pytest.raises(KeyError, match="not in flight"):
    q.put(group("g0"), claim=0)


def test_staleness_admission_bounds_work_ahead_of_the_learner():
  """c + A < (S + 1)·P with P = 2 groups per step, S = 1, c consumed at the current version."""
  q = ReplayQueue(ReplayConfig(capacity=100, max_staleness=1), groups_per_step=2)
  q.set_version(7)                     # versions need not start at 0
  assert q.admissible() == 4           # two steps' worth
  for k in range(10):
    q.add_work(k, {})
  items = q.try_claim(10)
  assert len(items) == 4
  for k, _ in items:
    q.put(group(f"g{k}", version=7), claim=k)
  assert q.admissible() == 0
  assert len(q.get(2)) == 2            # this step consumes 2: still 2 ready, c = 2
  assert q.admissible() == 0
  q.set_version(8)
  assert q.admissible() == 2           # (1 + 1)·2 − 0 − 2
  q2 = ReplayQueue(ReplayConfig(capacity=100, max_staleness=1, admission=False), groups_per_step=2)
  assert q2.admissible() == 100


def test_stale_groups_are_dropped_at_delivery_by_their_oldest_token():
  q = ReplayQueue(ReplayConfig(max_staleness=2, order="fifo"))
  q.put(group("v0", version=0))
  q.put([traj("mixed", 0, 1.0, versions=[3, 1, 3]), traj("mixed", 1, 0.0, version=3)])
  q.put(group("v2", version=2))
  q.set_version(3)                     # v0 is 3 behind: dropped now (frees room)
  s = q.stats(reset_window=False)
  assert s["replay/dropped_stale"] == 2 and s["replay/dropped_groups_stale"] == 1
  q.set_version(4)                     # "mixed" has a token from version 1: 3 behind
  got = q.get(5, timeout=0)
  assert [g.group_id for g in got] == ["v2"] and got[0].staleness == 2
  s = q.stats()
  assert s["replay/dropped_stale"] == 4 and s["replay/staleness_max"] == 2


def test_groups_are_released_complete_and_infra_members_never_delivered():
  q = ReplayQueue(ReplayConfig(min_scored=2, max_staleness=None), group_size=3)
  a = group("a", rewards=(0.0, 1.0, 1.0))
  q.put(a[:1])
  q.put(a[1:2])
  assert q.get(1, timeout=0) == []     # 2 of 3 members: not released
  assert q.depth()["incomplete_groups"] == 1
  q.put(a[2:])
  (g,) = q.get(1, timeout=0)
  assert [t.id for t in g.trajectories] == ["a/0", "a/1", "a/2"]
  # one infra member: dropped as "infra"; the other two are still a group
  q.put(group("b", rewards=(0.0, 1.0, 0.5), infra=(1,)))
  (g,) = q.get(1, timeout=0)
  assert [t.id for t in g.trajectories] == ["b/0", "b/2"]
  # two infra members: one scored left < min_scored -> the whole group goes, all as "infra"
  q.put(group("c", rewards=(0.0, 1.0, 0.5), infra=(0, 2)))
  assert q.get(1, timeout=0) == []
  s = q.stats()
  assert s["replay/dropped_infra"] == 1 + 3 and s["replay/dropped_groups_infra"] == 1
  assert s["replay/trained"] == 5 and s["replay/generated"] == 9
  # a trajectory without group id is a group of one
  single = traj("x", 0)
  single.group_id = None
  q.put([single])
  assert [g.trajectories[0].id for g in q.get(1, timeout=0)] == ["x/0"]


def test_oldest_first_serves_slow_groups_before_they_go_stale():
  q = ReplayQueue(ReplayConfig(max_staleness=None, order="oldest_first"))
  q.put(group("fast1", version=2))
  q.put(group("slow", version=0))
  q.put(group("fast2", version=2))
  assert [g.group_id for g in q.get(3)] == ["slow", "fast1", "fast2"]
  q = ReplayQueue(ReplayConfig(max_staleness=None, order="fifo"))
  q.put(group("fast1", version=2))
  q.put(group("slow", version=0))
  assert [g.group_id for g in q.get(2)] == ["fast1", "slow"]


def test_accounting_adds_up_under_a_random_workload():
  """generated = trained + stale + infra + filter + queued, checked against a plain count."""
  rng = random.Random(0)
  q = ReplayQueue(ReplayConfig(capacity=1000, max_staleness=1, filter="zero_variance",
                               min_scored=2), group_size=4)
  expect = {"generated": 0, "trained": 0, "stale": 0, "infra": 0, "filter": 0}
  version = 0
  ready = []                            # our own model of the ready list: (version, ids)
  for i in range(300):
    r = rng.random()
    if r < 0.6:
      v = max(0, version - rng.randint(0, 2))
      rewards = [rng.choice([0.0, 1.0]) for _ in range(4)]
      infra = {j for j in range(4) if rng.random() < 0.15}
      g = group(f"g{i}", rewards=rewards, version=v, infra=infra)
      q.put(g)
      expect["generated"] += 4
      expect["infra"] += len(infra)
      scored = [t for t in g if t.status is Status.OK]
      if len(scored) < 2:
        expect["infra"] += len(scored)
      elif len({t.reward for t in scored}) == 1:
        expect["filter"] += len(scored)
      else:
        ready.append((v, len(scored)))
    elif r < 0.8:
      version += 1
      q.set_version(version)
    else:
      n = rng.randint(1, 3)
      got = q.get(n, timeout=0)
      expect["trained"] += sum(len(g.trajectories) for g in got)
      for g in got:
        assert version - g.version <= 1
  # every group not delivered was either dropped stale or is still queued
  q.set_version(version)
  s = q.stats(reset_window=False)
  queued = s["replay/queued"]
  stale = s["replay/total/dropped_stale"]
  assert s["replay/total/generated"] == expect["generated"]
  assert s["replay/total/trained"] == expect["trained"]
  assert s["replay/total/dropped_infra"] == expect["infra"]
  assert s["replay/total/dropped_filter"] == expect["filter"]
  assert stale > 0 and expect["filter"] > 0 and expect["infra"] > 0   # the test exercised all
  assert expect["trained"] + stale + queued == sum(n for _, n in ready)
  assert s["replay/total/unaccounted"] == 0
  assert (s["replay/total/generated"] == s["replay/total/trained"] + stale
          + s["replay/total/dropped_infra"] + s["replay/total/dropped_filter"] + queued)


def test_custom_filter_is_counted():
  name = "test_drop_short"
  if name not in GROUP_FILTERS:
    register_group_filter(name)(lambda members: min(len(t.token_ids) for t in members) > 5)
  q = ReplayQueue(ReplayConfig(filter=name, max_staleness=None))
  q.put(group("short", length=2))
  q.put(group("long", length=6))
  assert [g.group_id for g in q.get(2, timeout=0)] == ["long"]
  s = q.stats()
  assert s["replay/dropped_filter"] == 2 and s["replay/dropped_groups_filter"] == 1


def test_length_stats_of_generated_and_trained():
  q = ReplayQueue(ReplayConfig(max_staleness=1), group_size=2)
  lengths = [1, 2, 3, 4, 10, 20]
  for i, n in enumerate(lengths):
    q.put(group(f"g{i}", version=0 if n < 10 else 5, length=n))
  q.put(group("bad", infra=(0, 1), length=7))   # infra: not counted as generated length
  q.set_version(6)                     # the short groups (v0) are stale, the long ones (v5) not
  got = q.get(10, timeout=0)
  assert sorted(len(g.trajectories[0].token_ids) - 2 for g in got) == [10, 20]
  s = q.stats()
  gen = np.repeat(lengths, 2)
  assert s["replay/gen_len_mean"] == pytest.approx(gen.mean())
  assert s["replay/gen_len_p50"] == np.percentile(gen, 50, method="inverted_cdf")
  assert s["replay/gen_len_p90"] == np.percentile(gen, 90, method="inverted_cdf")
  assert s["replay/trained_len_mean"] == 15.0 and s["replay/trained_len_p90"] == 20.0
  s2 = q.stats()                        # the window was reset; totals were not
  assert s2["replay/generated"] == 0 and s2["replay/total/generated"] == 14
  assert np.isnan(s2["replay/gen_len_mean"]) and s2["replay/total/gen_len_mean"] == gen.mean()


def test_state_restore_round_trip_through_json():
  cfg = ReplayConfig(capacity=20, max_staleness=2, filter="zero_variance")
  q = ReplayQueue(cfg, group_size=2, groups_per_step=2)
  for k in range(6):
    q.add_work(k, {"draw": k})
  claimed = q.try_claim(3)
  q.put(group("a", version=0), claim=claimed[0][0])
  q.put(group("b", rewards=(1.0, 1.0)), claim=claimed[1][0])   # filtered
  q.put(group("c", version=1))
  q.put(group("d")[:1])                                         # incomplete
  q.get(1)
  q.set_version(1)
  saved = json.loads(json.dumps(q.state()))
  r = ReplayQueue(cfg, group_size=2, groups_per_step=2)
  r.restore(saved)
  before, after = q.stats(reset_window=False), r.stats(reset_window=False)
  assert before["replay/in_flight_groups"] == 1 and after["replay/in_flight_groups"] == 0
  assert after["replay/backlog_groups"] == before["replay/backlog_groups"] + 1
  for k in before:
    if "in_flight" not in k and "backlog" not in k:
      np.testing.assert_equal(after[k], before[k], err_msg=k)
  # the claim still in flight comes back as backlog, first in line, then the rest
  assert [k for k, _ in r.state()["backlog"]] == [2, 3, 4, 5]
  assert [k for k, _ in r.try_claim(1)] == [2]
  r2 = ReplayQueue(cfg, group_size=2, groups_per_step=2)
  r2.restore(saved)
  r2.put(group("d")[1:])                                        # completes the saved half group
  got = r2.get(5, timeout=0)
  assert [g.group_id for g in got] == ["d", "c"]                 # oldest version first
  assert got[1].trajectories[0].to_dict() == group("c", version=1)[0].to_dict()
  with pytest.raises(RuntimeError, match="fresh queue"):
    r2.restore(saved)


def test_close_wakes_waiters():
  q = ReplayQueue(ReplayConfig(capacity=1))
  q.put(group("a"))
  errors = []

  def producer():
    try:
      q.put(group("b"))
    except QueueClosed as e:
      errors.append(e)

  th = threading.Thread(target=producer)
  th.start()
  time.sleep(0.05)
  q.close()
  th.join(2.0)
  assert not th.is_alive() and errors
  assert [g.group_id for g in q.get(5)] == ["a"]   # what was ready is still delivered
