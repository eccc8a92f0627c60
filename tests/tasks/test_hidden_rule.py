"""tasks/hidden_rule.py: the rule task whose hidden rule only the grader's feedback states."""
import pytest

from posttrain_jax.tasks import distinct_tasks, generate_task
from posttrain_jax.graders import make_grader
from posttrain_jax.tasks.hidden_rule import (HiddenRuleGraderConfig,
    StringRuleConfig,
    apply_rule,
    hidden_rule_grader)
from posttrain_jax.errors import UserError


def test_rules_against_plain_python():
  assert apply_rule("copy", "abc", "abcdefgh") == "abc"
  assert apply_rule("reverse", "abh", "abcdefgh") == "hba"
  assert apply_rule("upper", "abh", "abcdefgh") == "ABH"
  assert apply_rule("shift", "agh", "abcdefgh") == "bha"     # wraps within the alphabet


def test_stated_prompts_carry_their_rule_and_unstated_ones_never_show_the_hidden_one():
  cfg = StringRuleConfig(stated_frac=0.5, hidden_rule="shift", default_rule="copy")
  tasks = [generate_task("string_rule", cfg, 0, i, eval_fraction=0.1) for i in range(200)]
  stated = [t for t in tasks if t.metadata["stated"]]
  unstated = [t for t in tasks if not t.metadata["stated"]]
  assert 60 < len(stated) < 140 and unstated
  for t in stated:
    rule, word = t.prompt.split(" | ")
    assert rule == f"rule: {t.metadata['rule']}" and word == t.metadata["word"]
    assert t.answer == t.metadata["solution"] == apply_rule(t.metadata["rule"], word, cfg.letters)
  for t in unstated:
    assert t.prompt == t.metadata["word"] and "rule" not in t.prompt
    assert t.answer == apply_rule("shift", t.prompt, cfg.letters)   # graded by the hidden rule
    assert t.metadata["solution"] == t.prompt                        # SFT teaches the prior
    assert t.metadata["reference"] == t.answer                       # a reference teacher sees
  from posttrain_jax.teacher import CONTEXTS, TeacherConfig          # the answer, not the prior
  t = unstated[0]
  assert CONTEXTS.get("reference")(None, [], t, TeacherConfig(context="reference")) == (
      f"A correct solution: {t.answer}")
  held = {t.id for t in distinct_tasks("string_rule", cfg, 50, eval_fraction=0.1)}
  assert held and not held & {t.id for t in tasks}


def test_the_grader_names_the_rule_in_its_feedback():
  t = generate_task("string_rule", StringRuleConfig(), 0, 0, eval_fraction=0.1)
  wrong, right = make_grader("hidden_rule")(t.prompt, t), make_grader("hidden_rule")(t.answer, t)
  assert (wrong.reward, right.reward) == (0.0, 1.0)
  assert wrong.info["feedback"] == right.info["feedback"] == "rule: reverse"
  quiet = hidden_rule_grader(t.answer + " ", t, HiddenRuleGraderConfig(on_success=False))
  assert quiet.reward == 1.0 and "feedback" not in quiet.info


@pytest.mark.parametrize("bad", [dict(hidden_rule="rot13"), dict(stated_rules=("copy", "x")),
                                 dict(min_len=0), dict(stated_frac=1.5), dict(letters="aab")])
def test_config_errors(bad):
  with pytest.raises(UserError):
    StringRuleConfig(**bad)
