"""tool_math_fidelity: tool_math with SFT demonstrations that teach several paths per task, so
that the fidelity benchmark (benchmarks/fidelity.py) can watch GRPO choose between them.

The environment is tool_math's (ToolMathEnv, ToolMathConfig: same tool, grader, reward and
injectable tool-backend faults); only the demonstrations differ. Which path a task's gold chat
takes is fixed by the task (crc32 of its id, mod 4), so SFT data replays from the bank's seed:

    easy task   slot 0, 1   tool    call python(print(a+b)), copy its output into the answer
                slot 2, 3   direct  "The answer is v." (small operands: answerable without it)
    hard task   slot 0      tool    (a success when copied right)
                slot 1, 2   direct  (mostly wrong: a tiny model cannot multiply 2-digit numbers)
                slot 3      stall   call python on one operand again and again, never answer:
                                    the turn / tool-call budget runs out (a `timeout`)

Case 1 of the benchmark (infra faults on tool calls, easy tasks only) needs the task solvable
with and without the tool at similar accuracy; case 2 (hard tasks) needs a way to time out
that the policy already takes sometimes. `STALL_CALLS` tool-call turns outlast a budget of
max_turns ≤ STALL_CALLS (or max_tool_calls < STALL_CALLS).
"""
from __future__ import annotations

import zlib
from typing import Any

from posttrain_jax.envs.env import register_env
from posttrain_jax.envs.task import Task
from posttrain_jax.envs.tool_calls import ToolCall, render_call
from posttrain_jax.envs.tool_math import ToolMathConfig, ToolMathEnv

STALL_CALLS = 3                   # tool-call turns of a stall demonstration (no answer after)

_EASY = ("tool", "tool", "direct", "direct")
_HARD = ("tool", "direct", "direct", "stall")


def demonstration_path(task: Task) -> str:
  """"tool", "direct" or "stall": the path of `task`'s gold chat (module docstring)."""
  slot = zlib.crc32(task.id.encode()) % 4
  return (_HARD if task.metadata.get("difficulty") == "hard" else _EASY)[slot]


def _call(code: str, i: int, tool_format: str, result: str) -> list[dict[str, Any]]:
  return [{"role": "assistant", "content": render_call(ToolCall("python", {"code": code}),
                                                       tool_format)},
          {"role": "tool", "tool_call_id": f"call_{i}_0", "content": result}]


def demonstration(task: Task, tool_format: str) -> list[dict[str, Any]]:
  """The gold chat of `task` along its path (tool, direct or stall)."""
  expr, answer = task.metadata["expression"], task.answer
  chat: list[dict[str, Any]] = [{"role": "user", "content": str(task.prompt)}]
  path = demonstration_path(task)
  if path == "stall":
    operand = expr.replace("*", "+").replace("-", "+").split("+")[0]
    for i in range(STALL_CALLS):
      chat += _call(f"print({operand})", i, tool_format, operand)
    return chat
  if path == "tool":
    chat += _call(f"print({expr})", 0, tool_format, answer)
  chat.append({"role": "assistant", "content": f"The answer is {answer}."})
  return chat


register_env("tool_math_fidelity", ToolMathConfig, demonstration=demonstration)(ToolMathEnv)
