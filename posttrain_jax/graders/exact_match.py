"""The "exact_match" grader: the (optionally extracted) final answer equals `task.answer` after
whitespace / case normalisation."""
from __future__ import annotations

from typing import TYPE_CHECKING

import dataclasses
import re

from posttrain_jax.graders.answers import _HASHES_RE, last_boxed
from posttrain_jax.graders.base import GradeResult, register_grader

if TYPE_CHECKING:   # graders read tasks, tasks import no grader module at run time
  from posttrain_jax.tasks.task import Task


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


