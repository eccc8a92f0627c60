"""A grader's own settings come from the run config (`grader_config`, class from the registry),
checked with errors that name the field; the trainer grades with them."""
import pytest

from posttrain_jax.config_io import ConfigTypeError
from posttrain_jax.graders import make_grader
from posttrain_jax.graders import NumericConfig, extract_final_answer
from posttrain_jax.tasks.task import Task
from posttrain_jax.run_config import run_config_from_dict


def _task(answer):
  return Task(id="t", prompt="q", answer=answer)


@pytest.mark.parametrize("text,first,last", [
    ("57 12", "57", "12"),
    ("57\n57 + 3 = 60", "57", "60"),
    ("-3, then 4/5", "-3", "4/5"),
    ("no digits", None, None),
])
def test_pick_first_or_last_number(text, first, last):
  assert extract_final_answer(text, "first")[0] == first
  assert extract_final_answer(text, "last")[0] == last
  assert extract_final_answer(text)[0] == last   # the default is unchanged


def test_pick_applies_only_to_the_bare_number_fallback():
  first = make_grader("numeric", NumericConfig(pick="first"))
  last = make_grader("numeric", NumericConfig())
  assert (first("57 12", _task("57")).reward, last("57 12", _task("57")).reward) == (1.0, 0.0)
  assert (first("57 12", _task("12")).reward, last("57 12", _task("12")).reward) == (0.0, 1.0)
  # a marked answer wins whatever `pick` says
  assert first("3 then \\boxed{12} 9", _task("12")).reward == 1.0
  assert first("5 #### 12", _task("12")).reward == 1.0


def test_grader_config_from_the_run_config():
  cfg = run_config_from_dict({"grader_config": {"pick": "first", "abs_tol": 0.5}})
  assert cfg.grader_cfg() == NumericConfig(pick="first", abs_tol=0.5)
  assert run_config_from_dict({}).grader_cfg() == NumericConfig()
  em = run_config_from_dict({"grader": "exact_match", "grader_config": {"ignore_case": False}})
  assert type(em.grader_cfg()).__name__ == "ExactMatchConfig" and not em.grader_cfg().ignore_case


@pytest.mark.parametrize("over,match", [
    ({"grader_config": {"pick": "middle"}},
     r"config\.grader_config: NumericConfig\.pick is 'middle'; valid: \('last', 'first'\)"),
    ({"grader_config": {"abs_tol": -1.0}}, r"config\.grader_config: NumericConfig\.abs_tol must be ≥ 0"),
    ({"grader_config": {"pick": 1}}, r"config\.grader_config\.pick: expected str, got int 1"),
    ({"grader": "exact_match", "grader_config": {"pick": "first"}},
     r"config\.grader_config: unknown field\(s\) \['pick'\]; ExactMatchConfig has"),
    ({"grader": "numerik"}, r"grader='numerik': unknown grader 'numerik'; registered graders: .*numeric"),
])
def test_bad_grader_config_names_the_field(over, match):
  with pytest.raises(ConfigTypeError, match=match):
    run_config_from_dict(over)


def test_a_grader_config_of_another_grader_is_refused():
  from posttrain_jax.graders import ExactMatchConfig
  from posttrain_jax.run_config import RunConfig
  with pytest.raises(ValueError, match=r"grader_config is a ExactMatchConfig; grader 'numeric' "
                                       r"takes a NumericConfig"):
    RunConfig(grader_config=ExactMatchConfig())


@pytest.mark.parametrize("over,match", [
    ({"eval": {"target_accuracy": 1.5}}, r"config\.eval: EvalConfig\.target_accuracy must be in \(0, 1\]"),
    ({"eval": {"target_accuracy": 0.5, "every_steps": 0}}, r"every_steps must be ≥ 1"),
    ({"eval": {"target_accuracy": 0.5, "greedy": False}},
     r"target_metric='accuracy_greedy' is not measured"),
    ({"eval": {"target_metric": "acc"}}, r"config\.eval: EvalConfig\.target_metric is 'acc'"),
    ({"eval": {"sampled": False, "greedy": False}}, r"both False"),
    ({"train_budget_s": 0.0}, r"config: train_budget_s must be > 0"),
    ({"train_budget_s": "1h"}, r"config\.train_budget_s: expected .*, got str '1h'"),
])
def test_bad_stop_settings_name_the_field(over, match):
  with pytest.raises(ConfigTypeError, match=match):
    run_config_from_dict(over)
