"""The "countdown" grader: an arithmetic expression over `task.metadata["numbers"]` whose exact
value is `task.metadata["target"]`, parsed with `ast` and evaluated with exact fractions."""
from __future__ import annotations

import ast
import dataclasses
import fractions
import re
from collections import Counter
from typing import TYPE_CHECKING, Any, Optional

from posttrain_jax.graders.answers import _format_number, last_boxed
from posttrain_jax.graders.base import GradeResult, GraderError, register_grader

if TYPE_CHECKING:   # graders read tasks, tasks import no grader module at run time
  from posttrain_jax.tasks.task import Task

Fraction = fractions.Fraction


# ----------------------------------------------------------------------------------------------
# countdown

class ExpressionError(ValueError):
  """An arithmetic expression outside the accepted grammar (ints, + - * /, parentheses)."""


_MAX_EXPR_CHARS = 256
_BINOPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
           ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b}


def evaluate_expression(expr: str, allow_unary_minus: bool = False
                        ) -> tuple[Fraction, list[int]]:
  """`(value, literals)` of an arithmetic expression, exactly, without executing any code.

  Grammar: non-negative integer literals, binary + - * /, parentheses (and unary minus if
  allowed). Raises ExpressionError for anything else, ZeroDivisionError for a division by 0.
  """
  if len(expr) > _MAX_EXPR_CHARS:
    raise ExpressionError(f"expression longer than {_MAX_EXPR_CHARS} characters")
  try:
    tree = ast.parse(expr.strip(), mode="eval")
  except SyntaxError as e:
    raise ExpressionError(f"not an arithmetic expression: {e.msg}") from None
  literals: list[int] = []

  def ev(node) -> Fraction:
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
      return _BINOPS[type(node.op)](ev(node.left), ev(node.right))
    if isinstance(node, ast.Constant) and type(node.value) is int:
      literals.append(node.value)
      return Fraction(node.value)
    if allow_unary_minus and isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
      return -ev(node.operand)
    raise ExpressionError(f"not allowed in an expression: {ast.dump(node)[:60]}")

  return ev(tree.body), literals


_ANSWER_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


def extract_expression(text: str) -> Optional[str]:
  r"""The expression a countdown completion proposes (see module docstring), or None."""
  tags = _ANSWER_TAG_RE.findall(text)
  if tags:
    expr = tags[-1]
  else:
    boxed = last_boxed(text)
    if boxed is not None:
      expr = boxed
    else:
      lines = [ln for ln in text.strip().split("\n") if ln.strip()]
      if not lines:
        return None
      expr = lines[-1]
  expr = (expr.replace("\\times", "*").replace("\\cdot", "*").replace("×", "*")
          .replace("\\div", "/").replace("÷", "/").replace("−", "-")
          .replace("\\left", "").replace("\\right", "").replace("$", ""))
  if "=" in expr:
    expr = expr.split("=")[0]
  expr = expr.strip().rstrip(".").strip()
  return expr or None


@dataclasses.dataclass(frozen=True)
class CountdownGraderConfig:
  """Config of the "countdown" grader."""
  use_all: bool = False              # require every given number to be used exactly once
  format_reward: float = 0.0         # reward for a well-formed expression that misses the target


@register_grader("countdown", CountdownGraderConfig)
def countdown_grader(completion: str, task: Task,
                     cfg: CountdownGraderConfig = CountdownGraderConfig()) -> GradeResult:
  """1.0 if the completion's expression uses allowed numbers and evaluates to the target."""
  numbers = task.metadata.get("numbers")
  target = task.metadata.get("target", task.answer)
  try:
    numbers = [int(n) for n in numbers]
    target_value = Fraction(str(target).strip())
  except (TypeError, ValueError):
    raise GraderError(f"task {task.id!r}: a countdown task needs metadata 'numbers' (a list of "
                      f"ints) and 'target' (or a numeric answer); got numbers={numbers!r:.60}, "
                      f"target={target!r:.30}") from None
  expr = extract_expression(completion)
  info: dict[str, Any] = {"parse_ok": False, "extracted": expr, "target": str(target_value)}
  if expr is None:
    return GradeResult(0.0, info)
  try:
    value, used = evaluate_expression(expr)
  except ExpressionError as e:
    info["error"] = str(e)
    return GradeResult(0.0, info)
  except ZeroDivisionError:
    info.update(parse_ok=True, error="division by zero")
    return GradeResult(cfg.format_reward, info)
  info["parse_ok"] = True
  info["value"] = _format_number(value)
  extra = Counter(used) - Counter(numbers)
  missing = Counter(numbers) - Counter(used)
  numbers_ok = not extra and (not cfg.use_all or not missing)
  info["numbers_ok"] = numbers_ok
  if extra:
    info["error"] = f"uses numbers not given (or too often): {sorted(extra.elements())}"
  elif not numbers_ok:
    info["error"] = f"does not use: {sorted(missing.elements())}"
  ok = numbers_ok and value == target_value
  return GradeResult(1.0 if ok else cfg.format_reward, info)
