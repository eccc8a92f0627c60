"""A task whose rule only the grader's free-text feedback reveals (the feedback-learning benchmark).

Generator "string_rule": a word w of `min_len..max_len` letters and a rule R that maps it to the
answer R(w). Rules: copy (w), reverse, upper, shift (each letter one on in the alphabet,
wrapping within `letters`). A prompt either states its rule, "rule: reverse | abc", or states
none, "abc". A stated rule is the task's rule; an unstated one is `hidden_rule`, which no prompt
ever shows. The SFT solution of an unstated prompt is `default_rule` applied to w (what the
warm-start model believes an unstated rule is); its `answer` (what the grader checks) is
`hidden_rule` applied to w. With `stated_frac` = 0.75 SFT teaches every rule in context and the
prior "unstated means copy"; an RL phase on unstated prompts (stated_frac = 0) then has to find
the hidden rule, and only the grader's feedback says what it is.

Grader "hidden_rule": reward 1 iff the completion (stripped) equals the answer; the feedback
text names the task's rule, `feedback_template.format(rule=...)` (default "rule: reverse", the
same words a stated prompt uses), on a failed attempt and, with `on_success`, on a correct one.

Held-out split: by (rule stated or not, word), independent of the seed.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from posttrain_jax.graders import GradeResult, register_grader
from posttrain_jax.tasks.synthetic import register_generator
from posttrain_jax.tasks.task import Task
from posttrain_jax.errors import UserError

RULES = ("copy", "reverse", "upper", "shift")


def apply_rule(rule: str, word: str, letters: str) -> str:
  if rule == "copy":
    return word
  if rule == "reverse":
    return word[::-1]
  if rule == "upper":
    return word.upper()
  if rule == "shift":
    return "".join(letters[(letters.index(c) + 1) % len(letters)] for c in word)
  raise UserError(f"unknown rule {rule!r}; valid: {RULES}")


@dataclasses.dataclass(frozen=True)
class StringRuleConfig:
  """Words over `letters`, each with a stated rule or the hidden one."""
  letters: str = "abcdefgh"       # the alphabet of words (lower case)
  min_len: int = 3                # letters per word
  max_len: int = 5
  stated_rules: tuple[str, ...] = RULES  # rules a prompt may state
  stated_frac: float = 0.0        # share of prompts that state their rule
  hidden_rule: str = "reverse"    # the rule of an unstated prompt (never shown)
  default_rule: str = "copy"      # the SFT solution of an unstated prompt (the prior)

  def __post_init__(self):
    named = [("hidden_rule", self.hidden_rule), ("default_rule", self.default_rule)]
    named += [(f"stated_rules[{i}]", r) for i, r in enumerate(self.stated_rules)]
    for name, value in named:
      if value not in RULES:
        raise UserError(f"StringRuleConfig.{name} is {value!r}; valid: {RULES}")
    if not 1 <= self.min_len <= self.max_len:
      raise UserError(f"StringRuleConfig: need 1 ≤ min_len ≤ max_len, got {self.min_len}, "
                      f"{self.max_len}")
    if not 0.0 <= self.stated_frac <= 1.0:
      raise UserError(f"StringRuleConfig.stated_frac must be in [0, 1], got {self.stated_frac}")
    if len(set(self.letters)) != len(self.letters) or not self.letters.islower():
      raise UserError(f"StringRuleConfig.letters must be distinct lower-case letters, got "
                      f"{self.letters!r}")


@register_generator("string_rule", StringRuleConfig)
def draw_string_rule(cfg: StringRuleConfig, rng: np.random.Generator) -> tuple[str, Task]:
  n = int(rng.integers(cfg.min_len, cfg.max_len + 1))
  word = "".join(cfg.letters[int(i)] for i in rng.integers(len(cfg.letters), size=n))
  stated = bool(rng.random() < cfg.stated_frac)
  if stated:
    rule = cfg.stated_rules[int(rng.integers(len(cfg.stated_rules)))]
    prompt, solution = f"rule: {rule} | {word}", apply_rule(rule, word, cfg.letters)
  else:
    rule, prompt = cfg.hidden_rule, word
    solution = apply_rule(cfg.default_rule, word, cfg.letters)
  answer = apply_rule(rule, word, cfg.letters)
  key = f"{rule if stated else '-'}|{word}"
  return key, Task(id=f"string_rule:{key}", prompt=prompt, answer=answer,
                   metadata={"solution": solution, "reference": answer, "rule": rule,
                             "stated": stated,
                             "word": word, "generator": "string_rule"})


@dataclasses.dataclass(frozen=True)
class HiddenRuleGraderConfig:
  """Exact match, with feedback that names the task's rule."""
  feedback_template: str = "rule: {rule}"  # the feedback text; {rule} is the task's rule
  on_success: bool = True         # feedback on correct attempts too (else only on failures)


@register_grader("hidden_rule", HiddenRuleGraderConfig)
def hidden_rule_grader(completion: str, task: Task,
                       cfg: HiddenRuleGraderConfig = HiddenRuleGraderConfig()) -> GradeResult:
  ok = completion.strip() == task.answer
  info = {"parse_ok": True, "extracted": completion.strip()}
  if not ok or cfg.on_success:
    info["feedback"] = cfg.feedback_template.format(rule=task.metadata.get("rule", "?"))
  return GradeResult(float(ok), info)
