"""Multi-turn environments: the protocol, tools, budgets, and who is to blame when a step fails.

An environment is a small async state machine over a chat:

    opening = await env.reset(task, seed)      # the first messages (system / user)
    step    = await env.step(turn)             # the policy's turn -> what the env appends
    ...                                        # until step.done, or a budget runs out
    await env.close()                          # always (every path)

`turn` is the sampled assistant text already split by the family's tool-call format
(`ParsedTurn`: content, well-formed calls, malformed calls). `EnvStep.messages` are the
messages the environment appends in OpenAI chat format (`{"role": "tool", "tool_call_id",
"content"}` for results, `{"role": "user", ...}` for follow-ups); `reward` is set when `done`;
`info["feedback"]`, a free text on the attempt (never shown to the policy), goes into every
sample of the episode (Trajectory.feedback, read by a self-distillation teacher). A ToolEnv's
`grade` may return a GradeResult (graders/) instead of a float: its info["feedback"]
becomes the final step's.
`tools` are declared in the OpenAI tools format and shown to the model by the chat template.

Whose failure is it (ARCHITECTURE.md, status semantics):
- *ours* — the sandbox could not start, a tool backend is down, a grader could not read its
  reference: the environment raises `EnvInfraError`. The episode becomes `infra_error`: never
  scored, never in a baseline or the loss, the task requeued, counted by cause.
- *the policy's* — a malformed call, an unknown tool, bad arguments, code that raises or runs
  past its limits: a normal step whose tool message says what went wrong, counted by cause in
  `EnvStep.info["tool_errors"]`, and charged to the reward (`ToolEnvConfig.malformed_penalty`).
- *the policy's budget* — turns, sampled tokens, its own seconds or tool calls exhausted: the
  episode ends with status `timeout`, scored as a failure (reward 0), never dropped.

`ToolEnv` implements the tool plumbing once (dispatch, argument checks, error messages,
counting); an environment subclasses it with `opening`, its tools' `call_*` coroutines and
`grade`. Environments register with `@register_env(name, config_cls)`; a task names its
environment in `task.metadata["env"]` or the episode config does.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Awaitable, Callable, Optional, Sequence, Union

from posttrain_jax.graders import GradeResult
from posttrain_jax.tasks.task import Task
from posttrain_jax.envs.tool_calls import ParsedTurn, ToolCall
from posttrain_jax.registry import Registry

TOOL_ERROR_CAUSES = ("malformed", "unknown_tool", "bad_arguments", "tool_failed", "tool_timeout")


class EnvInfraError(Exception):
  """Our side of an environment failed (sandbox, tool backend, grader): never the policy's."""

  def __init__(self, cause: str, message: str):
    super().__init__(f"{cause}: {message}")
    self.cause = cause


class ToolFailure(Exception):
  """A tool call the *policy* got wrong; `cause` in TOOL_ERROR_CAUSES, message for the model."""

  def __init__(self, cause: str, message: str):
    super().__init__(message)
    self.cause = cause


@dataclasses.dataclass(frozen=True)
class Budgets:
  """What one episode may spend; running out is the policy's timeout (scored, never dropped)."""
  max_turns: int = 6              # assistant turns
  max_tokens: int = 512           # sampled tokens over all turns
  max_seconds: float = 120.0      # seconds of its own: its tool / env steps + its share of
                                  # each batched generate (actors/multiturn.py)
  max_tool_calls: int = 8         # tool calls (well-formed or not)

  def __post_init__(self):
    for f in dataclasses.fields(self):
      if getattr(self, f.name) <= 0:
        raise ValueError(f"Budgets.{f.name} must be > 0, got {getattr(self, f.name)}")


@dataclasses.dataclass(frozen=True)
class ToolSpec:
  """A tool in the OpenAI tools format: name, what it does, a JSON schema of its arguments."""
  name: str
  description: str
  parameters: dict[str, Any]      # {"type": "object", "properties": {...}, "required": [...]}

  def to_openai(self) -> dict[str, Any]:
    return {"type": "function", "function": {"name": self.name, "description": self.description,
                                             "parameters": self.parameters}}


