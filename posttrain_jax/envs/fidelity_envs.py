"""The fidelity benchmark's environments (benchmarks/fidelity.py): tool_math with SFT
demonstrations that teach several paths per task, so that GRPO can be watched choosing between
them under naive scoring and under ours.

Each is tool_math's environment (ToolMathEnv, ToolMathConfig: same python tool, grader, reward
and injectable tool-backend faults) registered under its own name with its own demonstrations.
Which path a task's gold chat takes is fixed by the task (crc32 of its id, mod the number of
slots), so SFT data replays from the bank's seed. Both use tool_math's 4-digit × 4-digit
products, the prompt layout in which the tiny model learns to copy digits (configs/tool_math.py).

tool_math_fidelity_infra (case 1: infra faults on tool calls), slots of 4. Two more tools:
`check` asks the same backend for the episode's last python program's outcome again (its
output, or its error) and `submit` ends the episode with what the last program printed as the
answer (it reaches no backend). A check meets the injected faults exactly as a python call does
(its own draw of the same stream) but starts no new sandbox process: a program's outcome here
is a function of its code (a print of a product), so a rerun would return the same, and its
process start was most of the benchmark's time (py-spy, 2026-12-04: 47% of an RL step in
check's Popen, which blocks the event loop):
    slot 0      tool     call python(print(a*b)), then submit()
    slot 1-3    verify   call python(print(a*b)), check() 5 times, then submit(): 6 backend
                         calls instead of 1, ~3× the tokens, and exactly as correct (neither
                         check nor submit copies anything: the answer is the first call's).
                         check() answers "<output> (run k of 5)", so the policy reads when to
                         submit: without the count, the SFT model miscounted its own identical
                         calls (a 6th check, "checit", a stray tag) and 26% of episodes ran out
                         of budget at the first GRPO step, so the long path lost on its merits
  With 10% of backend calls failing on our side, a verify episode meets a fault 47% of the
  time and a tool episode 10%: scoring a fault 0 makes the longer path look worse than it is.
  Tried first and dropped, because the long path then failed on its own merits (the tiny model
  does not learn a new copy in 200 SFT steps): re-running the output as print(v) (held-out
  0.44; v copied wrong), and check() followed by "The answer is v." (4-call episodes 0.33
  correct vs 0.66 for 1 call: v copied wrong after the checks).

tool_math_fidelity_timeout (case 2: timeouts on hard tasks), slots of 64:
    slot 0      tool     as above (the one path that succeeds)
    slot 1-10   think    "Let me think." until the episode's token budget ends it: a timeout
    slot 11-63  direct   "The answer is v." (a tiny model cannot multiply 4-digit numbers in its
                         head, so at RL time this path fails)
  The three paths differ from the first sampled token on ("<", "L", "The"), so GRPO moves
  them through one decision: successes push the tool up, failures push direct down, and a
  timeout that is dropped is pushed nowhere, so its share grows while failures outnumber
  successes.
"""
from __future__ import annotations

import zlib
from typing import Any, Callable

from posttrain_jax.envs.env import EnvStep, ToolFailure, ToolSpec, register_env
from posttrain_jax.tasks.task import Task
from posttrain_jax.envs.tool_calls import ToolCall, render_call
from posttrain_jax.envs.tool_math import PYTHON, ToolMathConfig, ToolMathEnv

VERIFY_RERUNS = 5                 # check() calls of a verify demonstration
THINK = "Let me think. " * 12     # a think demonstration: ~120 tokens, past the case-2 budget

SLOTS = {
    "tool_math_fidelity_infra": ("tool",) + ("verify",) * 3,
    "tool_math_fidelity_timeout": ("tool",) + ("think",) * 10 + ("direct",) * 53,
}


def demonstration_path(env: str, task: Task) -> str:
  """The path of `task`'s gold chat in environment `env` (module docstring)."""
  slots = SLOTS[env]
  return slots[zlib.crc32(task.id.encode()) % len(slots)]


