"""A small file-system task: inspect and edit files in the sandbox's work dir to meet a goal that
the environment checks itself.

Tasks (generator "file_task", replayable from the seed; the files are in the task's metadata):
  "sum"      numbers.txt holds k integers, one per line; goal: answer.txt holds their sum.
  "replace"  notes.txt has lines with the word W; goal: notes.txt with every W replaced by V,
             nothing else changed.
Tools: `read_file(path)`, `write_file(path, content)`, `shell(command)` (bash in the sandbox,
the work dir as cwd). A turn without tool calls ends the episode; the reward is 1 when the goal
holds in the work dir at that moment, else 0 (minus ToolEnv's penalties). A path outside the
work dir or through a symlink is a tool error of the policy; the sandbox failing is ours.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import numpy as np

from posttrain_jax.envs.env import (EnvInfraError, ToolEnv, ToolEnvConfig, ToolFailure, ToolSpec,
                                    register_env)
from posttrain_jax.sandbox import SandboxConfig, SandboxError, UnsafePathError
from posttrain_jax.tasks.synthetic import GeneratorError, register_generator
from posttrain_jax.tasks.task import Task
from posttrain_jax.envs.tool_calls import ToolCall, render_call
from posttrain_jax.envs.tool_math import TOOL_SANDBOX, open_session

KINDS = ("sum", "replace")
_WORDS = ("apple", "river", "stone", "cloud", "lamp", "tiger", "paper", "green", "bread", "wind")


@dataclasses.dataclass(frozen=True)
class FileTaskTasks:
  """The task generator's knobs."""
  kinds: str = "sum,replace"      # comma-separated subset of KINDS
  min_numbers: int = 3            # "sum": integers in numbers.txt
  max_numbers: int = 6
  max_value: int = 999
  lines: int = 4                  # "replace": lines in notes.txt

  def __post_init__(self):
    bad = set(self.kinds.split(",")) - set(KINDS)
    if bad or not self.kinds:
      raise GeneratorError(f"FileTaskTasks.kinds={self.kinds!r}: unknown {sorted(bad)}; valid {KINDS}")
    if not 1 <= self.min_numbers <= self.max_numbers:
      raise GeneratorError("FileTaskTasks: need 1 ≤ min_numbers ≤ max_numbers")


@register_generator("file_task", FileTaskTasks)
def draw_file_task(cfg: FileTaskTasks, rng: np.random.Generator) -> tuple[str, Task]:
  kinds = cfg.kinds.split(",")
  kind = kinds[int(rng.integers(len(kinds)))]
  if kind == "sum":
    nums = [int(x) for x in rng.integers(0, cfg.max_value + 1,
                                         int(rng.integers(cfg.min_numbers, cfg.max_numbers + 1)))]
    files = {"numbers.txt": "".join(f"{n}\n" for n in nums)}
    goal = {"file": "answer.txt", "content": str(sum(nums))}
    prompt = "Write the sum of the numbers in numbers.txt to answer.txt."
  else:
    w, v = (str(x) for x in rng.choice(_WORDS, 2, replace=False))
    lines = [" ".join(str(x) for x in rng.choice(_WORDS, 4)) for _ in range(cfg.lines)]
    lines[int(rng.integers(len(lines)))] += f" {w}"
    text = "".join(line + "\n" for line in lines)
    files = {"notes.txt": text}
    goal = {"file": "notes.txt", "content": text.replace(w, v).strip()}
    prompt = f"In notes.txt, replace every '{w}' with '{v}'."
  key = json.dumps(files, sort_keys=True)
  task = Task(id=f"file_task:{kind}:{hashlib.sha256(key.encode()).hexdigest()[:12]}", prompt=prompt,
              answer=goal["content"], metadata={"env": "file_task", "kind": kind, "files": files,
                                                "goal": goal, "seed": int(rng.integers(2**31))})
  return key, task