@dataclasses.dataclass
class EnvStep:
  """What the environment appends after a turn, and whether the episode is over."""
  messages: list[dict[str, Any]]
  done: bool = False
  reward: Optional[float] = None  # set when done
  info: dict[str, Any] = dataclasses.field(default_factory=dict)


class Environment:
  """The protocol (see the module docstring); `ToolEnv` is the usual base."""

  tools: Sequence[ToolSpec] = ()

  async def reset(self, task: Task, seed: int) -> list[dict[str, Any]]:
    raise NotImplementedError

  async def step(self, turn: ParsedTurn) -> EnvStep:
    raise NotImplementedError

  def timeout_reward(self) -> float:
    """The reward of an episode that ran out of budget: a failure."""
    return 0.0

  async def score_truncated(self, turn: ParsedTurn) -> float:
    """The reward of an episode whose last turn hit the per-turn token limit (graded as it
    stands when `rollout.truncation="grade"`)."""
    return 0.0

  async def close(self) -> None:
    pass


@dataclasses.dataclass(frozen=True)
class ToolEnvConfig:
  """Tool plumbing shared by every ToolEnv."""
  on_malformed: str = "continue"  # continue (error message to the model) | end (reward 0)
  malformed_penalty: float = 0.1  # subtracted from the final reward per malformed call
  tool_error_penalty: float = 0.0  # subtracted per other tool error (unknown tool, bad args, …)
  max_result_chars: int = 2000    # a tool result longer than this is cut (with a marker)

  def __post_init__(self):
    if self.on_malformed not in ("continue", "end"):
      raise ValueError(f"ToolEnvConfig.on_malformed={self.on_malformed!r}; valid: continue, end")


class ToolEnv(Environment):
  """Dispatches each turn's calls to `call_<tool>(**arguments)` coroutines (their ToolSpecs in
  `tools`); a turn without calls is the answer and goes to `grade(turn)` -> reward in [0, 1].

  Per episode it counts tool calls and tool errors by cause (TOOL_ERROR_CAUSES) in `counts`;
  the final reward is `grade − malformed_penalty·n_malformed − tool_error_penalty·n_other`,
  floored at 0 (so a broken call can never raise the reward)."""

  def __init__(self, cfg: ToolEnvConfig = ToolEnvConfig()):
    self.tool_cfg = cfg
    self.counts: dict[str, int] = {"tool_calls": 0, **{c: 0 for c in TOOL_ERROR_CAUSES}}

  # -- to implement -------------------------------------------------------------------------

  async def opening(self, task: Task, seed: int) -> list[dict[str, Any]]:
    """The first messages of the episode (state set up from `task` / `seed`)."""
    raise NotImplementedError

  async def grade(self, turn: ParsedTurn) -> Union[float, GradeResult]:
    """The reward in [0, 1] for a final answer (a turn without tool calls), or a GradeResult
    whose info["feedback"] (a str) is the episode's feedback."""
    raise NotImplementedError

  # -- protocol -----------------------------------------------------------------------------

  async def reset(self, task: Task, seed: int) -> list[dict[str, Any]]:
    self.counts = {"tool_calls": 0, **{c: 0 for c in TOOL_ERROR_CAUSES}}
    return await self.opening(task, seed)

  async def step(self, turn: ParsedTurn) -> EnvStep:
    out: list[dict[str, Any]] = []
    for bad in turn.malformed:
      self.counts["malformed"] += 1
      self.counts["tool_calls"] += 1
      if self.tool_cfg.on_malformed == "end":
        return EnvStep([], done=True, reward=0.0, info={"ended_by": "malformed"})
      out.append({"role": "tool", "tool_call_id": "malformed",
                  "content": f"error: malformed tool call ({bad.reason}): {bad.text[:200]}"})
    for call in turn.tool_calls:
      self.counts["tool_calls"] += 1
      out.append({"role": "tool", "tool_call_id": call.id, "content": await self._call(call)})
    if out:
      return EnvStep(out)
    reward, feedback = _graded(await self.grade(turn))
    return EnvStep([], done=True, reward=self.final_reward(reward),
                   info={"feedback": feedback} if feedback else {})

  async def score_truncated(self, turn: ParsedTurn) -> float:
    return self.final_reward(_graded(await self.grade(turn))[0])

  def final_reward(self, reward: float) -> float:
    c = self.counts
    other = sum(c[k] for k in TOOL_ERROR_CAUSES if k != "malformed")
    return max(0.0, reward - self.tool_cfg.malformed_penalty * c["malformed"]
               - self.tool_cfg.tool_error_penalty * other)

  async def _call(self, call: ToolCall) -> str:
    spec = {t.name: t for t in self.tools}.get(call.name)
    fn: Optional[Callable[..., Awaitable[str]]] = getattr(self, f"call_{call.name}", None)
    try:
      if spec is None or fn is None:
        raise ToolFailure("unknown_tool", f"unknown tool {call.name!r}; tools: "
                          f"{', '.join(t.name for t in self.tools)}")
      _check_arguments(spec, call.arguments)
      result = str(await fn(**call.arguments))
    except ToolFailure as e:
      self.counts[e.cause] += 1
      return f"error: {e}"
    n = self.tool_cfg.max_result_chars
    return result if len(result) <= n else result[:n] + f"\n[... {len(result) - n} chars cut]"


