"""Graders: pure functions `(completion_text, task) -> GradeResult(reward, info)` by name.

    grader = make_grader("numeric")            # (completion, task) -> GradeResult(reward, info)
    grader("19", task).reward                  # 1.0

Built in: "numeric" (numeric.py), "exact_match" (exact_match.py), "countdown" (countdown.py),
"judge" (judge.py: an LLM behind any OpenAI-compatible endpoint scores by a rubric -- a group of
answers together with `grade_group` -- and its critique becomes the trajectory's feedback);
task families and environments register their own ("hidden_rule", tasks/hidden_rule.py). The
registry (base.py) imports every module of this package on its first lookup, so a new grader is
one file here plus its test.
"""
from posttrain_jax.graders.answers import extract_final_answer, last_boxed, parse_number
from posttrain_jax.graders.base import (GRADERS, GradeResult, Grader, GraderError, GraderSpec,
                                        grade, grade_group, grader_metrics, make_grader,
                                        register_grader)
from posttrain_jax.graders.countdown import (CountdownGraderConfig, ExpressionError,
                                             evaluate_expression, extract_expression)
from posttrain_jax.graders.exact_match import ExactMatchConfig
from posttrain_jax.graders.judge import Judge, JudgeConfig, JudgeConfigError, JudgeError
from posttrain_jax.graders.numeric import NUMBER_PICKS, NumericConfig

__all__ = ["GRADERS", "CountdownGraderConfig", "ExactMatchConfig", "ExpressionError",
           "GradeResult", "Grader", "GraderError", "GraderSpec", "Judge", "JudgeConfig",
           "JudgeConfigError", "JudgeError", "NUMBER_PICKS", "NumericConfig",
           "evaluate_expression", "extract_expression", "extract_final_answer", "grade",
           "grade_group", "grader_metrics", "last_boxed", "make_grader", "parse_number",
           "register_grader"]
