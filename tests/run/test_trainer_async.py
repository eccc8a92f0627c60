"""The async RL run end to end (tiny model, embedded JAX sampler): bounded staleness, drop
accounting that adds up at every step, off-policy metrics, and a resume mid-run that loses and
duplicates no trajectory."""
import collections
import itertools
import threading

import pytest

from posttrain_jax.actors.pool import AsyncRollouts
from posttrain_jax.engines.base import EngineError
from posttrain_jax.engines.jax_sampler import JaxSampler
from posttrain_jax.metrics import read_metrics
from posttrain_jax.replay import ReplayQueue
from posttrain_jax.run import Trainer
from tests.support.runs import G, P, async_run





@pytest.fixture
def ledger(monkeypatch):
  """Records every trajectory trained (collect) and dropped (queue), and where the ledger stood
  each time the source state was taken for a checkpoint."""
  log = {"trained": [], "dropped": [], "saves": []}
  collect, drop, state = AsyncRollouts.collect, ReplayQueue._drop, AsyncRollouts.state

  def rec_collect(self, step):
    tasks, trajs = collect(self, step)
    log["trained"].append([t.id for t in trajs])
    return tasks, trajs

  def rec_drop(self, reason, trajectories):
    log["dropped"] += [(t.id, reason) for t in trajectories]
    drop(self, reason, trajectories)

  def rec_state(self):
    s = state(self)
    log["saves"].append((len(log["trained"]), len(log["dropped"]), s))
    return s

  # every 4th engine call of the actor pool fails (evaluation is left alone): with no retries
  # these groups become infra_error and are dropped, so the accounting has drops to count
  generate, calls = JaxSampler.generate, itertools.count(1)

  def flaky_generate(self, *a, **k):
    if threading.current_thread().name == "actor-episode" and next(calls) % 4 == 0:
      raise EngineError("injected engine failure")
    return generate(self, *a, **k)

  monkeypatch.setattr(JaxSampler, "generate", flaky_generate)
  monkeypatch.setattr(AsyncRollouts, "collect", rec_collect)
  monkeypatch.setattr(ReplayQueue, "_drop", rec_drop)
  monkeypatch.setattr(AsyncRollouts, "state", rec_state)
  return log


@pytest.mark.slow  # > 30 s: CI's slow stage
def test_async_run_resume_loses_and_duplicates_nothing(tmp_path, ledger):
  quiet = lambda *_: None
  assert Trainer(async_run(tmp_path, stop_after_step=2), log=quiet).run() is None
  n_trained1, n_dropped1, saved1 = ledger["saves"][-1]
  trained1 = [i for step in ledger["trained"][:n_trained1] for i in step]
  dropped1 = ledger["dropped"][:n_dropped1]
  assert n_trained1 == 2
  ledger["trained"].clear(), ledger["dropped"].clear(), ledger["saves"].clear()

  result = Trainer(async_run(tmp_path), log=quiet).run()
  assert result is not None
  n_trained2, n_dropped2, saved2 = ledger["saves"][-1]
  trained2 = [i for step in ledger["trained"][:n_trained2] for i in step]
  dropped2 = ledger["dropped"][:n_dropped2]
  assert n_trained2 == 3                       # steps 3..5 after the resume

  # 1. no trajectory twice: trained, dropped, or still queued, across the resume
  queued2 = [t["id"] for g in saved2["queue"]["ready"] for t in g["trajectories"]]
  everything = trained1 + [i for i, _ in dropped1] + trained2 + [i for i, _ in dropped2] + queued2
  assert len(everything) == len(set(everything))
  # 2. none lost: every task drawn has its whole group accounted for, or is unfinished work
  by_draw = collections.Counter(int(i.split("/")[0]) for i in everything)
  backlog2 = {k for k, _ in saved2["queue"]["backlog"]}
  assert all(n == G for n in by_draw.values())
  assert set(by_draw) | backlog2 == set(range(saved2["next_draw"]))
  assert not set(by_draw) & backlog2
  # 3. the groups saved at the stop were neither lost nor re-generated as new draws
  saved_ids = {t["id"] for g in saved1["queue"]["ready"] for t in g["trajectories"]}
  assert saved_ids <= set(trained2) | {i for i, _ in dropped2} | set(queued2)
  # 4. the checkpointed counters continued across the resume and add up
  total = saved2["queue"]["total"]
  assert total["trained"] == len(trained1) + len(trained2) == 5 * P * G
  drops = collections.Counter(r for _, r in dropped1 + dropped2)
  assert drops["infra"] >= G                   # the injected failures were dropped, counted
  for reason in ("stale", "infra", "filter"):
    assert total[f"dropped_{reason}"] == drops[reason]
  assert total["generated"] == total["trained"] + sum(drops.values()) + len(queued2)

  rows = {r["step"]: r for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r}
  assert sorted(rows) == [1, 2, 3, 4, 5]
  for step, r in rows.items():
    assert r["replay/total/unaccounted"] == 0
    assert r["replay/trained"] == P * G
    assert r["replay/staleness_max"] <= 1          # max_staleness
    assert 0.0 <= r["pool/engine_idle_frac"] <= 1.0
    assert r["weight_sync/s"] >= 0 and r["weight_sync/gb"] > 0
    for k in ("replay/gen_len_mean", "replay/trained_len_p90", "replay/dropped_stale",
              "replay/queued", "correction/abs_logp_diff", "correction/is_weight_mean"):
      assert k in r, k
  # learner == sampler numerics at version 0, so at step 1 (on-policy data) the mismatch is ~0
  assert rows[1]["correction/abs_logp_diff"] < 1e-4
