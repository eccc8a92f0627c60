"""Task source and grader "reasoning_gym": the procedural datasets of the `reasoning-gym`
package (pip install reasoning-gym), scored by each dataset's own `score_answer`.

    --config.tasks.dataset=reasoning_gym:basic_arithmetic --config.grader=reasoning_gym

`TaskBankConfig.dataset_config` (a dict) is passed to the dataset's config class
(`reasoning_gym.create_dataset(name, seed=, size=, **options)`), except two keys of ours:
`system_prompt`, the name of one of reasoning-gym's own SYSTEM_PROMPTS ("default": think step
by step, then the answer in `<answer>...</answer>`; None or "" for no system turn), and
`shots` (default 0): that many worked examples before the question, each a user turn with a
row of the same dataset (seed `base + SHOT_SEED`, never a held-out question) and an
assistant turn `<answer>{its answer}</answer>`. A small model that never writes the tag when
told to (SmolLM2-135M-Instruct: none of its replies) copies it from two examples. With
`shot_pool` = P > 0 (default 0: one set of examples for every prompt) each task draws its
`shots` examples from P rows, by a generator seeded with its split's seed and row: the same
task always gets the same examples, and a held-out score is an average over many example sets
rather than one. Why: trained on gcd with one fixed pair, SmolLM2's held-out score rose
10.5 points with two other pairs in the prompt and 0 with its own (benchmarks/README.md).

Split by seed. The held-out tasks are rows 0..n-1 of the dataset made with seed
`base + EVAL_SEED` (n = eval_size, default 256). The training tasks are the rows of the
dataset made with seed `base`, `synthetic_size` of them (default 100,000); a training row
whose question is also a held-out question is replaced by the row `size` further on (and so
on), so no held-out question is ever trained on. A dataset whose problem space is too small
for that is an error naming it.

`base` is `cfg.seed * SEED_STRIDE`, not `cfg.seed`: reasoning-gym draws row `i` of a dataset of
seed `s` from `Random(s + i)`, so the datasets of seeds 0 and 3 share all rows but three (the
held-out sets of `tasks.seed=0` and `=3` were 253 of 256 the same). Seeds a stride apart share
none of the rows any split reads (training rows go up to `size * 64`).

Grader: reasoning-gym's `extract_answer` takes the last `<answer>` tag of the completion; no
tag scores 0 with `parse_ok=False` and the reason. Otherwise the reward is the dataset's
`score_answer(answer, entry)` in [0, 1] (some datasets give partial credit), the entry being
the task's row regenerated from its dataset, seed and index (task.metadata["reasoning_gym"]).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import random
from typing import Any, Optional

from posttrain_jax.graders import GradeResult, GraderError, register_grader
from posttrain_jax.tasks.bank import TaskBankConfig, TaskBankError, register_task_source
from posttrain_jax.tasks.task import Task

EVAL_SEED = 1_000_003       # held-out seed offset
SEED_STRIDE = 10_000_019    # between task seeds: > every offset a split reads (module docstring)
SHOT_SEED = 2_000_003       # worked examples' seed offset
DEFAULT_SIZE = 100_000      # training rows when synthetic_size is None
_TRIES = 64                 # rows tried per training index before the problem space is too small
OUR_KEYS = ("shots", "shot_pool", "system_prompt")   # dataset_config keys of ours, not the dataset's


def _package():
  try:
    import reasoning_gym
  except ImportError:
    raise TaskBankError("the reasoning_gym task source needs the reasoning-gym package "
                        "(pip install reasoning-gym)") from None
  return reasoning_gym


def _split_name(cfg: TaskBankConfig) -> str:
  name = (cfg.dataset or "").partition(":")[2]
  if not name:
    raise TaskBankError("the reasoning_gym task source needs a dataset name: "
                        "TaskBankConfig.dataset='reasoning_gym:<name>', e.g. "
                        "'reasoning_gym:basic_arithmetic'")
  return name


def _options(cfg: TaskBankConfig) -> tuple[Optional[str], int, int, dict]:
  """(system prompt name, shots, shot_pool, the dataset's own options)."""
  if not isinstance(cfg.dataset_config or {}, dict):
    raise TaskBankError(f"TaskBankConfig.dataset_config must be a dict for reasoning_gym, got "
                        f"{type(cfg.dataset_config).__name__}")
  opts = dict(cfg.dataset_config or {})
  shots, pool = opts.pop("shots", 0), opts.pop("shot_pool", 0)
  for key, v in (("shots", shots), ("shot_pool", pool)):
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
      raise TaskBankError(f"TaskBankConfig.dataset_config[{key!r}] must be an int >= 0, got "
                          f"{v!r}")
  if 0 < pool < shots:
    raise TaskBankError(f"TaskBankConfig.dataset_config['shot_pool'] = {pool} is fewer rows "
                        f"than the {shots} shots each task draws from it")
  return opts.pop("system_prompt", "default"), shots, pool, opts


@functools.lru_cache(maxsize=64)
def _dataset(name: str, options_json: str, seed: int, size: int):
  rg = _package()
  from reasoning_gym.factory import DATASETS
  if name not in DATASETS:
    raise TaskBankError(f"reasoning_gym has no dataset {name!r}; it has {len(DATASETS)}, e.g. "
                        f"{', '.join(sorted(DATASETS)[:8])}, ...")
  try:
    return rg.create_dataset(name, seed=seed, size=size, **json.loads(options_json))
  except (TypeError, ValueError, AssertionError) as e:
    raise TaskBankError(f"reasoning_gym dataset {name!r} refuses its config "
                        f"{options_json}: {e}") from None


def _system(prompt_name: Optional[str]) -> Optional[str]:
  if not prompt_name:
    return None
  from reasoning_gym.utils import SYSTEM_PROMPTS
  if prompt_name not in SYSTEM_PROMPTS:
    raise TaskBankError(f"reasoning_gym has no system prompt {prompt_name!r}; it has "
                        f"{', '.join(SYSTEM_PROMPTS)}")
  return SYSTEM_PROMPTS[prompt_name]


class ReasoningGymSource:
  """Random access to a reasoning-gym dataset's rows as Tasks (module docstring)."""

  def __init__(self, cfg: TaskBankConfig, seed: int, size: int,
               avoid: frozenset[str] = frozenset(), examples: tuple = ()):
    """`examples`: the worked examples, (user, assistant) message pairs; every task starts with
    all of them, or with `shots` of them drawn per task when there are more (shot_pool)."""
    self.name = _split_name(cfg)
    prompt_name, self.shots, _, opts = _options(cfg)
    self.options_json = json.dumps(opts, sort_keys=True)
    self.system = _system(prompt_name)
    self.seed, self.size, self.avoid, self.examples = seed, size, avoid, examples
    self.ds = _dataset(self.name, self.options_json, seed, size * _TRIES)

  def __len__(self) -> int:
    return self.size

  def __getitem__(self, index: int) -> Task:
    for k in range(_TRIES):
      row = int(index) + k * self.size
      entry = self.ds[row]
      if entry["question"] not in self.avoid:
        return self._task(row, entry)
    raise TaskBankError(f"reasoning_gym:{self.name}: {_TRIES} rows in a row are held-out "
                        "questions; its problem space is too small for this held-out set")

  def _task(self, row: int, entry: dict) -> Task:
    messages = ([{"role": "system", "content": self.system}] if self.system else [])
    pairs = self.examples
    if len(pairs) > self.shots:   # a shot pool: this task's own draw, never its own question
      others = [pair for pair in pairs if pair[0]["content"] != entry["question"]]
      pairs = random.Random(f"{self.seed}:{row}").sample(others, min(self.shots, len(others)))
    messages += [dict(m) for pair in pairs for m in pair]
    messages.append({"role": "user", "content": entry["question"]})
    ref = {"dataset": self.name, "options": self.options_json, "seed": self.seed,
           "size": self.size * _TRIES, "index": row}
    return Task(id=f"rg:{self.name}:{self.seed}:{row}", prompt=messages,
                answer=str(entry["answer"]), metadata={"reasoning_gym": ref,
                                                     "solution": f"<answer>{entry['answer']}</answer>"})

  def __repr__(self) -> str:
    return f"ReasoningGymSource({self.name!r}, seed={self.seed}, rows={self.size})"


def _base(cfg: TaskBankConfig) -> int:
  """The reasoning-gym seed of `cfg.seed`'s training rows (module docstring: SEED_STRIDE)."""
  return cfg.seed * SEED_STRIDE


def _held_out(cfg: TaskBankConfig, n: int) -> tuple[frozenset[str], tuple]:
  """The held-out questions and the worked examples, (user, assistant) message pairs: `shots`
  of them, or `shot_pool` for the tasks to draw from; never a held-out question."""
  held = ReasoningGymSource(cfg, seed=_base(cfg) + EVAL_SEED, size=n)
  questions = frozenset(held.ds[i]["question"] for i in range(n))
  _, shots, pool_size, _ = _options(cfg)
  if not shots:
    return questions, ()
  size = max(shots, pool_size)
  pool = ReasoningGymSource(cfg, seed=_base(cfg) + SHOT_SEED, size=size, avoid=questions)
  return questions, tuple(
      (task.messages[-1], {"role": "assistant", "content": f"<answer>{task.answer}</answer>"})
      for task in (pool[i] for i in range(size)))


def _eval_tasks(cfg: TaskBankConfig, n: int) -> list[Task]:
  _, examples = _held_out(cfg, n)
  src = ReasoningGymSource(cfg, seed=_base(cfg) + EVAL_SEED, size=n, examples=examples)
  return [src[i] for i in range(n)]


@register_task_source("reasoning_gym", reads_path=False, eval_tasks=_eval_tasks)
def _open(cfg: TaskBankConfig, path: Optional[str] = None,
          eval_fraction: float = 0.0) -> ReasoningGymSource:
  del path, eval_fraction
  avoid, examples = _held_out(cfg, 256 if cfg.eval_size is None else cfg.eval_size)
  return ReasoningGymSource(cfg, seed=_base(cfg), size=cfg.synthetic_size or DEFAULT_SIZE,
                            avoid=avoid, examples=examples)


# ----------------------------------------------------------------------------------------------
# The grader: the dataset's own scorer.

@dataclasses.dataclass(frozen=True)
class ReasoningGymGraderConfig:
  """Config of the "reasoning_gym" grader."""
  tag: str = "answer"           # the tag reasoning-gym's extract_answer reads


@functools.lru_cache(maxsize=4096)
def _row(name: str, options_json: str, seed: int, size: int, index: int) -> dict:
  """A dataset row, generated once for the group of completions that are graded against it."""
  return _dataset(name, options_json, seed, size)[index]


def _entry(task: Task) -> tuple[Any, dict]:
  ref = task.metadata.get("reasoning_gym")
  if not isinstance(ref, dict):
    raise GraderError(f"task {task.id!r} is not a reasoning_gym task (no "
                      "metadata['reasoning_gym'])")
  key = (ref["dataset"], ref["options"], ref["seed"], ref["size"])
  ds, entry = _dataset(*key), _row(*key, ref["index"])
  if str(entry["answer"]) != task.answer:
    raise GraderError(f"task {task.id!r}: its row regenerates with answer {entry['answer']!r}, "
                      f"the task says {task.answer!r} (another reasoning-gym version?)")
  return ds, entry


@register_grader("reasoning_gym", ReasoningGymGraderConfig)
def reasoning_gym_grader(completion: str, task: Task,
                         cfg: ReasoningGymGraderConfig = ReasoningGymGraderConfig()
                         ) -> GradeResult:
  """The dataset's own `score_answer` of the last `<answer>` tag's text."""
  from reasoning_gym.utils import extract_answer
  ds, entry = _entry(task)
  answer = extract_answer(completion, tag_name=cfg.tag)
  if answer is None:
    return GradeResult(0.0, {"parse_ok": False,
                             "reason": f"no <{cfg.tag}>...</{cfg.tag}> in the completion"})
  score = float(ds.score_answer(answer=answer, entry=entry))
  return GradeResult(score, {"parse_ok": True, "extracted": answer})
