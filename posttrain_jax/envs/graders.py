r"""Graders: pure functions `(completion_text, task) -> GradeResult(reward, info)`.

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

import ast
import dataclasses
import fractions
import functools
import re
from collections import Counter
from typing import Any, Callable, Optional

from posttrain_jax.envs.task import Task
from posttrain_jax.registry import Registry

Fraction = fractions.Fraction


class GraderError(ValueError):
  """The task (not the completion) cannot be graded: its reference data is malformed."""


@dataclasses.dataclass(frozen=True)
class GradeResult:
  """A grader's verdict on one completion."""
  reward: float                     # in [0, 1] for the built-in graders
  info: dict[str, Any] = dataclasses.field(default_factory=dict)  # parse_ok, extracted, ...

  @property
  def parse_ok(self) -> bool:
    return bool(self.info.get("parse_ok", False))


Grader = Callable[[str, Task], GradeResult]


@dataclasses.dataclass(frozen=True)
class GraderSpec:
  """A registered grader: the pure function and its config class."""
  name: str
  fn: Callable[[str, Task, Any], GradeResult]   # (completion, task, cfg) -> GradeResult
  config_cls: type


GRADERS: Registry[GraderSpec] = Registry("grader")


def register_grader(name: str, config_cls: type):
  """Decorator: `@register_grader("numeric", NumericConfig)` on `fn(completion, task, cfg)`."""
  def deco(fn):
    GRADERS.register(name)(GraderSpec(name, fn, config_cls))
    return fn
  return deco


def make_grader(name: str, cfg: Any = None) -> Grader:
  """The grader `name` with its config bound: a `(completion, task) -> GradeResult` function.

  `cfg` defaults to the grader's config class with default values.
  """
  spec = GRADERS.get(name)
  if cfg is None:
    cfg = spec.config_cls()
  elif not isinstance(cfg, spec.config_cls):
    raise TypeError(f"grader {name!r} takes a {spec.config_cls.__name__}, "
                    f"got {type(cfg).__name__}")
  return functools.partial(spec.fn, cfg=cfg)


def grade(name: str, completion: str, task: Task, cfg: Any = None) -> GradeResult:
  """One-off convenience: `make_grader(name, cfg)(completion, task)`."""
  return make_grader(name, cfg)(completion, task)


# ----------------------------------------------------------------------------------------------
# Final-answer extraction.

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*")


def last_boxed(text: str) -> Optional[str]:
  r"""Content of the last `\boxed{...}` / `\fbox{...}` (nested braces matched), or None.

  `\boxed 5` (no braces) yields "5". An unclosed brace yields None for that box.
  """
  found = None
  for m in _BOXED_RE.finditer(text):
    i = m.end()
    if i < len(text) and text[i] == "{":
      depth, j = 0, i
      while j < len(text):
        if text[j] == "{":
          depth += 1
        elif text[j] == "}":
          depth -= 1
          if depth == 0:
            found = text[i + 1:j]
            break
        j += 1
    else:
      tok = re.match(r"[^\s$]+", text[i:])
      if tok:
        found = tok.group(0)
  return found


_HASHES_RE = re.compile(r"####\s*([^\n]*)")
_ANSWER_IS_RE = re.compile(r"answer\s*(?:is|:|=)\s*:?\s*", re.IGNORECASE)

# A number: optional sign (not when it reads as a binary minus after a digit or bracket),
# digits with optional thousands commas, optional decimals, optional "/denominator".
_NUM = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+"
_NUMBER_RE = re.compile(
    rf"(?<![\w.)\]}}])[-+]?(?:{_NUM})(?:\s*/\s*(?:{_NUM}))?|(?:{_NUM})(?:\s*/\s*(?:{_NUM}))?")
_FRAC_RE = re.compile(r"([-+]?)\s*\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")


def _latex_fracs_to_slash(s: str) -> str:
  return _FRAC_RE.sub(lambda m: f"{m.group(1)}({m.group(2)})/({m.group(3)})", s)


def _numbers_in(text: str) -> list[str]:
  text = _latex_fracs_to_slash(text)
  text = re.sub(r"\(\s*([-+]?[\d.,]+)\s*\)", r"\1", text)  # "(1)/(2)" -> "1/2"
  return [m.group(0) for m in _NUMBER_RE.finditer(text)]


