"""The grader protocol: pure functions `(completion_text, task) -> GradeResult(reward, info)`,
registered in `GRADERS` by name (`make_grader(name, cfg)`; an unknown name lists the
registered ones). Every module of posttrain_jax/graders/ (and a task family's own module in
posttrain_jax/tasks/ or an environment's in posttrain_jax/envs/) is imported on the first
lookup: a new grader is one file with `@register_grader(name, ConfigClass)` plus its test.

A completion in which no answer can be found scores 0 with `info["parse_ok"] = False`: that is
a failure of the *policy*, not of the infrastructure. A task whose own reference answer cannot
be read raises `GraderError` (a data bug, naming the task), and so does a grader whose own
backend failed (a judge endpoint down or answering garbage: `JudgeError`, judge.py): the rollout
turns any exception of a grader into `infra_error`, never a reward of 0.

A grader that keeps state (a client, a cache, counters: the judge) registers a *builder*,
`@register_grader(name, ConfigClass, stateful=True)` on `build(cfg) -> Grader`, called once per
`make_grader`. What it builds may also offer

    grade_group(completions, task) -> list[GradeResult]   # the G answers to one task together
    metrics() -> dict[str, float]                         # its counters since the last call

which `grade_group(grader, ...)` / `grader_metrics(grader)` below use when present (one call per
completion / nothing otherwise), so a rollout never asks what kind of grader it holds.
`grade_group` returns a failure in place of its result (an exception, for the caller to record
as `infra_error`), per completion or, for a group grader, for the whole group."""
from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from posttrain_jax.registry import Registry

if TYPE_CHECKING:   # graders read tasks, tasks import no grader module at run time
  from posttrain_jax.tasks.task import Task


class GraderError(ValueError):
  """The task (not the completion) cannot be graded: its reference data is malformed, or the
  grader's own backend (a judge endpoint) gave no verdict. Never the policy's fault."""


@dataclasses.dataclass(frozen=True)
class GradeResult:
  """A grader's verdict on one completion."""
  reward: float                     # in [0, 1] for the built-in graders
  info: dict[str, Any] = dataclasses.field(default_factory=dict)  # parse_ok, extracted, ...

  @property
  def parse_ok(self) -> bool:
    return bool(self.info.get("parse_ok", False))


Grader = Callable[[str, "Task"], "GradeResult"]


@dataclasses.dataclass(frozen=True)
class GraderSpec:
  """A registered grader: the pure function (or, stateful, its builder) and its config class."""
  name: str
  fn: Optional[Callable[[str, Task, Any], GradeResult]]  # (completion, task, cfg) -> GradeResult
  config_cls: type
  build: Optional[Callable[[Any], Grader]] = None  # stateful: cfg -> grader (fn is None then)


GRADERS: Registry[GraderSpec] = Registry(
    "grader", discover=("posttrain_jax.graders", "posttrain_jax.tasks", "posttrain_jax.envs"))


def register_grader(name: str, config_cls: type, *, stateful: bool = False):
  """Decorator: `@register_grader("numeric", NumericConfig)` on `fn(completion, task, cfg)`;
  with `stateful=True`, on `build(cfg) -> Grader` (a class taking its config), called once per
  `make_grader` (module docstring)."""
  def deco(fn):
    spec = (GraderSpec(name, None, config_cls, build=fn) if stateful
            else GraderSpec(name, fn, config_cls))
    GRADERS.register(name)(spec)
    return fn
  return deco


def make_grader(name: str, cfg: Any = None) -> Grader:
  """The grader `name` with its config bound: a `(completion, task) -> GradeResult` function
  (for a stateful grader, the object its builder returns: build once, grade many times).

  `cfg` defaults to the grader's config class with default values.
  """
  spec = GRADERS.get(name)
  if cfg is None:
    cfg = spec.config_cls()
  elif not isinstance(cfg, spec.config_cls):
    raise TypeError(f"grader {name!r} takes a {spec.config_cls.__name__}, "
                    f"got {type(cfg).__name__}")
  if spec.build is not None:
    return spec.build(cfg)
  return functools.partial(spec.fn, cfg=cfg)


def grade(name: str, completion: str, task: Task, cfg: Any = None) -> GradeResult:
  """One-off convenience: `make_grader(name, cfg)(completion, task)`."""
  return make_grader(name, cfg)(completion, task)




def grade_group(grader: Grader, completions: Sequence[str], task: Task
                ) -> list[GradeResult | Exception]:
  """The G completions of one task graded together, one entry per completion: its GradeResult,
  or the exception that stopped its grading -- returned, not raised, so the caller makes exactly
  those completions `infra_error`. A grader with its own `grade_group` (a judge scoring the group
  relative to each other in one call, RULER-style) succeeds or fails for the whole group (a
  relative score needs every answer); any other is called once per completion and fails per
  completion, as a per-completion loop would."""
  group = getattr(grader, "grade_group", None)
  if group is None:
    return [_graded(grader, c, task) for c in completions]
  try:
    out = list(group(list(completions), task))
  except Exception as e:  # noqa: BLE001 -- the caller records it as an infra error
    return [e] * len(completions)
  if len(out) != len(completions):
    err = RuntimeError(f"{type(grader).__name__}.grade_group returned {len(out)} results for "
                       f"{len(completions)} completions")
    return [err] * len(completions)
  return out


def _graded(grader: Grader, completion: str, task: Task) -> GradeResult | Exception:
  try:
    return grader(completion, task)
  except Exception as e:  # noqa: BLE001 -- the caller records it as an infra error
    return e


def grader_metrics(grader: Grader) -> dict[str, float]:
  """The grader's own counters since the last call (its optional `metrics()`), else {}."""
  report = getattr(grader, "metrics", None)
  return report() if report is not None else {}
