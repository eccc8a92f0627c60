r"""Synthetic task generators: tasks made from a seed, so that nothing needs downloading.

Registered in `GENERATORS`:

* "arithmetic": `a op b [op c ...]` with `op` drawn from `ArithmeticConfig.ops` ("+-*/"),
  operands with `min_digits..max_digits` digits (number of digits drawn uniformly, then the
  operand uniformly among numbers of that many digits; 1 digit means 0..9). Usual operator
  precedence; the answer is the exact integer value (divisions are built to be exact).
  Prompt: "12+7=" (the template is a knob); canonical solution: "19".
* "countdown": `num_numbers` numbers in `min_number..max_number` and a target reachable by
  construction (a random expression tree over the numbers, `-` kept non-negative, `/` only
  when exact). Prompt: "3 5 2 -> 16:"; canonical solution: an expression such as "(3+5)*2";
  `metadata` carries `numbers`, `target` and `solution` for the "countdown" grader.

Determinism: task `i` of stream `(seed, partition)` is drawn from
`numpy.random.default_rng([seed, partition, i])`, so it is the same in every process and
needs no state (random access, infinite or sized). The held-out split is decided by a fixed
hash of the problem key (`is_held_out`; the expression for arithmetic, the sorted numbers and
the target for countdown), independent of the seed: the training stream redraws held-out
keys and the evaluation stream redraws training keys, so the two never overlap.

`solution_text(task, style)` renders the SFT target ("19" or "\boxed{19}") in a form the
registered graders read back, so warm-start SFT and RL grading agree on the answer format.
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable

import numpy as np

from posttrain_jax.graders.answers import extract_final_answer
from posttrain_jax.graders.countdown import evaluate_expression
from posttrain_jax.errors import UserError
from posttrain_jax.tasks.task import Prompt, Task, is_held_out
from posttrain_jax.registry import Registry

TRAIN, EVAL = "train", "eval"
_PARTITION_IDS = {TRAIN: 0, EVAL: 1}
_MAX_DRAWS = 10_000


class GeneratorError(UserError, ValueError):
  """A generator config that cannot produce tasks; the message names the field."""


@dataclasses.dataclass(frozen=True)
class ArithmeticConfig:
  """Difficulty knobs of the "arithmetic" generator."""
  min_digits: int = 1                # fewest digits of an operand (1 digit = 0..9)
  max_digits: int = 2                # most digits of an operand
  num_operands: int = 2              # operands per expression (>= 2)
  ops: str = "+-"                    # operators to draw from, any of "+-*/"
  allow_negative: bool = True        # False: redraw expressions whose value is below 0
  prompt_template: str = "{expr}="   # prompt text; {expr} is e.g. "12+7"

  def __post_init__(self):
    if not 1 <= self.min_digits <= self.max_digits <= 18:
      raise GeneratorError(f"ArithmeticConfig: need 1 <= min_digits <= max_digits <= 18, got "
                           f"min_digits={self.min_digits}, max_digits={self.max_digits}")
    if self.num_operands < 2:
      raise GeneratorError(f"ArithmeticConfig.num_operands must be >= 2, got {self.num_operands}")
    if not self.ops or set(self.ops) - set("+-*/"):
      raise GeneratorError(f"ArithmeticConfig.ops must be a non-empty subset of '+-*/', "
                           f"got {self.ops!r}")
    if "{expr}" not in self.prompt_template:
      raise GeneratorError("ArithmeticConfig.prompt_template must contain '{expr}'")


@dataclasses.dataclass(frozen=True)
class CountdownConfig:
  """Difficulty knobs of the "countdown" generator."""
  num_numbers: int = 3               # numbers shown in the prompt (>= 2)
  min_number: int = 1                # smallest number
  max_number: int = 9                # largest number
  ops: str = "+-*"                   # operators the construction may use, any of "+-*/"
  use_all: bool = True               # the construction uses every number (else a subset of >= 2)
  max_target: int = 100              # redraw puzzles whose target is above this or below 1
  prompt_template: str = "{numbers} -> {target}:"  # {numbers} is "3 5 2", {target} "16"

  def __post_init__(self):
    if self.num_numbers < 2:
      raise GeneratorError(f"CountdownConfig.num_numbers must be >= 2, got {self.num_numbers}")
    if not 0 <= self.min_number <= self.max_number:
      raise GeneratorError(f"CountdownConfig: need 0 <= min_number <= max_number, got "
                           f"{self.min_number}..{self.max_number}")
    if not self.ops or set(self.ops) - set("+-*/"):
      raise GeneratorError(f"CountdownConfig.ops must be a non-empty subset of '+-*/', "
                           f"got {self.ops!r}")
    if self.max_target < 1:
      raise GeneratorError(f"CountdownConfig.max_target must be >= 1, got {self.max_target}")


@dataclasses.dataclass(frozen=True)
class GeneratorSpec:
  """A registered generator: `draw(cfg, rng) -> (held_out_key, Task)` and its config class."""
  name: str
  draw: Callable[[Any, np.random.Generator], tuple[str, Task]]
  config_cls: type


GENERATORS: Registry[GeneratorSpec] = Registry(
    "generator", discover=("posttrain_jax.tasks", "posttrain_jax.envs"))


def register_generator(name: str, config_cls: type):
  def deco(fn):
    GENERATORS.register(name)(GeneratorSpec(name, fn, config_cls))
    return fn
  return deco


def format_prompt(text: str, chat: bool = False) -> Prompt:
  """The prompt as plain text, or as a one-message user chat when `chat`."""
  return [{"role": "user", "content": text}] if chat else text


def solution_text(task: Task, style: str = "plain") -> str:
  r"""The canonical SFT target of a task, in a form its grader reads back.

  style "plain": `metadata["solution"]` if present, else the answer ("19", "(3+5)*2").
  style "boxed": the same wrapped in `\boxed{...}`; for a free-text answer such as GSM8K's
  "... #### 72" the box holds the final answer ("\boxed{72}").
  """
  plain = str(task.metadata.get("solution", task.answer))
  if style == "plain":
    return plain
  if style == "boxed":
    if "solution" not in task.metadata:
      final, how = extract_final_answer(plain)
      if how in ("boxed", "####") and final:
        plain = final
    return f"\\boxed{{{plain}}}"
  raise ValueError(f"unknown solution style {style!r}; valid: 'plain', 'boxed'")


def _draw_operand(cfg: ArithmeticConfig, rng: np.random.Generator) -> int:
  d = int(rng.integers(cfg.min_digits, cfg.max_digits + 1))
  lo = 0 if d == 1 else 10 ** (d - 1)
  return int(rng.integers(lo, 10 ** d))


@register_generator("arithmetic", ArithmeticConfig)
def draw_arithmetic(cfg: ArithmeticConfig, rng: np.random.Generator) -> tuple[str, Task]:
  """One arithmetic task (may raise _Redraw when the draw breaks a constraint)."""
  nums = [_draw_operand(cfg, rng) for _ in range(cfg.num_operands)]
  ops = [cfg.ops[int(rng.integers(len(cfg.ops)))] for _ in range(cfg.num_operands - 1)]
  for i, op in enumerate(ops):
    if op == "/":   # make nums[i] / nums[i + 1] exact without leaving the digit range
      while nums[i + 1] == 0:
        nums[i + 1] = _draw_operand(cfg, rng)
      top = max(10 ** cfg.max_digits - 1, nums[i + 1])
      nums[i] = nums[i + 1] * int(rng.integers(1, top // nums[i + 1] + 1))
  expr = str(nums[0]) + "".join(op + str(n) for op, n in zip(ops, nums[1:]))
  try:
    value, _ = evaluate_expression(expr)
  except ZeroDivisionError:
    raise _Redraw() from None
  if value.denominator != 1 or (not cfg.allow_negative and value < 0):
    raise _Redraw()
  answer = str(value.numerator)
  task = Task(id=f"arithmetic:{expr}", prompt=cfg.prompt_template.format(expr=expr),
              answer=answer, metadata={"solution": answer, "expression": expr,
                                       "generator": "arithmetic"})
  return expr, task


_PREC = {"+": 1, "-": 1, "*": 2, "/": 2}


def _wrap(child: tuple[int, str, str], parent_op: str, right: bool) -> str:
  _, expr, op = child
  if not op:
    return expr
  need = _PREC[op] < _PREC[parent_op] or (right and parent_op in "-/" and
                                            _PREC[op] == _PREC[parent_op])
  return f"({expr})" if need else expr


@register_generator("countdown", CountdownConfig)
def draw_countdown(cfg: CountdownConfig, rng: np.random.Generator) -> tuple[str, Task]:
  """One countdown puzzle whose target is reachable by construction."""
  numbers = [int(x) for x in rng.integers(cfg.min_number, cfg.max_number + 1, cfg.num_numbers)]
  k = cfg.num_numbers if cfg.use_all else int(rng.integers(2, cfg.num_numbers + 1))
  pool: list[tuple[int, str, str]] = [(n, str(n), "") for n in
                                       (numbers[i] for i in rng.permutation(cfg.num_numbers)[:k])]
  while len(pool) > 1:
    i, j = (int(x) for x in rng.choice(len(pool), 2, replace=False))
    a, b = pool[i], pool[j]
    op = cfg.ops[int(rng.integers(len(cfg.ops)))]
    if op == "-" and a[0] < b[0]:
      a, b = b, a
    if op == "/" and (b[0] == 0 or a[0] % b[0]):
      if a[0] != 0 and b[0] % a[0] == 0:
        a, b = b, a
      else:
        op = "+" if "+" in cfg.ops else "*" if "*" in cfg.ops else "-"
        if op == "-" and a[0] < b[0]:
          a, b = b, a
    value = {"+": a[0] + b[0], "-": a[0] - b[0], "*": a[0] * b[0],
             "/": a[0] // b[0] if op == "/" else 0}[op]
    node = (value, f"{_wrap(a, op, False)}{op}{_wrap(b, op, True)}", op)
    pool = [p for t, p in enumerate(pool) if t not in (i, j)] + [node]
  target, solution, _ = pool[0]
  if not 1 <= target <= cfg.max_target:
    raise _Redraw()
  shown = " ".join(map(str, numbers))
  task = Task(id=f"countdown:{','.join(map(str, numbers))}->{target}",
              prompt=cfg.prompt_template.format(numbers=shown, target=target),
              answer=str(target),
              metadata={"numbers": numbers, "target": target, "solution": solution,
                        "generator": "countdown"})
  return f"{sorted(numbers)}->{target}", task


class _Redraw(Exception):
  """Internal: the draw broke a constraint; draw again from the same rng."""


def generate_task(name: str, cfg: Any, seed: int, index: int, partition: str = TRAIN,
                  eval_fraction: float = 0.0, chat: bool = False) -> Task:
  """Task `index` of the `partition` stream of generator `name` (deterministic, stateless).

  partition "train" only yields keys outside the held-out split, "eval" only keys inside it.
  """
  spec = GENERATORS.get(name)
  if partition not in _PARTITION_IDS:
    raise ValueError(f"unknown partition {partition!r}; valid: {sorted(_PARTITION_IDS)}")
  want_eval = partition == EVAL
  if want_eval and eval_fraction <= 0.0:
    raise GeneratorError("the eval partition is empty: eval_fraction is 0")
  rng = np.random.default_rng([int(seed), _PARTITION_IDS[partition], int(index)])
  for _ in range(_MAX_DRAWS):
    try:
      key, task = spec.draw(cfg, rng)
    except _Redraw:
      continue
    if is_held_out(key, eval_fraction) == want_eval:
      if chat:
        task = dataclasses.replace(task, prompt=format_prompt(task.prompt, chat=True))
      return task
  raise GeneratorError(
      f"generator {name!r} found no {partition} task in {_MAX_DRAWS} draws with {cfg} and "
      f"eval_fraction={eval_fraction}: the problem space is too small or too constrained")


class SyntheticSource:
  """A grain-compatible random-access source of generated tasks (`len`, `[i]`).

  `size=None` is an endless stream (`len == sys.maxsize`); task i is `generate_task(..., i)`.
  """

  def __init__(self, name: str, cfg: Any = None, *, seed: int = 0, size: int | None = None,
               partition: str = TRAIN, eval_fraction: float = 0.0, chat: bool = False):
    spec = GENERATORS.get(name)
    cfg = spec.config_cls() if cfg is None else cfg
    if not isinstance(cfg, spec.config_cls):
      raise TypeError(f"generator {name!r} takes a {spec.config_cls.__name__}, "
                      f"got {type(cfg).__name__}")
    if size is not None and size < 0:
      raise GeneratorError(f"size must be >= 0 or None, got {size}")
    self.name, self.cfg, self.seed, self.size = name, cfg, seed, size
    self.partition, self.eval_fraction, self.chat = partition, eval_fraction, chat
    generate_task(name, cfg, seed, 0, partition, eval_fraction, chat)  # fail now, not mid-run

  def __len__(self) -> int:
    return sys.maxsize if self.size is None else self.size

  def __getitem__(self, index: int) -> Task:
    if not 0 <= index < len(self):
      raise IndexError(f"index {index} out of range for {len(self)} synthetic tasks")
    return generate_task(self.name, self.cfg, self.seed, index, self.partition,
                         self.eval_fraction, self.chat)

  def __repr__(self) -> str:
    return (f"SyntheticSource({self.name!r}, {self.cfg}, seed={self.seed}, size={self.size}, "
            f"partition={self.partition!r}, eval_fraction={self.eval_fraction})")


def distinct_tasks(name: str, cfg: Any, n: int, *, seed: int = 0, partition: str = EVAL,
                   eval_fraction: float = 0.0, chat: bool = False,
                   max_draws: int | None = None) -> list[Task]:
  """Up to `n` tasks with distinct ids from the `partition` stream, in stream order.

  Stops early (fewer than n) when `max_draws` (default 20 n + 1000) stream items give no more
  new ids, which happens when the held-out problem space is smaller than n.
  """
  out: dict[str, Task] = {}
  limit = 20 * n + 1000 if max_draws is None else max_draws
  for i in range(limit):
    if len(out) >= n:
      break
    t = generate_task(name, cfg, seed, i, partition, eval_fraction, chat)
    out.setdefault(t.id, t)
  return list(out.values())
