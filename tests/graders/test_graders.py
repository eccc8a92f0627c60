"""Graders: hand-written completions with the reward a human would give them."""
from fractions import Fraction

import pytest

from posttrain_jax.graders import (GRADERS,
    CountdownGraderConfig,
    ExactMatchConfig,
    ExpressionError,
    GraderError,
    NumericConfig,
    evaluate_expression,
    extract_final_answer,
    grade,
    last_boxed,
    make_grader,
    parse_number)
from posttrain_jax.tasks.task import Task


def _task(answer, **metadata):
  return Task(id="t", prompt="q", answer=answer, metadata=metadata)


# (completion, reference answer, reward, parse_ok)
NUMERIC_CASES = [
    ("19", "19", 1.0, True),
    ("The answer is 42.", "42", 1.0, True),
    ("answer: 42", "42", 1.0, True),
    ("First 3 apples, then 5 more, so 8 apples", "8", 1.0, True),          # last number
    ("I think 8, no wait, 9", "8", 0.0, True),                              # last number wins
    ("We get \\boxed{12} and then 7 is irrelevant", "12", 1.0, True),       # boxed beats last
    ("\\boxed{3} ... finally \\boxed{4}", "4", 1.0, True),                 # last boxed
    ("so \\boxed{\\frac{1}{2}}", "0.5", 1.0, True),                        # latex fraction
    ("\\boxed{\\dfrac{3}{4}}", "3/4", 1.0, True),
    ("\\boxed{-\\frac{1}{2}}", "-0.5", 1.0, True),                         # sign outside
    ("\\boxed{{1}/{2}}", "1/2", 1.0, True),                                # nested braces
    ("\\boxed{\\text{5 apples}}", "5", 0.0, False),                        # units only: no number left
    ("\\boxed{5\\text{ cm}}", "5", 1.0, True),                             # unit stripped
    ("\\boxed{x = 7}", "7", 1.0, True),                                    # rhs of equation
    ("Natalia sold 48+24 = 72 clips.\n#### 72", "72", 1.0, True),          # GSM8K style
    ("#### 1,234", "1234", 1.0, True),                                     # thousands commas
    ("The total is $1,234,567.", "1234567", 1.0, True),
    ("#### The total is 72 apples", "72", 1.0, True),
    ("x = -3.50", "-3.5", 1.0, True),                                      # negative decimal
    ("10-4", "4", 1.0, True),                                              # binary minus, not -4
    ("it drops to -4 degrees", "-4", 1.0, True),                           # genuine negative
    ("+5", "5", 1.0, True),                                                # leading plus
    ("12.0", "12", 1.0, True),                                             # trailing .0
    ("The answer is 7.", "7", 1.0, True),                                  # sentence period
    (".5 of them", "1/2", 1.0, True),                                      # leading-dot decimal
    ("50%", "50", 1.0, True),
    ("0.3333", "1/3", 0.0, True),                                          # beyond abs_tol 1e-6
    ("0.3333333", "1/3", 1.0, True),                                       # within abs_tol
    ("I don't know", "3", 0.0, False),                                     # no answer at all
    ("", "3", 0.0, False),
    ("\\boxed{}", "3", 0.0, False),                                        # empty box
    ("\\boxed{x}", "3", 0.0, False),                                       # non-numeric box
    ("\\boxed{3", "3", 1.0, True),                                         # unclosed box -> last number
    ("42", "The reasoning ... #### 42", 1.0, True),                        # gold in GSM8K format
    ("\\boxed 9", "9", 1.0, True),                                         # brace-less box
]


@pytest.mark.parametrize("completion,answer,reward,parse_ok", NUMERIC_CASES)
def test_numeric(completion, answer, reward, parse_ok):
  r = grade("numeric", completion, _task(answer))
  assert (r.reward, r.parse_ok) == (reward, parse_ok), r.info


def test_numeric_info_and_strict_mode():
  r = grade("numeric", "so \\boxed{\\frac{1}{2}}", _task("0.5"))
  assert r.info["extracted"] == "\\frac{1}{2}" and r.info["rule"] == "boxed"
  assert r.info["pred"] == "1/2" and r.info["gold"] == "1/2"
  strict = make_grader("numeric", NumericConfig(last_number_fallback=False))
  assert strict("so 8", _task("8")).reward == 0.0
  assert not strict("so 8", _task("8")).parse_ok
  assert strict("#### 8", _task("8")).reward == 1.0


def test_numeric_bad_reference_is_a_data_error():
  with pytest.raises(GraderError, match="task 't'.*not a number"):
    grade("numeric", "5", _task("five"))


def test_last_boxed_nested():
  assert last_boxed("a \\boxed{\\frac{a}{\\sqrt{b}}} b") == "\\frac{a}{\\sqrt{b}}"
  assert last_boxed("\\fbox{1} \\boxed{2}") == "2"
  assert last_boxed("none here") is None


@pytest.mark.parametrize("text,value", [
    ("1,234", 1234), ("-\\frac{1}{2}", Fraction(-1, 2)), ("\\$12", 12), ("3/4", Fraction(3, 4)),
    ("7.", 7), ("(-3)", -3), ("-(3)/(4)", Fraction(-3, 4)), ("1/0", None), ("abc", None),
    ("1,23", None), ("2.50", Fraction(5, 2))])