@dataclasses.dataclass(frozen=True)
class FileTaskConfig:
  """The environment's settings."""
  sandbox: SandboxConfig = TOOL_SANDBOX
  tool: ToolEnvConfig = ToolEnvConfig()
  max_read_bytes: int = 4096      # read_file returns at most this much


_PATH = {"type": "string"}
TOOLS = (
    ToolSpec("read_file", "Returns the content of a file in the work dir.",
             {"type": "object", "properties": {"path": _PATH}, "required": ["path"]}),
    ToolSpec("write_file", "Writes content to a file in the work dir (replacing it).",
             {"type": "object", "properties": {"path": _PATH, "content": {"type": "string"}},
              "required": ["path", "content"]}),
    ToolSpec("shell", "Runs a bash command in the work dir; returns its output.",
             {"type": "object", "properties": {"command": {"type": "string"}},
              "required": ["command"]}),
)

class FileTaskEnv(ToolEnv):
  tools = TOOLS

  def __init__(self, cfg: FileTaskConfig = FileTaskConfig()):
    super().__init__(cfg.tool)
    self.cfg = cfg
    self._session = None
    self._goal: dict[str, str] = {}

  async def opening(self, task: Task, seed: int) -> list[dict[str, Any]]:
    try:
      self._session = await open_session(self.cfg.sandbox)
      for rel, text in task.metadata["files"].items():
        self._session.write_file(rel, text)
    except SandboxError as e:
      raise EnvInfraError("sandbox", str(e)) from e
    self._goal = dict(task.metadata["goal"])
    listing = ", ".join(sorted(task.metadata["files"]))
    return [{"role": "user", "content": f"Files: {listing}. {task.prompt}"}]

  async def call_read_file(self, path: str) -> str:
    try:
      return self._session.read_file(path, max_bytes=self.cfg.max_read_bytes)
    except (UnsafePathError, OSError) as e:
      raise ToolFailure("tool_failed", f"read_file({path!r}): {e}") from None

  async def call_write_file(self, path: str, content: str) -> str:
    try:
      self._session.write_file(path, content)
    except (UnsafePathError, OSError) as e:
      raise ToolFailure("tool_failed", f"write_file({path!r}): {e}") from None
    return f"wrote {len(content.encode())} bytes to {path}"

  async def call_shell(self, command: str) -> str:
    try:
      res = await self._session.arun_shell(command)
    except SandboxError as e:
      raise EnvInfraError("sandbox", str(e)) from e
    if not res.ok:
      cause = "tool_timeout" if res.limit in ("wall", "cpu") else "tool_failed"
      raise ToolFailure(cause, f"{res.summary()}\n{res.stdout[-300:]}{res.stderr[-300:]}".rstrip())
    return res.stdout.rstrip("\n")

  async def grade(self, turn) -> float:
    try:
      got = self._session.read_file(self._goal["file"], max_bytes=1 << 16)
    except (UnsafePathError, OSError):
      return 0.0
    return 1.0 if got.strip() == self._goal["content"] else 0.0

  async def close(self) -> None:
    if self._session is not None:
      self._session.close()
      self._session = None


def demonstration(task: Task, tool_format: str) -> list[dict[str, Any]]:
  """The gold chat: read the file, write the result, say done."""
  files, goal = task.metadata["files"], task.metadata["goal"]
  (src,) = files
  listing = ", ".join(sorted(files))
  read = render_call(ToolCall("read_file", {"path": src}), tool_format)
  write = render_call(ToolCall("write_file", {"path": goal["file"], "content": goal["content"]}),
                      tool_format)
  return [{"role": "user", "content": f"Files: {listing}. {task.prompt}"},
          {"role": "assistant", "content": read},
          {"role": "tool", "tool_call_id": "call_0_0", "content": files[src]},
          {"role": "assistant", "content": write},
          {"role": "tool", "tool_call_id": "call_1_0",
           "content": f"wrote {len(goal['content'].encode())} bytes to {goal['file']}"},
          {"role": "assistant", "content": "Done."}]


register_env("file_task", FileTaskConfig, demonstration=demonstration)(FileTaskEnv)
