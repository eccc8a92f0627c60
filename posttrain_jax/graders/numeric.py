r"""The "numeric" grader (and, below, what the built-in graders read).

Registered in `GRADERS` (get one with `make_grader(name, cfg)`; an unknown name lists the
registered ones):

* "numeric": reads the *final answer* of the completion and of `task.answer` and compares
  them as numbers. The final answer is, in order of preference,
    1. the content of the last `\boxed{...}` (or `\fbox{...}`; nested braces handled),
    2. what follows the last `#### ` (GSM8K style),
    3. the number after the last "answer is" / "answer:",
    4. the last number in the text (the first with `NumericConfig(pick="first")`: a model
       that states its answer and then rambles on).
  Numbers are normalised: thousands commas ("1,234"), a leading "+", "$", "%", a trailing
  ".0" or ".", `\text{...}` units, "x = 5" (right-hand side), decimals (".5", "2.50"),
  simple fractions "a/b" and `\frac{a}{b}` / `\dfrac` / `\tfrac` (signs outside included).
  Values are compared exactly as fractions, else with `|a - b| <= abs_tol + rel_tol * |b|`.
* "exact_match": the (optionally extracted) final answer equals `task.answer` after
  whitespace / case normalisation.
* "countdown": the completion gives an arithmetic expression over `task.metadata["numbers"]`
  (each used at most as often as it is given; all of them if `use_all`) with `+ - * /` and
  parentheses, whose exact value is `task.metadata["target"]`. The expression is taken from the
  last `<answer>...</answer>`, else the last `\boxed{}`, else the last non-empty line; a trailing
  "= target" is dropped. It is parsed with `ast` and evaluated with exact fractions: only
  integer literals, the four operators and parentheses are accepted, nothing is executed.

A completion in which no answer can be found scores 0 with `info["parse_ok"] = False`: that is
a failure of the *policy*, not of the infrastructure. A task whose own reference answer cannot
be read raises `GraderError` (a data bug, naming the task).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from posttrain_jax.graders.answers import (_format_number, _numbers_in, extract_final_answer,
                                           parse_number)
from posttrain_jax.graders.base import GradeResult, GraderError, register_grader

if TYPE_CHECKING:   # graders read tasks, tasks import no grader module at run time
  from posttrain_jax.tasks.task import Task


@dataclasses.dataclass(frozen=True)
class NumericConfig:
  """Config of the "numeric" grader."""
  abs_tol: float = 1e-6              # |pred - gold| <= abs_tol + rel_tol * |gold| counts as equal
  rel_tol: float = 1e-9              # relative part of the tolerance above
  last_number_fallback: bool = True  # with no \boxed / #### / "answer is", read a number of the text
  pick: str = "last"                 # which number that fallback reads: "last" | "first"

  def __post_init__(self):
    if self.pick not in NUMBER_PICKS:
      raise ValueError(f"NumericConfig.pick is {self.pick!r}; valid: {NUMBER_PICKS} (which "
                       "number of the completion is its answer when nothing marks one)")
    for name in ("abs_tol", "rel_tol"):
      if not getattr(self, name) >= 0:
        raise ValueError(f"NumericConfig.{name} must be ≥ 0, got {getattr(self, name)}")


NUMBER_PICKS = ("last", "first")


@register_grader("numeric", NumericConfig)
def numeric_grader(completion: str, task: Task, cfg: NumericConfig = NumericConfig()
                   ) -> GradeResult:
  """1.0 if the completion's final answer equals the task's numerically, else 0.0."""
  gold_text, _ = extract_final_answer(task.answer)
  gold = parse_number(gold_text) if gold_text is not None else None
  if gold is None:
    gold = parse_number(task.answer)
  if gold is None:
    raise GraderError(f"task {task.id!r}: reference answer {task.answer!r:.80} is not a number; "
                      "use the 'exact_match' grader for non-numeric answers")
  extracted, how = extract_final_answer(completion, cfg.pick)
  if how == "last_number" and not cfg.last_number_fallback:
    extracted, how = None, "none"
  pred = parse_number(extracted) if extracted is not None else None
  if pred is None and how == "####":   # "#### The total is 72 apples"
    nums = _numbers_in(extracted)
    pred = parse_number(nums[0]) if len(nums) == 1 else None
  info: dict[str, Any] = {"parse_ok": pred is not None, "extracted": extracted, "rule": how,
                          "gold": _format_number(gold)}
  if pred is None:
    return GradeResult(0.0, info)
  info["pred"] = _format_number(pred)
  ok = pred == gold or abs(float(pred) - float(gold)) <= cfg.abs_tol + cfg.rel_tol * abs(float(gold))
  return GradeResult(1.0 if ok else 0.0, info)


