"""The single-turn held-out eval reports, beside the accuracy, what tells a learned task from a
collapse onto one frequent answer: the share of replies that are the most common one, and what
one answer to every task would score (counted from the tasks' reference answers)."""
import pytest

from posttrain_jax.actors.rollout import RolloutConfig, TaskEpisode, _evaluate
from posttrain_jax.engines.base import Completion
from posttrain_jax.tasks import Task
from tests.support.fake_engine import Tokenizer, grader


class Replies:
  """An engine whose k-th completion of a call has `lengths[k]` tokens (Tokenizer decodes a
  completion to its length, so the reply text is that number)."""

  def __init__(self, lengths):
    self.lengths, self.version = lengths, 0

  def generate(self, prompts, sampling, n=1, seed=None):
    it = iter(self.lengths)
    return [[_completion(next(it)) for _ in range(n)] for _ in prompts]


def _completion(length):
  return Completion(token_ids=[5] * length, logprobs=[-1.0] * length, finish_reason="stop",
                    version=0)


def _eval(lengths, answers):
  tasks = [Task(id=f"t{i}", prompt=f"q{i}", answer=a) for i, a in enumerate(answers)]
  ep = TaskEpisode(Replies(lengths), Tokenizer(), grader, RolloutConfig(max_tokens=8), [1])
  return _evaluate(ep, tasks, temperature=0.0, n=1, max_tokens=8, seed=0)


def test_a_collapsed_policy_shows_one_reply_and_the_constant_baseline():
  out = _eval([3, 3, 3, 3, 3], ["2", "2", "7", "2", "9"])
  assert out["accuracy"] == 1.0          # the fake grader: odd replies score 1
  assert out["top_reply_frac"] == 1.0    # one reply to every task
  assert out["constant_baseline"] == pytest.approx(3 / 5)   # "2" answers 3 of 5
  assert out["count"] == 5 and out["solved_frac"] == 1.0


def test_varied_replies_and_a_task_with_an_empty_answer():
  out = _eval([1, 2, 3, 3], ["4", "", "5", "6"])
  assert out["top_reply_frac"] == pytest.approx(2 / 4)
  assert out["constant_baseline"] == pytest.approx(1 / 3)   # the task with an empty answer left out
  assert out["accuracy"] == pytest.approx(3 / 4)
  assert out["solved_frac"] == pytest.approx(3 / 4)   # the fake grader scores 0 or 1


def test_partial_credit_counts_in_the_accuracy_not_in_solved():
  from posttrain_jax.graders import GradeResult

  def by_letter(text, task):   # a reply of the right length scores 1, one shorter 0.5
    short = int(text) == int(task.answer) - 1
    return GradeResult(reward=1.0 if text == task.answer else 0.5 if short else 0.0)
  tasks = [Task(id=f"t{i}", prompt=f"q{i}", answer=a) for i, a in enumerate(["3", "4", "5"])]
  ep = TaskEpisode(Replies([3, 3, 3]), Tokenizer(), by_letter, RolloutConfig(max_tokens=8), [1])
  out = _evaluate(ep, tasks, temperature=0.0, n=1, max_tokens=8, seed=0)
  assert out["accuracy"] == pytest.approx((1.0 + 0.5 + 0.0) / 3)
  assert out["solved_frac"] == pytest.approx(1 / 3)


def test_a_shard_without_tasks_reports_every_key():
  """Every process must report the same keys (the eval averages each with one collective)."""
  out = _eval([], [])
  assert set(out) == {"accuracy", "count", "solved_frac", "top_reply_frac", "constant_baseline"}
  assert out["count"] == 0 and all(out[k] != out[k] for k in out if k != "count")   # NaN
