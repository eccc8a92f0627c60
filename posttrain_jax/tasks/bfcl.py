"""Task source and grader "bfcl": the single-turn categories of the Berkeley Function Calling
Leaderboard v4 (simple_python, multiple, parallel, parallel_multiple) as shipped by the
`bfcl-eval` package, graded by BFCL's own AST checker.

    --config.tasks.dataset=bfcl:simple --config.tasks.eval_fraction=0.3 --config.grader=bfcl

Install: `pip install --no-deps bfcl-eval` plus tree_sitter, tree-sitter-java,
tree-sitter-javascript and tenacity (the `suites` extra): bfcl-eval's own requirements pin
numpy 1.26 and pull every vendor SDK of its model handlers, none of which the checker uses.

Categories: "simple" is BFCL's `simple_python`; "multiple", "parallel", "parallel_multiple" as
named; several joined with "+" ("bfcl:simple+parallel"). Held-out split: a fixed hash of the
entry id (`TaskBankConfig.eval_fraction`, required).

Prompt: BFCL's own prompting-model system prompt for the entry's functions
(`system_prompt_pre_processing_chat_model`: the calls are to be written as
`[func(a=1, b="x"), ...]`), then the entry's question turns, exactly what BFCL sends an OSS
model in prompting mode. The answer is the entry's `ground_truth` (JSON).

Grader: BFCL's own decoder for prompting models (`default_decode_ast_prompting`, Python return
format) and its format check; a reply that does not decode, or decodes into something other
than function calls, scores 0 with `parse_ok=False` and BFCL's reason (a malformed tool call
costs the policy its reward). Otherwise `ast_checker(functions, calls, possible_answer,
Language.PYTHON, category, model)`: 1 if valid, else 0 with BFCL's `error_type` and `error`.

`ast_checker`'s module imports bfcl-eval's registry of model handlers (for one rule: a model
whose API cannot take "." in function names gets them with "_"). When that registry cannot be
imported (its vendor SDKs are not installed), a stand-in registry is put in its place in which
no model renames; we prompt with the original names, so none is needed.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import sys
import types

from posttrain_jax.graders import GradeResult, GraderError, register_grader
from posttrain_jax.tasks.bank import TaskBankConfig, TaskBankError, register_split_source
from posttrain_jax.tasks.task import Task, is_held_out

CATEGORIES = {"simple": "simple_python", "multiple": "multiple", "parallel": "parallel",
              "parallel_multiple": "parallel_multiple"}
MODEL_NAME = "posttrain_jax"   # the model name the checker is told (renames nothing)


class _NoRename:
  underscore_to_dot = False


@functools.lru_cache(maxsize=1)
def bfcl() -> types.SimpleNamespace:
  """BFCL's own functions this module calls, imported once."""
  try:
    import bfcl_eval  # noqa: F401
  except ImportError:
    raise TaskBankError("the bfcl task source needs the bfcl-eval package "
                        "(pip install --no-deps bfcl-eval; see posttrain_jax/tasks/bfcl.py)"
                        ) from None
  try:
    import bfcl_eval.constants.model_config  # noqa: F401
  except ImportError:  # the vendor SDKs of its model handlers are not installed (docstring)
    stand_in = types.ModuleType("bfcl_eval.constants.model_config")
    stand_in.MODEL_CONFIG_MAPPING = _Registry()
    sys.modules["bfcl_eval.constants.model_config"] = stand_in
  try:
    from bfcl_eval.constants.enums import Language, ReturnFormat
    from bfcl_eval.constants.eval_config import POSSIBLE_ANSWER_PATH, PROMPT_PATH
    from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker
    from bfcl_eval.model_handler.utils import (default_decode_ast_prompting,
                                               system_prompt_pre_processing_chat_model)
    from bfcl_eval.utils import is_function_calling_format_output
  except ImportError as e:
    raise TaskBankError(f"bfcl-eval's checker cannot be imported ({e}); install tree_sitter, "
                        "tree-sitter-java, tree-sitter-javascript and tenacity "
                        "(pip install 'posttrain_jax[suites]')") from None
  return types.SimpleNamespace(
      Language=Language, ReturnFormat=ReturnFormat, ast_checker=ast_checker,
      decode=default_decode_ast_prompting, is_calls=is_function_calling_format_output,
      system_prompt=system_prompt_pre_processing_chat_model,
      questions=PROMPT_PATH, answers=POSSIBLE_ANSWER_PATH)