def _graded(result: Union[float, GradeResult]) -> tuple[float, Optional[str]]:
  """(reward, feedback text or None) of what `ToolEnv.grade` returned."""
  if isinstance(result, GradeResult):
    feedback = result.info.get("feedback")
    return float(result.reward), feedback if isinstance(feedback, str) else None
  return float(result), None


def _check_arguments(spec: ToolSpec, args: dict[str, Any]) -> None:
  """Required arguments present, no unknown ones, JSON types as declared."""
  props = spec.parameters.get("properties", {})
  missing = [k for k in spec.parameters.get("required", []) if k not in args]
  unknown = [k for k in args if k not in props]
  if missing or unknown:
    raise ToolFailure("bad_arguments", f"{spec.name}: missing {missing}, unknown {unknown}; "
                      f"arguments: {json.dumps(sorted(props))}")
  types = {"string": str, "integer": int, "number": (int, float), "boolean": bool,
           "object": dict, "array": list}
  for k, v in args.items():
    want = types.get(props[k].get("type"))
    if want is not None and (not isinstance(v, want) or (want is int and isinstance(v, bool))):
      raise ToolFailure("bad_arguments", f"{spec.name}: argument {k!r} must be a "
                        f"{props[k]['type']}, got {type(v).__name__}")


# -- registry ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class EnvSpec:
  name: str
  config_cls: type
  build: Callable[[Any], Environment]    # config -> a fresh environment (one per episode)
  # (task, tool_format) -> the gold chat (assistant turns as the model writes them), for SFT
  demonstration: Optional[Callable[[Task, str], list[dict[str, Any]]]] = None


ENVS: Registry[EnvSpec] = Registry("environment", discover="posttrain_jax.envs")


def register_env(name: str, config_cls: type,
                 demonstration: Optional[Callable[[Task, str], list[dict[str, Any]]]] = None):
  """Decorator registering `build(cfg) -> Environment` (and its SFT demonstrations)."""
  def deco(build):
    ENVS.register(name)(EnvSpec(name, config_cls, build, demonstration))
    return build
  return deco


def env_spec(name: str) -> EnvSpec:
  """The registered environment `name` (every module of posttrain_jax.envs is imported)."""
  return ENVS.get(name)
