"""The grader protocol: pure functions `(completion_text, task) -> GradeResult(reward, info)`,
registered in `GRADERS` by name (`make_grader(name, cfg)`; an unknown name lists the
registered ones). Every module of posttrain_jax/graders/ (and a task family's own module in
posttrain_jax/tasks/ or an environment's in posttrain_jax/envs/) is imported on the first
lookup: a new grader is one file with `@register_grader(name, ConfigClass)` plus its test.

A completion in which no answer can be found scores 0 with `info["parse_ok"] = False`: that is
a failure of the *policy*, not of the infrastructure. A task whose own reference answer cannot
be read raises `GraderError` (a data bug, naming the task)."""
from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, Callable

from posttrain_jax.registry import Registry

if TYPE_CHECKING:   # graders read tasks, tasks import no grader module at run time
  from posttrain_jax.tasks.task import Task


class GraderError(ValueError):
  """The task (not the completion) cannot be graded: its reference data is malformed."""


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
  """A registered grader: the pure function and its config class."""
  name: str
  fn: Callable[[str, Task, Any], GradeResult]   # (completion, task, cfg) -> GradeResult
  config_cls: type


GRADERS: Registry[GraderSpec] = Registry(
    "grader", discover=("posttrain_jax.graders", "posttrain_jax.tasks", "posttrain_jax.envs"))


def register_grader(name: str, config_cls: type):
  """Decorator: `@register_grader("numeric", NumericConfig)` on `fn(completion, task, cfg)`."""
  def deco(fn):
    GRADERS.register(name)(GraderSpec(name, fn, config_cls))
    return fn
  return deco


def make_grader(name: str, cfg: Any = None) -> Grader:
  """The grader `name` with its config bound: a `(completion, task) -> GradeResult` function.

  `cfg` defaults to the grader's config class with default values.
  """
  spec = GRADERS.get(name)
  if cfg is None:
    cfg = spec.config_cls()
  elif not isinstance(cfg, spec.config_cls):
    raise TypeError(f"grader {name!r} takes a {spec.config_cls.__name__}, "
                    f"got {type(cfg).__name__}")
  return functools.partial(spec.fn, cfg=cfg)


def grade(name: str, completion: str, task: Task, cfg: Any = None) -> GradeResult:
  """One-off convenience: `make_grader(name, cfg)(completion, task)`."""
  return make_grader(name, cfg)(completion, task)