class _Registry(dict):
  def __missing__(self, key):
    return _NoRename


def _jsonl(path) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


@functools.lru_cache(maxsize=8)
def entries(category: str) -> tuple[dict, ...]:
  """BFCL's entries of one category, each with its `possible_answer` attached."""
  b = bfcl()
  name = f"BFCL_v4_{CATEGORIES[category]}.json"
  answers = {a["id"]: a["ground_truth"] for a in _jsonl(b.answers / name)}
  out = []
  for e in _jsonl(b.questions / name):
    out.append({**e, "possible_answer": answers[e["id"]]})
  return tuple(out)


def _categories(cfg: TaskBankConfig) -> list[str]:
  names = (cfg.dataset or "").partition(":")[2]
  if not names:
    raise TaskBankError("the bfcl task source needs categories: TaskBankConfig.dataset="
                        f"'bfcl:<{'|'.join(CATEGORIES)}>' (several joined with '+')")
  cats = names.split("+")
  bad = [c for c in cats if c not in CATEGORIES]
  if bad:
    raise TaskBankError(f"bfcl has no single-turn category {bad[0]!r}; it has "
                        f"{', '.join(CATEGORIES)}")
  return cats


def _task(entry: dict, category: str) -> Task:
  turns = [dict(m) for m in entry["question"][0]]
  messages = bfcl().system_prompt(turns, entry["function"], entry["id"])
  return Task(id=entry["id"], prompt=messages, answer=json.dumps(entry["possible_answer"]),
              metadata={"bfcl": {"category": category, "id": entry["id"]}})


def _split(cfg: TaskBankConfig, held: bool) -> list[Task]:
  cats = _categories(cfg)
  if not cfg.eval_fraction > 0:
    raise TaskBankError("the bfcl task source needs TaskBankConfig.eval_fraction > 0 "
                        "(the share of its entries held out)")
  return [_task(e, c) for c in cats for e in entries(c)
          if is_held_out(e["id"], cfg.eval_fraction) == held]


register_split_source("bfcl", _split)


# ----------------------------------------------------------------------------------------------
# The grader: BFCL's decoder and AST checker.

@dataclasses.dataclass(frozen=True)
class BFCLGraderConfig:
  """Config of the "bfcl" grader (none: BFCL's own rules)."""


@functools.lru_cache(maxsize=4096)
def _entry(category: str, entry_id: str) -> dict:
  for e in entries(category):
    if e["id"] == entry_id:
      return e
  raise GraderError(f"BFCL has no entry {entry_id!r} in category {category!r}")


@register_grader("bfcl", BFCLGraderConfig)
def bfcl_grader(completion: str, task: Task, cfg: BFCLGraderConfig = BFCLGraderConfig()
                ) -> GradeResult:
  """1 iff BFCL's AST checker accepts the calls decoded from the completion."""
  del cfg
  ref = task.metadata.get("bfcl")
  if not isinstance(ref, dict):
    raise GraderError(f"task {task.id!r} is not a BFCL task (no metadata['bfcl'])")
  b, entry = bfcl(), _entry(ref["category"], ref["id"])
  try:
    calls = b.decode(completion, b.ReturnFormat.PYTHON, False)
  except Exception as e:  # noqa: BLE001 -- BFCL's decoder raises whatever ast raises
    return GradeResult(0.0, {"parse_ok": False, "error_type": "ast_decoder:decoder_failed",
                             "reason": f"Invalid syntax. Failed to decode AST. {e}"})
  if not b.is_calls(calls):
    return GradeResult(0.0, {"parse_ok": False,
                             "error_type": "ast_decoder:decoder_wrong_output_format",
                             "reason": "Did not output in the specified format."})
  verdict = b.ast_checker(entry["function"], calls, entry["possible_answer"], b.Language.PYTHON,
                          CATEGORIES[ref["category"]], MODEL_NAME)
  info = {"parse_ok": True, "calls": calls}
  if not verdict["valid"]:
    info.update(error_type=verdict.get("error_type"), feedback="; ".join(
        str(x) for x in verdict.get("error", [])))
  return GradeResult(float(verdict["valid"]), info)
