"""Synthetic generators: determinism, difficulty knobs, held-out disjointness, SFT/grader agreement."""
import re

import pytest

from posttrain_jax.graders import grade
from posttrain_jax.tasks.synthetic import (EVAL,
    GENERATORS,
    TRAIN,
    ArithmeticConfig,
    CountdownConfig,
    GeneratorError,
    SyntheticSource,
    distinct_tasks,
    generate_task,
    solution_text)
from posttrain_jax.tasks.task import is_held_out


def _reference_value(expr: str) -> int:
  """Python's own arithmetic on a generated (trusted) expression: an independent reference."""
  assert re.fullmatch(r"[0-9+\-*/()]+", expr), expr
  v = eval(expr)  # noqa: S307 -- test-only, input is our own digits and operators
  assert v == int(v)
  return int(v)


def test_registered_generators():
  assert {"arithmetic", "countdown"} <= set(GENERATORS.names())
  with pytest.raises(KeyError, match="registered generators: arithmetic, countdown"):
    SyntheticSource("arithmetik")


@pytest.mark.parametrize("cfg", [
    ArithmeticConfig(),
    ArithmeticConfig(min_digits=2, max_digits=3, num_operands=3, ops="+-*"),
    ArithmeticConfig(max_digits=2, num_operands=4, ops="+-*/", allow_negative=False),
])
def test_arithmetic_answers_and_knobs(cfg):
  src = SyntheticSource("arithmetic", cfg, seed=3, size=300)
  ops_seen = set()
  for i in range(len(src)):
    t = src[i]
    expr = t.metadata["expression"]
    assert t.prompt == f"{expr}=" and t.id == f"arithmetic:{expr}"
    assert int(t.answer) == _reference_value(expr)
    if not cfg.allow_negative:
      assert int(t.answer) >= 0
    operands = re.split(r"[+\-*/]", expr)
    ops = re.findall(r"[+\-*/]", expr)
    assert len(operands) == cfg.num_operands and set(ops) <= set(cfg.ops)
    ops_seen |= set(ops)
    for k, n in enumerate(operands):
      assert len(n) <= cfg.max_digits
      if (ops + [None])[k] != "/":         # a dividend is a multiple of its divisor, may be short
        assert len(n) >= cfg.min_digits
  assert ops_seen == set(cfg.ops)


def test_arithmetic_digit_range_exact():
  cfg = ArithmeticConfig(min_digits=2, max_digits=2, ops="+")
  src = SyntheticSource("arithmetic", cfg, size=200)
  for i in range(len(src)):
    a, b = src[i].metadata["expression"].split("+")
    assert 10 <= int(a) <= 99 and 10 <= int(b) <= 99


def test_same_seed_same_tasks_different_seed_different():
  cfg = ArithmeticConfig(max_digits=3)
  a = [generate_task("arithmetic", cfg, 7, i).id for i in range(50)]
  b = [SyntheticSource("arithmetic", cfg, seed=7)[i].id for i in range(50)]
  c = [generate_task("arithmetic", cfg, 8, i).id for i in range(50)]
  assert a == b
  assert sum(x != y for x, y in zip(a, c)) > 40


@pytest.mark.parametrize("name,cfg", [("arithmetic", ArithmeticConfig(max_digits=2)),
                                      ("countdown", CountdownConfig())])
def test_held_out_is_disjoint_from_training_stream(name, cfg):
  frac = 0.1
  train = [generate_task(name, cfg, 0, i, TRAIN, frac) for i in range(2000)]
  held = distinct_tasks(name, cfg, 100, seed=0, partition=EVAL, eval_fraction=frac)
  assert len(held) == 100 and len({t.id for t in held}) == 100
  assert not {t.id for t in train} & {t.id for t in held}
  # membership is a function of the problem key only: other seeds never leak either
  other_seed = [generate_task(name, cfg, 123, i, TRAIN, frac) for i in range(500)]
  assert not {t.id for t in other_seed} & {t.id for t in held}
  # and the split has roughly the requested size
  keys = [f"{a}+{b}" for a in range(100) for b in range(100)]
  assert 0.08 < sum(is_held_out(k, frac) for k in keys) / len(keys) < 0.12


def test_small_space_eval_returns_fewer_and_impossible_space_errors():
  tiny = ArithmeticConfig(max_digits=1, ops="+")        # 100 problems, ~10 held out
  held = distinct_tasks("arithmetic", tiny, 50, eval_fraction=0.1)
  assert 3 <= len(held) < 50
  with pytest.raises(GeneratorError, match="eval_fraction is 0"):
    generate_task("arithmetic", tiny, 0, 0, EVAL, 0.0)
  with pytest.raises(GeneratorError, match="no train task"):  # all 100 problems held out
    SyntheticSource("arithmetic", tiny, eval_fraction=0.999999)


def test_countdown_target_reachable_by_construction():
  cfg = CountdownConfig(num_numbers=4, max_number=12, ops="+-*/", max_target=200)
  src = SyntheticSource("countdown", cfg, seed=1, size=300)
  for i in range(len(src)):
    t = src[i]
    nums, target = t.metadata["numbers"], t.metadata["target"]
    assert len(nums) == 4 and all(1 <= n <= 12 for n in nums) and 1 <= target <= 200
    assert t.prompt == f"{' '.join(map(str, nums))} -> {target}:"
    assert _reference_value(t.metadata["solution"]) == target
    used = sorted(int(x) for x in re.findall(r"\d+", t.metadata["solution"]))
    assert used == sorted(nums)                              # use_all=True
    assert grade("countdown", t.metadata["solution"], t).reward == 1.0


@pytest.mark.parametrize("name,grader,cfg", [
    ("arithmetic", "numeric", ArithmeticConfig(ops="+-*")),
    ("countdown", "countdown", CountdownConfig()),
])
def test_solution_text_is_what_the_grader_accepts(name, grader, cfg):
  for i in range(100):
    t = generate_task(name, cfg, 0, i)
    for style in ("plain", "boxed"):
      assert grade(grader, solution_text(t, style), t).reward == 1.0
  assert solution_text(generate_task("arithmetic", ArithmeticConfig(), 0, 0), "boxed") \
      .startswith("\\boxed{")
  with pytest.raises(ValueError, match="valid: 'plain', 'boxed'"):
    solution_text(t, "latex")


def test_chat_prompt_and_template():
  t = generate_task("arithmetic", ArithmeticConfig(prompt_template="Q: {expr}"), 0, 0, chat=True)
  assert t.prompt == [{"role": "user", "content": f"Q: {t.metadata['expression']}"}]


def test_config_errors_name_the_field():
  with pytest.raises(GeneratorError, match="ops"):
    ArithmeticConfig(ops="+^")
  with pytest.raises(GeneratorError, match="max_digits"):
    ArithmeticConfig(min_digits=3, max_digits=2)
  with pytest.raises(GeneratorError, match="num_numbers"):
    CountdownConfig(num_numbers=1)
  with pytest.raises(TypeError, match="ArithmeticConfig"):
    SyntheticSource("arithmetic", CountdownConfig())