def test_parse_number(text, value):
  assert parse_number(text) == value


def test_extract_rules_in_order():
  assert extract_final_answer("\\boxed{1} #### 2 answer is 3 4") == ("1", "boxed")
  assert extract_final_answer("#### 2\nanswer is 3 4") == ("2", "####")
  assert extract_final_answer("answer is 3, then 4") == ("3", "answer_is")
  assert extract_final_answer("3 then 4") == ("4", "last_number")
  assert extract_final_answer("nothing") == (None, "none")


EXACT_CASES = [
    ("Paris", "Paris", 1.0),
    ("  paris \n", "Paris", 1.0),                 # case and whitespace
    ("New   York", "new york", 1.0),
    ("Paris.", "Paris", 0.0),                     # punctuation kept by default
    ("The answer is Paris", "Paris", 1.0),        # extraction
    ("\\boxed{Paris}", "Paris", 1.0),
    ("London", "Paris", 0.0),
]


@pytest.mark.parametrize("completion,answer,reward", EXACT_CASES)
def test_exact_match(completion, answer, reward):
  assert grade("exact_match", completion, _task(answer)).reward == reward


def test_exact_match_config():
  strict = make_grader("exact_match", ExactMatchConfig(ignore_case=False))
  assert strict("paris", _task("Paris")).reward == 0.0
  loose = make_grader("exact_match", ExactMatchConfig(strip_punctuation=True))
  assert loose("Paris.", _task("Paris")).reward == 1.0
  empty = grade("exact_match", "   ", _task("Paris"))
  assert (empty.reward, empty.parse_ok) == (0.0, False)


# (completion, numbers, target, reward, parse_ok)
COUNTDOWN_CASES = [
    ("(3+5)*2", [3, 5, 2], 16, 1.0, True),
    ("<answer>(3+5)*2</answer>", [3, 5, 2], 16, 1.0, True),
    ("think... <answer>3*5</answer> no: <answer>(3+5)*2</answer>", [3, 5, 2], 16, 1.0, True),
    ("\\boxed{(3+5)\\times 2}", [3, 5, 2], 16, 1.0, True),
    ("(3+5)*2 = 16", [3, 5, 2], 16, 1.0, True),                # trailing "= target"
    ("Let me try.\n3*5+2", [3, 5, 2], 17, 1.0, True),          # last line
    ("3*5+2", [3, 5, 2], 16, 0.0, True),                       # wrong value
    ("(5+5)*2", [3, 5, 2], 20, 0.0, True),                     # 5 used twice
    ("4*4", [3, 5, 2], 16, 0.0, True),                         # number not given
    ("8/(3-1)", [8, 3, 1], 4, 1.0, True),                      # exact division
    ("7/2*2", [7, 2, 2], 7, 1.0, True),                        # fractions are exact
    ("5/(2-2)", [5, 2, 2], 1, 0.0, True),                      # division by zero
    ("__import__('os').system('x')", [1], 1, 0.0, False),     # never executed
    ("2**10", [2, 10], 1024, 0.0, False),                      # power not allowed
    ("-3+5", [3, 5], 2, 0.0, False),                           # unary minus not allowed
    ("", [3, 5], 8, 0.0, False),
]


@pytest.mark.parametrize("completion,numbers,target,reward,parse_ok", COUNTDOWN_CASES)
def test_countdown(completion, numbers, target, reward, parse_ok):
  r = grade("countdown", completion, _task(str(target), numbers=numbers, target=target))
  assert (r.reward, r.parse_ok) == (reward, parse_ok), r.info


def test_countdown_use_all_and_bad_task():
  task = _task("15", numbers=[3, 5, 2], target=15)
  assert grade("countdown", "3*5", task).reward == 1.0
  g = make_grader("countdown", CountdownGraderConfig(use_all=True))
  r = g("3*5", task)
  assert r.reward == 0.0 and "does not use" in r.info["error"]
  with pytest.raises(GraderError, match="needs metadata 'numbers'"):
    grade("countdown", "1+1", _task("2"))


def test_evaluate_expression_is_safe_and_exact():
  assert evaluate_expression("(1+2)*3/4") == (Fraction(9, 4), [1, 2, 3, 4])
  for bad in ("a+1", "len('x')", "1 if 1 else 2", "[1]", "1.5+1", "True+1", "2**3", "1" * 300):
    with pytest.raises(ExpressionError):
      evaluate_expression(bad)


def test_registry_names_and_unknown_grader():
  assert {"numeric", "exact_match", "countdown"} <= set(GRADERS.names())
  names = ", ".join(GRADERS.names())   # every discovered module's, sorted (a new file joins)
  assert {"bfcl", "hidden_rule", "humaneval", "judge", "reasoning_gym"} <= set(GRADERS.names())
  with pytest.raises(KeyError, match=f"registered graders: {names}"):
    make_grader("numerik")
  with pytest.raises(TypeError, match="NumericConfig"):
    make_grader("numeric", ExactMatchConfig())
