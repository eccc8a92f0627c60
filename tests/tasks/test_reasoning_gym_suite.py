"""Task source + grader "reasoning_gym" against the reasoning-gym package's own datasets and
scorers: the tasks are the package's rows (made here with `create_dataset` directly), their own
answers score 1 through our grader, a wrong answer 0, an untagged one 0 with a reason; the
held-out questions never reach training; mistakes are one UserError naming what is wrong."""
import sys

import pytest

rg = pytest.importorskip("reasoning_gym")

from posttrain_jax.errors import UserError  # noqa: E402
from posttrain_jax.graders import grade  # noqa: E402
from posttrain_jax.tasks.bank import TaskBank, TaskBankConfig  # noqa: E402
from posttrain_jax.tasks.reasoning_gym_suite import EVAL_SEED, SEED_STRIDE  # noqa: E402

DATASETS = ["basic_arithmetic", "chain_sum", "spell_backward", "letter_counting",
            "number_sorting", "gcd"]


def _bank(name, **kw):
  return TaskBank(TaskBankConfig(dataset=f"reasoning_gym:{name}", **kw))


@pytest.mark.parametrize("name", DATASETS)
def test_tasks_are_the_packages_rows_and_its_own_answers_score_1(name):
  bank = _bank(name, eval_size=8, seed=3)
  held = bank.eval_tasks()
  own = rg.create_dataset(name, seed=3 * SEED_STRIDE + EVAL_SEED, size=8 * 64)
  for i, task in enumerate(held):
    entry = own[i]
    assert task.messages[-1] == {"role": "user", "content": entry["question"]}
    assert task.answer == str(entry["answer"])
    right = grade("reasoning_gym", f"Let me think.\n<answer>{entry['answer']}</answer>", task)
    assert right.reward == 1.0 and right.parse_ok, (task.id, right)
    # the package's own verdict on a wrong answer, through our grader
    wrong = grade("reasoning_gym", "<answer>certainly not this</answer>", task)
    assert wrong.reward == own.score_answer("certainly not this", entry) < 1.0
    none = grade("reasoning_gym", entry["answer"], task)  # right, but not in the tag
    assert none.reward == 0.0 and not none.parse_ok and "<answer>" in none.info["reason"]


def test_system_prompt_is_the_packages_and_can_be_dropped():
  from reasoning_gym.utils import SYSTEM_PROMPTS
  task = next(_bank("gcd").iterator())
  assert task.messages[0] == {"role": "system", "content": SYSTEM_PROMPTS["default"]}
  task = next(_bank("gcd", dataset_config={"system_prompt": None}).iterator())
  assert [m["role"] for m in task.messages] == ["user"]


def test_held_out_questions_never_reach_training():
  # 1-digit sums of 2 terms: a problem space of a few hundred questions, so collisions happen
  opts = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
  bank = _bank("chain_sum", eval_size=50, synthetic_size=400, dataset_config=opts)
  held = {t.messages[-1]["content"] for t in bank.eval_tasks()}
  train = [bank.train_source[i].messages[-1]["content"] for i in range(400)]
  plain = rg.create_dataset("chain_sum", seed=0, size=400, **opts)
  assert sum(plain[i]["question"] in held for i in range(400)) > 0  # the test could fail
  assert not held & set(train)


def test_dataset_options_reach_the_package_and_the_split_is_by_seed():
  opts = {"min_terms": 3, "max_terms": 3, "min_digits": 2, "max_digits": 2}
  a = _bank("chain_sum", seed=1, dataset_config=opts)
  b = _bank("chain_sum", seed=2, dataset_config=opts)
  ta, tb = a.train_source[0], b.train_source[0]
  assert ta.messages[-1]["content"] != tb.messages[-1]["content"]
  assert ta.metadata["reasoning_gym"]["seed"] == 1 * SEED_STRIDE   # the package's seed
  assert a.fingerprint != b.fingerprint != _bank("chain_sum", seed=2).fingerprint


