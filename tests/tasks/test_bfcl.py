"""Task source + grader "bfcl" against bfcl-eval's own data and AST checker: the calls written
from each entry's own possible answer score 1 (in any order for parallel), a wrong value 0 with
BFCL's error type, prose or broken syntax 0 with parse_ok False; the prompt is BFCL's own
system prompt for prompting models; mistakes are one error naming them."""
import json
import sys

import pytest

pytest.importorskip("bfcl_eval")

from posttrain_jax.errors import UserError  # noqa: E402
from posttrain_jax.graders import grade  # noqa: E402
from posttrain_jax.tasks import bfcl  # noqa: E402
from posttrain_jax.tasks.bank import TaskBank, TaskBankConfig  # noqa: E402


def _bank(cats, **kw):
  return TaskBank(TaskBankConfig(dataset=f"bfcl:{cats}", eval_fraction=0.3, eval_size=10_000,
                                 **kw))


def _all(bank):
  return bank.eval_tasks() + [bank.train_source[i] for i in range(len(bank.train_source))]


def _pick(value):
  """A value from a possible answer: in a dict each key lists its allowed values (take the
  first; "" first = optional, left out), recursively; a list of such dicts, each."""
  if isinstance(value, dict):
    return {k: _pick(v[0]) for k, v in value.items() if v and v[0] != ""}
  if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
    return [_pick(v) for v in value]
  return value


def _calls(ground_truth, reverse=False):
  """BFCL's prompting format written from the possible answer: the first allowed value of each
  parameter ("" first = optional, left out)."""
  out = []
  for call in ground_truth:
    (name, params), = call.items()
    args = [f"{k}={_pick(v[0])!r}" for k, v in params.items() if v and v[0] != ""]
    out.append(f"{name}({', '.join(args)})")
  return "[" + ", ".join(reversed(out) if reverse else out) + "]"


def test_split_counts_and_the_prompt_is_bfcls():
  bank = _bank("simple+multiple+parallel+parallel_multiple")
  ids = [t.id for t in _all(bank)]
  assert len(ids) == len(set(ids)) == 400 + 200 + 200 + 200  # BFCL v4's counts
  task = bank.eval_tasks()[0]
  entry = next(e for c in bfcl.CATEGORIES for e in bfcl.entries(c) if e["id"] == task.id)
  assert task.messages[0]["role"] == "system"
  assert "[func_name1(params_name1=params_value1" in task.messages[0]["content"]
  assert entry["function"][0]["name"] in task.messages[0]["content"]
  assert task.messages[1:] == entry["question"][0]
  assert json.loads(task.answer) == entry["possible_answer"]


@pytest.mark.parametrize("cats", ["simple", "multiple", "parallel", "parallel_multiple"])
def test_the_possible_answer_scores_1_and_a_wrong_value_0(cats):
  tasks = _all(_bank(cats))
  rejected = []
  for task in tasks:
    truth = json.loads(task.answer)
    r = grade("bfcl", _calls(truth, reverse="parallel" in cats), task)
    if r.reward != 1.0:
      rejected.append((task.id, r.info.get("feedback"), _calls(truth)))
  print(f"\n{cats}: BFCL's checker rejects {len(rejected)} of {len(tasks)} answers written from "
        f"its own possible answers: {rejected[:3]}")
  assert len(rejected) <= 0.02 * len(tasks), rejected[:5]
  task = tasks[0]
  (name, params), = json.loads(task.answer)[0].items()
  wrong = "[" + name + "(" + ", ".join(f"{k}='no such value'" for k in params) + ")]"
  r = grade("bfcl", wrong, task)
  assert r.reward == 0.0 and r.parse_ok and r.info["error_type"], r.info


def test_prose_and_broken_syntax_cost_the_policy_its_reward():
  task = _bank("simple").eval_tasks()[0]
  for reply in ["I would call the function with a=1.", "[f(a=1"]:
    r = grade("bfcl", reply, task)
    assert r.reward == 0.0 and not r.parse_ok and r.info["error_type"].startswith("ast_decoder"), \
        (reply, r.info)
  r = grade("bfcl", "", task)  # BFCL reads no reply as no calls: the wrong number of them
  assert r.reward == 0.0 and r.info["error_type"] == "simple_function_checker:wrong_count"


def test_mistakes_are_one_error(monkeypatch):
  with pytest.raises(UserError, match="bfcl has no single-turn category 'live_simple'"):
    _bank("live_simple")
  with pytest.raises(UserError, match="needs categories"):
    TaskBank(TaskBankConfig(dataset="bfcl", eval_fraction=0.3))
  with pytest.raises(UserError, match="needs TaskBankConfig.eval_fraction > 0"):
    TaskBank(TaskBankConfig(dataset="bfcl:simple"))
  monkeypatch.setitem(sys.modules, "bfcl_eval", None)
  bfcl.bfcl.cache_clear()
  bfcl.entries.cache_clear()
  try:
    with pytest.raises(UserError, match=r"needs the bfcl-eval package \(pip install --no-deps"):
      _bank("simple")
  finally:
    bfcl.bfcl.cache_clear()