def extract_final_answer(text: str, pick: str = "last") -> tuple[Optional[str], str]:
  r"""`(answer_text, how)`: the final answer of a completion and which rule found it.

  `how` is one of "boxed", "####", "answer_is", "last_number", "none"; `pick` ("last" |
  "first") is which number of the text rule 4 reads (its `how` is "last_number" either way).
  """
  boxed = last_boxed(text)
  if boxed is not None:
    return boxed.strip(), "boxed"
  hashes = _HASHES_RE.findall(text)
  if hashes:
    return hashes[-1].strip(), "####"
  matches = list(_ANSWER_IS_RE.finditer(text))
  if matches:
    nums = _numbers_in(text[matches[-1].end():].split("\n")[0])
    if nums:
      return nums[0].strip(), "answer_is"
  nums = _numbers_in(text)
  if nums:
    return nums[0 if pick == "first" else -1].strip(), "last_number"
  return None, "none"


def parse_number(s: str) -> Optional[Fraction]:
  r"""The value of an extracted answer string as an exact Fraction, or None if not a number.

  Accepts "1,234", "+5", "-3.50", ".5", "7.", "3/4", "-\frac{1}{2}", "\dfrac{3}{4}", "$12",
  "50\%", "12 \text{ cm}", "x = 5", "5^\circ".
  """
  s = s.strip()
  s = re.sub(r"\\text\s*\{[^{}]*\}|\\(?:mathrm|mbox)\s*\{[^{}]*\}", " ", s)
  s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
  s = s.replace("\\!", "").replace("\\,", "").replace("^\\circ", "").replace("^{\\circ}", "")
  s = s.replace("\\left", "").replace("\\right", "")
  if "=" in s:
    s = s.rsplit("=", 1)[1]
  s = _latex_fracs_to_slash(s).replace("{", "(").replace("}", ")")
  s = s.replace(" ", "").rstrip(".")
  s = re.sub(r"\(([-+]?[\d.,]+)\)", r"\1", s)
  m = re.fullmatch(rf"([-+]?)\(?([-+]?)({_NUM})\)?(?:/\(?({_NUM})\)?)?", s)
  if not m:
    return None
  sign = -1 if (m.group(1) == "-") != (m.group(2) == "-") else 1
  try:
    value = Fraction(m.group(3).replace(",", ""))
    if m.group(4) is not None:
      den = Fraction(m.group(4).replace(",", ""))
      if den == 0:
        return None
      value /= den
  except (ValueError, ZeroDivisionError):
    return None
  return sign * value


def _format_number(x: Fraction) -> str:
  return str(x.numerator) if x.denominator == 1 else f"{x.numerator}/{x.denominator}"


# ----------------------------------------------------------------------------------------------
# numeric

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


# ----------------------------------------------------------------------------------------------
# exact_match

@dataclasses.dataclass(frozen=True)
class ExactMatchConfig:
  """Config of the "exact_match" grader."""
  ignore_case: bool = True           # compare case-folded strings
  normalize_whitespace: bool = True  # strip and collapse runs of whitespace to one space
  extract: bool = True               # compare the \boxed{} / #### / "answer is" part when present
  strip_punctuation: bool = False    # drop trailing . , ; ! ? and surrounding quotes


def _normalise(s: str, cfg: ExactMatchConfig) -> str:
  if cfg.normalize_whitespace:
    s = " ".join(s.split())
  else:
    s = s.strip("\n")
  if cfg.strip_punctuation:
    s = s.strip().rstrip(".,;!?").strip("\"'`").strip()
  if cfg.ignore_case:
    s = s.casefold()
  return s


def _extract_text_answer(text: str) -> tuple[str, str]:
  boxed = last_boxed(text)
  if boxed is not None:
    return boxed, "boxed"
  hashes = _HASHES_RE.findall(text)
  if hashes:
    return hashes[-1], "####"
  m = list(re.finditer(r"answer\s*(?:is|:)\s*", text, re.IGNORECASE))
  if m:
    return text[m[-1].end():].split("\n")[0], "answer_is"
  return text, "whole"


@register_grader("exact_match", ExactMatchConfig)
def exact_match_grader(completion: str, task: Task, cfg: ExactMatchConfig = ExactMatchConfig()
                       ) -> GradeResult:
  """1.0 if the normalised (extracted) completion equals the normalised reference answer."""
  pred, how = _extract_text_answer(completion) if cfg.extract else (completion, "whole")
  gold, _ = _extract_text_answer(task.answer) if cfg.extract else (task.answer, "whole")
  pred_n, gold_n = _normalise(pred, cfg), _normalise(gold, cfg)
  info = {"parse_ok": bool(pred_n), "extracted": pred_n, "rule": how, "gold": gold_n}
  return GradeResult(1.0 if pred_n and pred_n == gold_n else 0.0, info)


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
