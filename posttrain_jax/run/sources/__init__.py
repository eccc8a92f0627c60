"""Rollout sources by name: `rl.mode = "sync" | "async" | "auto" | "traces" | "online" | <yours>`.

A source supplies a step's graded trajectories through the protocol of actors/source.py. An
entry is one module of this package registering a builder with the facts the run and the
config checks need, so that nothing outside the entry asks which source it is:

    @register_source("name", groups=..., oversamples=..., multi_process=..., lockstep=...,
                     check=..., draws_per_step=...)
    def build(ctx: SourceContext) -> RolloutSource: ...

    groups          yields G samples of each task (a group baseline applies); False: one
                    trajectory per task (recorded sessions: the `running` baseline)
    off_policy      its samples may come from older policies (the loss gets
                    `rl.async_correction` when it has no correction); a source that changes
                    its mind during the run (auto) says so through its `off_policy` attribute
    oversamples     honours rl.oversample (draws more tasks than it trains)
    multi_process   runs in a job of several processes, each on its share of the prompts
    lockstep        every process collects in step, so an engine that is one program of the
                    whole job (the embedded sampler) can serve it
    tenants         trains one adapter per tenant (rl.learner.lora.tenants) from sessions
                    that say whose they are
    check(cfg)      raises ValueError for a RunConfig it cannot run (named fields)
    draws_per_step(rl, prompts)   tasks it draws from the task bank a step (the data budget)

Every module here is imported on the first lookup: a new source is one file plus its test.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from posttrain_jax.registry import Registry


@dataclasses.dataclass(frozen=True)
class SourceContext:
  """What the run gives a source builder."""
  cfg: Any                        # the RunConfig
  learner: Any                    # the RL learner (params, logprobs, set_loss_config)
  engine: Any                     # the run's engine (version 0 = the RL start weights)
  new_engine: Callable[[], Any]   # another instance of it (for an engine that is not shareable)
  episode: Callable[[Any], Any]   # engine -> an Episode of rl.episode on it
  tasks: Any                      # the task iterator (its state is checkpointed by the run)
  prompts_per_step: int           # this process's share of rl.prompts_per_step
  tokenizer: Any
  stop_ids: tuple[int, ...]
  sample_tokens: int              # new tokens one rollout call asks for (a turn, multi-turn)
  shareable: bool                 # the engine serves rollouts and eval at once
  copies_weights: bool            # the engine copies the weights it is given
  log: Callable[[str], None]
  build: Callable[[str], Any]     # another registered source by name, in this context


@dataclasses.dataclass(frozen=True)
class SourceSpec:
  name: str
  build: Callable[[SourceContext], Any]
  groups: bool = True
  off_policy: bool = False
  oversamples: bool = False
  multi_process: bool = True
  lockstep: bool = True
  tenants: bool = False
  serves: bool = False            # it serves a harness (the proxy): prompts are the harness's own
  check: Optional[Callable[[Any], None]] = None
  draws_per_step: Callable[[Any, int], int] = lambda rl, prompts: prompts


SOURCES: Registry[SourceSpec] = Registry("rollout source", discover="posttrain_jax.run.sources")


def register_source(name: str, **facts):
  """Decorator registering `build(ctx) -> RolloutSource` under `name` (for `rl.mode`)."""
  def deco(build):
    SOURCES.register(name)(SourceSpec(name, build, **facts))
    return build
  return deco


def source_spec(name: str) -> SourceSpec:
  return SOURCES.get(name)


def source_names() -> list[str]:
  return SOURCES.names()