def test_mistakes_are_one_error_naming_them(monkeypatch):
  with pytest.raises(UserError, match="reasoning_gym has no dataset 'no_such_set'"):
    _bank("no_such_set")
  with pytest.raises(UserError, match="no task source 'reasoning_gymm'"):
    TaskBankConfig(dataset="reasoning_gymm:gcd")
  with pytest.raises(UserError, match="needs a dataset name"):
    TaskBank(TaskBankConfig(dataset="reasoning_gym"))
  with pytest.raises(UserError, match="refuses its config"):
    _bank("gcd", dataset_config={"no_such_option": 1})
  with pytest.raises(UserError, match="no system prompt 'shouty'"):
    _bank("gcd", dataset_config={"system_prompt": "shouty"})
  monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # as if not installed
  from posttrain_jax.tasks import reasoning_gym_suite
  reasoning_gym_suite._dataset.cache_clear()
  with pytest.raises(UserError, match=r"needs the reasoning-gym package \(pip install"):
    _bank("gcd")


def test_worked_examples_come_first_and_are_never_held_out():
  bank = _bank("gcd", eval_size=20, dataset_config={"shots": 2, "system_prompt": None})
  held = bank.eval_tasks()
  train = next(bank.iterator())
  examples = held[0].messages[:4]
  assert [m["role"] for m in examples] == ["user", "assistant"] * 2
  assert all(t.messages[:4] == examples for t in held) and train.messages[:4] == examples
  for q, a in zip(examples[::2], examples[1::2]):
    entry = next(e for e in rg.create_dataset("gcd", seed=2_000_003, size=64)
                 if e["question"] == q["content"])
    assert a["content"] == f"<answer>{entry['answer']}</answer>"
    assert q["content"] not in {t.messages[-1]["content"] for t in held}
  with pytest.raises(UserError, match="shots'\\] must be an int >= 0"):
    _bank("gcd", dataset_config={"shots": -1})


def test_a_shot_pool_gives_each_task_its_own_examples_and_never_a_held_out_one():
  cfg = {"shots": 2, "shot_pool": 16, "system_prompt": None}
  bank = _bank("gcd", eval_size=32, dataset_config=cfg)
  held = bank.eval_tasks()
  it = bank.iterator()
  train = [next(it) for _ in range(32)]
  pool = {}  # the package's own rows of the worked-example seed: question -> answer
  for e in rg.create_dataset("gcd", seed=2_000_003, size=16 * 64):
    pool.setdefault(e["question"], str(e["answer"]))
  held_q = {t.messages[-1]["content"] for t in held}
  drawn = set()
  for t in held + train:
    shots = t.messages[:-1]
    assert [m["role"] for m in shots] == ["user", "assistant"] * 2, t.id
    assert shots[0]["content"] != shots[2]["content"]          # two distinct rows
    for q, a in zip(shots[::2], shots[1::2]):
      assert a["content"] == f"<answer>{pool[q['content']]}</answer>"
      assert q["content"] not in held_q and q["content"] != t.messages[-1]["content"]
    drawn.add(tuple(m["content"] for m in shots[::2]))
  assert len(drawn) > 16                       # 64 tasks, 120 possible pairs: many sets
  assert len({q for pair in drawn for q in pair}) <= 16
  again = _bank("gcd", eval_size=32, dataset_config=cfg).eval_tasks()
  assert [t.messages for t in again] == [t.messages for t in held]   # a task's draw is fixed
  with pytest.raises(UserError, match=r"'shot_pool'\] = 1 is fewer rows than the 2 shots"):
    _bank("gcd", dataset_config={"shots": 2, "shot_pool": 1})


def test_task_seeds_a_step_apart_share_no_rows():
  """reasoning-gym draws row i of seed s from Random(s + i): made with seeds 0 and 3 directly,
  the package's own rows overlap (the held-out sets of tasks.seed=0 and =3 once did, 253 of
  256); ours, a stride apart, share no held-out, training or worked-example question."""
  own = [[rg.create_dataset("gcd", seed=s + EVAL_SEED, size=64)[i]["question"]
          for i in range(64)] for s in (0, 3)]
  assert len(set(own[0]) & set(own[1])) == 61            # what the package gives
  def questions(seed):
    bank = _bank("gcd", eval_size=64, seed=seed, dataset_config={"shots": 2})
    held = bank.eval_tasks()
    it = bank.iterator()
    train = {next(it).messages[-1]["content"] for _ in range(256)}
    shots = {m["content"] for m in held[0].messages[:-1] if m["role"] == "user"}
    return {t.messages[-1]["content"] for t in held}, train, shots
  a, b = questions(0), questions(3)
  assert len(a[0]) == len(b[0]) == 64
  for x in a:
    for y in b:
      assert not x & y
  assert a[0] == set(own[0])   # seed 0 is the package's seed 0: its figures stay comparable
