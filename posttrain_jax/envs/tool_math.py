"""Tool-using math: large-number arithmetic that needs the `python` tool, run in the sandbox.

Tasks (generator "tool_math", replayable from the task bank's seed): "Compute 48213*7719." with
operands of `min_digits`..`max_digits` digits (a fraction `hard_fraction` of them labelled
"hard", with `hard_digits`-digit operands and an operator from `hard_ops`, if given). A tiny
model cannot multiply six-digit numbers in its head; it can write `print(48213*7719)` and copy
the result:

    user       Compute 48213*7719.
    assistant  <tool_call>{"name": "python", "arguments": {"code": "print(48213*7719)"}}</tool_call>
    tool       372156147
    assistant  The answer is 372156147.

Reward: 1 if the final answer (a turn without tool calls, read by the "numeric" grader) equals
the value, else 0; minus the tool plumbing's penalties (ToolEnv). The python tool runs each call
in a fresh process of the episode's sandbox session (sandbox/session.py): its output is stdout, a
failing call returns its exit summary and the end of stderr (a tool error of the policy); the
sandbox failing to start is ours (EnvInfraError). `infra_fault_rate` injects tool-backend
failures (ours) for the fidelity benchmark.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import random
from typing import Any

import numpy as np

from posttrain_jax.envs.env import (EnvInfraError, ToolEnv, ToolEnvConfig, ToolFailure, ToolSpec,
                                    register_env)
from posttrain_jax.graders import make_grader
from posttrain_jax.sandbox.session import Sandbox
from posttrain_jax.sandbox import SandboxConfig, SandboxError
from posttrain_jax.tasks.synthetic import GeneratorError, register_generator
from posttrain_jax.tasks.task import Task
from posttrain_jax.envs.tool_calls import ToolCall, render_call


@dataclasses.dataclass(frozen=True)
class ToolMathTasks:
  """The task generator's knobs."""
  min_digits: int = 4             # operand digits, easy tasks
  max_digits: int = 6
  ops: str = "*"                  # operators drawn from, any of "+-*"
  hard_fraction: float = 0.0      # tasks labelled "hard" (metadata["difficulty"])
  hard_digits: int = 12           # operand digits of a hard task
  hard_ops: str = ""              # operators of a hard task ("" = ops)
  prompt_template: str = "Compute {expr}."

  def __post_init__(self):
    if not 1 <= self.min_digits <= self.max_digits:
      raise GeneratorError(f"ToolMathTasks: need 1 ≤ min_digits ≤ max_digits, got "
                           f"{self.min_digits}..{self.max_digits}")
    if not self.ops or set(self.ops) - set("+-*"):
      raise GeneratorError(f"ToolMathTasks.ops must be a non-empty subset of '+-*', got {self.ops!r}")
    if set(self.hard_ops) - set("+-*"):
      raise GeneratorError(f"ToolMathTasks.hard_ops must be a subset of '+-*', got "
                           f"{self.hard_ops!r}")
    if not 0.0 <= self.hard_fraction <= 1.0:
      raise GeneratorError(f"ToolMathTasks.hard_fraction must be in [0, 1], got {self.hard_fraction}")


@register_generator("tool_math", ToolMathTasks)
def draw_tool_math(cfg: ToolMathTasks, rng: np.random.Generator) -> tuple[str, Task]:
  hard = bool(rng.random() < cfg.hard_fraction)
  digits = [cfg.hard_digits] * 2 if hard else [
      int(rng.integers(cfg.min_digits, cfg.max_digits + 1)) for _ in range(2)]
  a, b = (int(rng.integers(10 ** (d - 1), 10 ** d)) for d in digits)
  ops = cfg.hard_ops if hard and cfg.hard_ops else cfg.ops
  op = ops[int(rng.integers(len(ops)))]
  expr = f"{a}{op}{b}"
  value = {"+": a + b, "-": a - b, "*": a * b}[op]
  task = Task(id=f"tool_math:{expr}", prompt=cfg.prompt_template.format(expr=expr),
              answer=str(value), metadata={"env": "tool_math", "expression": expr,
                                           "difficulty": "hard" if hard else "easy",
                                           "seed": int(rng.integers(2**31))})
  return expr, task