CHECK = ToolSpec("check", "Runs the last program again.",
                 {"type": "object", "properties": {}})


def check_output(printed: str, k: int) -> str:
  """What the k-th check() of an episode returns (1-based): the program's output and the count,
  so the policy reads when the demonstrated reruns are done instead of counting them itself."""
  return f"{printed} (run {k} of {VERIFY_RERUNS})"


SUBMIT = ToolSpec("submit", "Submits what the last program printed as the answer.",
                  {"type": "object", "properties": {}})


class VerifyEnv(ToolMathEnv):
  """tool_math with `check` (the last python program's outcome again, from the same backend and
  so with the same injected faults; module docstring) and `submit` (grade what the last program
  printed; no backend)."""
  tools = (PYTHON, CHECK, SUBMIT)

  async def opening(self, task: Task, seed: int) -> list[dict[str, Any]]:
    # per episode: the last program's outcome (its output or its ToolFailure), what it printed,
    # the checks so far
    self._last: str | ToolFailure | None = None
    self._printed, self._checks = "", 0
    return await super().opening(task, seed)

  async def call_python(self, code: str) -> str:
    try:
      self._printed = self._last = await super().call_python(code)
    except ToolFailure as e:
      self._last = e
      raise
    return self._printed

  async def call_check(self) -> str:
    if self._last is None:
      raise ToolFailure("tool_failed", "check: no python program has run yet")
    self.backend_fault()
    if isinstance(self._last, ToolFailure):
      raise ToolFailure(self._last.cause, str(self._last))
    self._checks += 1
    return check_output(self._last, self._checks)

  async def call_submit(self) -> str:  # reached only beside other calls (see step)
    raise ToolFailure("bad_arguments", "submit: call it alone, as the turn's only call")

  async def step(self, turn) -> EnvStep:
    if [c.name for c in turn.tool_calls] == ["submit"] and not turn.malformed:
      self.counts["tool_calls"] += 1
      reward = float(self._grader(self._printed, self._task).reward)
      return EnvStep([], done=True, reward=self.final_reward(reward), info={"ended_by": "submit"})
    return await super().step(turn)


def _call(call: ToolCall, i: int, tool_format: str, result: str) -> list[dict[str, Any]]:
  return [{"role": "assistant", "content": render_call(call, tool_format)},
          {"role": "tool", "tool_call_id": f"call_{i}_0", "content": result}]


def _chat(path: str, task: Task, tool_format: str, submit: bool) -> list[dict[str, Any]]:
  expr, answer = task.metadata["expression"], task.answer
  chat: list[dict[str, Any]] = [{"role": "user", "content": str(task.prompt)}]
  if path == "think":
    chat.append({"role": "assistant", "content": THINK.strip()})
    return chat
  if path in ("tool", "verify"):
    chat += _call(ToolCall("python", {"code": f"print({expr})"}), 0, tool_format, answer)
  if path == "verify":
    for i in range(VERIFY_RERUNS):
      chat += _call(ToolCall("check", {}), i + 1, tool_format, check_output(answer, i + 1))
  if path in ("tool", "verify") and submit:
    chat.append({"role": "assistant", "content": render_call(ToolCall("submit", {}), tool_format)})
  else:
    chat.append({"role": "assistant", "content": f"The answer is {answer}."})
  return chat


def _demonstration(env: str) -> Callable[[Task, str], list[dict[str, Any]]]:
  def demonstration(task: Task, tool_format: str) -> list[dict[str, Any]]:
    return _chat(demonstration_path(env, task), task, tool_format,
                 submit=env == "tool_math_fidelity_infra")
  demonstration.__doc__ = f"The gold chat of a task in {env} along its path (module docstring)."
  return demonstration


register_env("tool_math_fidelity_infra", ToolMathConfig,
             demonstration=_demonstration("tool_math_fidelity_infra"))(VerifyEnv)
register_env("tool_math_fidelity_timeout", ToolMathConfig,
             demonstration=_demonstration("tool_math_fidelity_timeout"))(ToolMathEnv)
