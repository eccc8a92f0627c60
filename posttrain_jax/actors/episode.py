"""The episode protocol both rollout sources run, and the one place failures become records.

A rollout source (SyncRollouts, AsyncRollouts) draws tasks, wraps each in a `WorkItem` and hands
a batch of them to an `Episode`:

    groups = episode.run(items, seed)      # one group (list[Trajectory]) per item, in order
                                            # `run` may be a plain function or a coroutine

An episode *raises* when our side fails (engine crash, unreachable server, sandbox down): it
never builds failure records itself. The source then, in one place (`retry_delays` /
`infra_group` below, used by both sources):

1. retries the batch with exponential backoff (`RetryConfig`: bounded attempts, capped delay,
   long enough by default to ride out a ~40 s server restart);
2. if every attempt failed, requeues each task (drawn again before any new task), at most
   `max_requeues` times, counted;
3. then gives up on it: its group becomes `infra_error` trajectories (never reward 0, never in
   a baseline or the loss), counted.

A task that can *never* run (its prompt is longer than the engine accepts) is not an infra
error: the episode raises `InvalidTaskError(index)` and the source drops that task with its own
counted reason ("invalid") and runs the rest.

A new kind of episode (a multi-turn environment with tools) is one module under
`posttrain_jax/actors/` implementing the same `run` and registering a builder with what the run
asks of an episode type besides rollouts:

    @register_episode("my_env", MyEnvConfig, evaluate=..., demonstration=..., limits=...,
                      lockstep=...)
    def build(cfg: MyEnvConfig, ctx: EpisodeContext) -> Episode: ...

    evaluate(episode, tasks, temperature, n, max_tokens, seed) -> {"accuracy", "count", ...}
        the held-out score of `n` samples per task (extra keys are logged beside it)
    demonstration(cfg, demo: DemoContext, task, tid) -> Trajectory
        the supervised sample of a task for the SFT warm-start
    limits(cfg, rollout, eval_max_tokens, longest_prompt) -> EngineLimits
        the prompt and completion lengths an engine must serve for it
    lockstep: every process makes the same engine calls in step (single-turn; a multi-turn
        episode's calls depend on its own tool results), so a whole-job engine can serve it

selected with `rl.episode="my_env"` (its settings in `rl.episode_config`); nothing in either
source, the pool or the run loop changes.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Protocol, Sequence

from posttrain_jax.tasks import Task
from posttrain_jax.registry import Registry
from posttrain_jax.types import Source, Status, Trajectory


@dataclasses.dataclass(frozen=True)
class WorkItem:
  """One task to run as one group. `draw` is unique per run (the draw index)."""
  draw: int
  task: Task
  requeues: int = 0               # times this task was requeued after all attempts failed

  @property
  def group_id(self) -> str:
    return f"{self.draw}/{self.task.id}"

  def to_dict(self) -> dict[str, Any]:
    return {"draw": self.draw, "task": self.task.to_dict(), "requeues": self.requeues}

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "WorkItem":
    return cls(int(d["draw"]), Task.from_dict(d["task"]), int(d.get("requeues", 0)))


class InvalidTaskError(Exception):
  """Item `index` of the batch can never run (e.g. its prompt exceeds the engine's limit)."""

  def __init__(self, index: int, reason: str):
    super().__init__(reason)
    self.index, self.reason = index, reason


class Episode(Protocol):
  """What a rollout source runs."""

  engine: Any                     # the rollout engine it samples from (weights, version)

  def run(self, items: Sequence[WorkItem], seed: int) -> list[list[Trajectory]]:
    """One graded group per item, in order; raises on our failure (see module docstring)."""
    ...

  # Optional: `metrics() -> dict[str, float]`, the episode's own per-step metrics since the last
  # call (e.g. a filter it applies); both sources log them (`episode_metrics`).


def episode_metrics(episode: Episode) -> dict[str, float]:
  """The episode's own per-step metrics if it reports any (its optional `metrics()`), else {}."""
  report = getattr(episode, "metrics", None)
  return report() if report is not None else {}


@dataclasses.dataclass(frozen=True)
class EpisodeContext:
  """What the run gives an episode builder."""
  engine: Any                     # the rollout engine (Engine protocol)
  tokenizer: Any                  # HF tokenizer with the chat template
  grader: Callable                # (completion text, task) -> GradeResult
  rollout: Any                    # RolloutConfig: G, max_tokens, sampling, truncation policy
  stop_token_ids: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class DemoContext:
  """What the run gives an episode type's `demonstration`."""
  tokenizer: Any
  stop_token_ids: tuple[int, ...]
  answer_style: str = "plain"     # sft.answer_style: how a task's solution is written


@dataclasses.dataclass(frozen=True)
class EngineLimits:
  """Lengths an engine must serve for an episode type."""
  max_prompt: int                 # longest prompt (tokens)
  max_tokens: int                 # most new tokens one call asks for (rollouts and eval)
  sample_tokens: int              # new tokens one rollout call asks for


@dataclasses.dataclass(frozen=True)
class EpisodeSpec:
  name: str
  config_cls: type
  build: Callable[[Any, EpisodeContext], Episode]
  evaluate: Callable[..., dict]
  demonstration: Callable[..., Trajectory]
  limits: Callable[..., EngineLimits]
  lockstep: bool = False


EPISODES: Registry[EpisodeSpec] = Registry("episode type", discover="posttrain_jax.actors")


def register_episode(name: str, config_cls: type, *, evaluate: Callable[..., dict],
                     demonstration: Callable[..., Trajectory],
                     limits: Callable[..., EngineLimits], lockstep: bool = False):
  """Decorator registering `build(cfg, ctx) -> Episode` under `name` (for `rl.episode`), with
  the episode type's held-out eval, SFT demonstrations and engine limits (module docstring)."""
  def deco(build):
    EPISODES.register(name)(EpisodeSpec(name, config_cls, build, evaluate, demonstration,
                                        limits, lockstep))
    return build
  return deco


def episode_spec(name: str) -> EpisodeSpec:
  """The registered episode type `name` (every module of posttrain_jax.actors is imported)."""
  return EPISODES.get(name)


@dataclasses.dataclass(frozen=True)
class RetryConfig:
  """What happens when an episode fails on our side (both rollout sources)."""
  max_retries: int = 6            # re-runs of a failed batch before its tasks are requeued
  backoff_s: float = 1.0          # wait before retry k: backoff_s · 2^(k−1), capped below
  backoff_max_s: float = 16.0     # longest single wait (default total: 1+2+4+8+16+16 = 47 s)
  max_requeues: int = 2           # times a task is requeued after all retries; then infra_error

  def __post_init__(self):
    for name in ("max_retries", "max_requeues"):
      if getattr(self, name) < 0:
        raise ValueError(f"RetryConfig.{name} must be ≥ 0, got {getattr(self, name)}")
    for name in ("backoff_s", "backoff_max_s"):
      if getattr(self, name) < 0:
        raise ValueError(f"RetryConfig.{name} must be ≥ 0, got {getattr(self, name)}")

  def delay(self, retry: int) -> float:
    """Seconds to wait before retry `retry` (1-based)."""
    return min(self.backoff_s * 2 ** (retry - 1), self.backoff_max_s)


def infra_group(item: WorkItem, group_size: int, error: BaseException, version: int,
                source: Source = Source.TASK_BANK) -> list[Trajectory]:
  """The `infra_error` group of a task whose every attempt failed: no tokens, no reward."""
  msg = f"{type(error).__name__}: {error}"
  return [Trajectory(id=f"{item.group_id}/{j}", task_id=item.task.id, group_id=item.group_id,
                     source=source, token_ids=[], loss_mask=[], behaviour_logprobs=[],
                     policy_version=[], messages=item.task.messages, reward=None,
                     status=Status.INFRA_ERROR,
                     metrics={"infra_error": 1.0, "error": msg, "draw": item.draw,
                              "requeues": item.requeues, "engine_version": version})
          for j in range(group_size)]


def all_infra(group: Sequence[Trajectory]) -> bool:
  """A group with no member the loss could use (every one an infra error)."""
  return bool(group) and all(t.status is Status.INFRA_ERROR for t in group)


def drop_invalid(items: list[WorkItem], error: InvalidTaskError) -> tuple[list[WorkItem], WorkItem]:
  """(the batch without the invalid item, the invalid item)."""
  if not 0 <= error.index < len(items):
    raise RuntimeError(f"InvalidTaskError index {error.index} outside a batch of {len(items)}")
  return items[:error.index] + items[error.index + 1:], items[error.index]


def requeue_or_give_up(item: WorkItem, cfg: RetryConfig) -> Optional[WorkItem]:
  """The item to requeue (its count raised), or None when its requeues are used up."""
  if item.requeues >= cfg.max_requeues:
    return None
  return dataclasses.replace(item, requeues=item.requeues + 1)
