"""Failure semantics of the rollout sources: every finish reason mapped explicitly (an aborted
completion is never graded), an engine outage longer than two fast retries is ridden out
(retries with backoff, then requeue) instead of turning tasks into drops, a prompt the engine
can never serve is its own counted drop, and a step with nothing trainable leaves the weights."""
import numpy as np
import pytest

from posttrain_jax.actors.episode import RetryConfig
from posttrain_jax.actors.rollout import FINISH_STATUS, RolloutConfig, SyncRollouts, TaskEpisode
from posttrain_jax.advantages import AdvantageConfig
from posttrain_jax.batching import BatchConfig
from posttrain_jax.engines.base import Completion, PromptTooLongError
from posttrain_jax.learner import Learner, LearnerConfig, OptimizerConfig
from posttrain_jax.models import hf_io
from posttrain_jax.run.rl_step import rl_step
from posttrain_jax.types import Status
from tests.support.fake_engine import FakeEngine, Tokenizer, grader, tasks

G = 3


def source(engine, retry=RetryConfig(backoff_s=0.0), prompts=2):
  ep = TaskEpisode(engine, Tokenizer(), grader, RolloutConfig(group_size=G, max_tokens=6), [1])
  return SyncRollouts(ep, tasks(), G, prompts, retry=retry, sleep=lambda s: None)


class Scripted(FakeEngine):
  """FakeEngine whose completions take finish reasons from `reasons` in turn."""

  def __init__(self, reasons, **kw):
    super().__init__(**kw)
    self.reasons = list(reasons)

  def generate(self, prompts, sampling, n=1, seed=None):
    out = super().generate(prompts, sampling, n, seed)
    k = 0
    for group in out:
      for c in group:
        c.finish_reason = self.reasons[k % len(self.reasons)]
        k += 1
    return out


def test_every_finish_reason_is_mapped_and_abort_is_never_graded():
  assert FINISH_STATUS == {"stop": Status.OK, "length": Status.TRUNCATED,
                           "abort": Status.INFRA_ERROR, "error": Status.INFRA_ERROR}
  src = source(Scripted(["stop", "abort", "length", "weird", "stop", "error"]))
  _, trajs = src.collect(0)
  by_reason = {t.metrics["finish_reason"]: t for t in trajs}
  assert by_reason["stop"].status is Status.OK and by_reason["stop"].reward is not None
  assert by_reason["length"].status is Status.TRUNCATED
  for reason in ("abort", "weird", "error"):
    t = by_reason[reason]
    assert t.status is Status.INFRA_ERROR and t.reward is None, reason
    assert reason in t.metrics["error"]


def test_an_outage_is_retried_with_backoff_not_dropped():
  """The engine is down for the first 5 calls (a server restart): with the old two fast
  retries every task of the first steps became an infra drop; now the batch is retried after
  growing waits and every trajectory is trained."""
  calls = {"n": 0}

  class Down(FakeEngine):
    def generate(self, *a, **k):
      calls["n"] += 1
      if calls["n"] <= 5:
        raise ConnectionError("connection refused")
      return super().generate(*a, **k)

  waits = []
  src = source(Down(), RetryConfig())              # the defaults
  src._sleep = waits.append
  _, trajs = src.collect(0)
  assert len(trajs) == 2 * G and all(t.status is Status.OK for t in trajs)
  assert waits == [1.0, 2.0, 4.0, 8.0, 16.0] and RetryConfig().delay(7) == 16.0
  m = src.metrics()
  assert (m["rollout/engine_errors"], m["rollout/retries"], m["rollout/requeued"]) == (5, 5, 0)


def test_tasks_that_fail_every_attempt_are_requeued_then_given_up():
  engine = FakeEngine(fail=lambda key, nth: True)
  src = source(engine, RetryConfig(max_retries=1, backoff_s=0.0, max_requeues=1))
  tasks0, trajs = src.collect(0)
  assert all(t.status is Status.INFRA_ERROR and t.reward is None for t in trajs)
  assert [t.id for t in tasks0] == ["t0", "t1"]
  tasks1, _ = src.collect(1)                       # requeued tasks run first
  assert [t.id for t in tasks1] == ["t0", "t1"]
  tasks2, _ = src.collect(2)                       # given up: new tasks now
  assert [t.id for t in tasks2] == ["t2", "t3"]
  m = src.metrics()
  assert (m["rollout/requeued"], m["rollout/given_up"]) == (2 + 2, 2)  # t2, t3 requeued too
  state = src.state()                              # requeued work is checkpointed
  again = source(engine, RetryConfig(max_retries=1, backoff_s=0.0, max_requeues=1))
  again.restore(state)
  assert again.state() == state


def test_a_prompt_the_engine_cannot_serve_is_an_invalid_drop_not_infra():
  class Short(FakeEngine):
    def generate(self, prompts, sampling, n=1, seed=None):
      for i, p in enumerate(prompts):
        if len(p) > 4:
          raise PromptTooLongError(i, f"prompt {i} has {len(p)} tokens > 4")
      return super().generate(prompts, sampling, n, seed)

  src = source(Short(), prompts=12)     # prompts "0+0=" .. "9+9=" have 4 tokens, "10+10=" 6
  got, trajs = src.collect(0)
  assert [t.id for t in got] == [f"t{i}" for i in range(10)]
  assert all(t.status is Status.OK for t in trajs)
  m = src.metrics()
  assert m["rollout/invalid"] == 2 and m["rollout/engine_errors"] == 0


class _Source:
  """A rollout source whose second step brings only infra errors."""

  def __init__(self, inner):
    self.inner, self.n = inner, 0

  def update_weights(self, params, version):
    self.inner.update_weights(params, version)

  def collect(self, step):
    self.n += 1
    got, trajs = self.inner.collect(step)
    if self.n == 2:
      for t in trajs:
        t.status, t.reward = Status.INFRA_ERROR, None
    return got, trajs

  def metrics(self):
    return {}


def test_a_step_with_nothing_trainable_does_not_move_the_weights(tmp_path):
  from posttrain_jax.models.tiny import build_tiny_model
  from tests.support.runs import tiny_run
  model = hf_io.load_hf_model(build_tiny_model(tiny_run(tmp_path).model.tiny))
  learner = Learner(model, LearnerConfig(optimizer=OptimizerConfig(learning_rate=1e-2)))
  src = _Source(source(FakeEngine(), prompts=2))
  kw = dict(advantage=AdvantageConfig(), batch_cfg=BatchConfig(rows=8, seq_len=32, max_seqs=8,
                                                                 pack=False))
  first = rl_step(learner, src, step=0, version=0, **kw)
  assert first.updated
  before = {k: np.asarray(v) for k, v in _flat(learner.params).items()}
  second = rl_step(learner, src, step=1, version=1, **kw)
  assert not second.updated and second.metrics["skipped_update"] == 1.0
  after = _flat(learner.params)
  for k in before:
    np.testing.assert_array_equal(before[k], np.asarray(after[k]), err_msg=k)
  assert second.metrics["infra_error_frac"] == pytest.approx(1.0)


def _flat(tree):
  import jax
  return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