# Limits of one tool call in the built-in environments: small programs, small outputs.
TOOL_SANDBOX = SandboxConfig(cpu_seconds=2.0, wall_seconds=5.0, memory_mb=256, max_processes=16,
                             disk_mb=8, max_output_bytes=2048)


@dataclasses.dataclass(frozen=True)
class ToolMathConfig:
  """The environment's settings."""
  sandbox: SandboxConfig = TOOL_SANDBOX
  tool: ToolEnvConfig = ToolEnvConfig()
  infra_fault_rate: float = 0.0   # injected tool-backend failures per call (benchmarks only)
  fault_seed: int = 0             # their random stream

  def __post_init__(self):
    if not 0.0 <= self.infra_fault_rate < 1.0:
      raise ValueError(f"ToolMathConfig.infra_fault_rate must be in [0, 1), got "
                       f"{self.infra_fault_rate}")


PYTHON = ToolSpec("python", "Runs a Python program in a sandbox and returns what it printed.",
                  {"type": "object", "properties": {"code": {"type": "string"}},
                   "required": ["code"]})


@functools.lru_cache(maxsize=8)
def _sandbox(cfg: SandboxConfig) -> Sandbox:
  return Sandbox(cfg)


async def open_session(cfg: SandboxConfig):
  """A fresh work-dir session of the process's Sandbox for `cfg` (made once: its construction
  probes bwrap, off the event loop); SandboxError when the sandbox cannot start."""
  sandbox = await asyncio.to_thread(_sandbox, cfg)
  return sandbox.session()


_episodes = itertools.count()


class ToolMathEnv(ToolEnv):
  tools = (PYTHON,)

  def __init__(self, cfg: ToolMathConfig = ToolMathConfig()):
    super().__init__(cfg.tool)
    self.cfg = cfg
    self._grader = make_grader("numeric")
    self._session = None
    self._task: Task | None = None
    self._faults = random.Random(cfg.fault_seed * 1_000_003 + next(_episodes))

  async def opening(self, task: Task, seed: int) -> list[dict[str, Any]]:
    self._task = task
    return [{"role": "user", "content": str(task.prompt if isinstance(task.prompt, str)
                                            else task.prompt_text)}]

  def backend_fault(self) -> None:
    """Raises the injected tool-backend fault (EnvInfraError, ours) at `infra_fault_rate`."""
    if self.cfg.infra_fault_rate and self._faults.random() < self.cfg.infra_fault_rate:
      raise EnvInfraError("tool_backend", "injected tool-backend fault")

  async def call_python(self, code: str) -> str:
    self.backend_fault()
    try:
      if self._session is None:
        self._session = await open_session(self.cfg.sandbox)
      res = await self._session.arun_python(code)
    except SandboxError as e:
      raise EnvInfraError("sandbox", str(e)) from e
    if res.ok:
      return res.stdout.rstrip("\n")
    cause = "tool_timeout" if res.limit in ("wall", "cpu") else "tool_failed"
    raise ToolFailure(cause, f"{res.summary()}\n{res.stderr[-400:]}".rstrip())

  async def grade(self, turn) -> float:
    return float(self._grader(turn.content, self._task).reward)

  async def close(self) -> None:
    if self._session is not None:
      self._session.close()
      self._session = None


def demonstration(task: Task, tool_format: str) -> list[dict[str, Any]]:
  """The gold chat of a task: one python call, its output, the answer (SFT warm-start)."""
  call = render_call(ToolCall("python", {"code": f"print({task.metadata['expression']})"}),
                     tool_format)
  return [{"role": "user", "content": str(task.prompt)},
          {"role": "assistant", "content": call},
          {"role": "tool", "tool_call_id": "call_0_0", "content": task.answer},
          {"role": "assistant", "content": f"The answer is {task.answer}."}]


register_env("tool_math", ToolMathConfig, demonstration=demonstration)(ToolMathEnv)
