"""Orbax checkpoints that resume a run bit for bit.

A checkpoint at step s holds the whole `TrainState` (params, optimizer state, step, rng) as
arrays -- restored into the live shardings -- and a JSON side-car with everything else the run
needs to continue exactly: data-iterator state, policy version, replay-queue contents, the
config it was written with. Orbax writes to a temporary directory and renames it on commit,
so a crash mid-save never leaves a checkpoint that looks complete.

The state is saved as a flat `{path: array}` dict (paths from `jax.tree_util.keystr`), so
integer layer keys and optax's NamedTuples need no special handling; restore maps the
arrays back onto the live state's tree structure and shardings. Other arrays the run carries
(an EMA teacher's parameters) are saved the same way as named extra items (`arrays`), and
restored by name into the structure and shardings of a live tree (`restore_arrays`).

The side-car is copied when `save` is called (JSON round trip): with `async_save` orbax writes
it later, and the caller's lists and dicts may have moved on by then. Temporary directories an
interrupted save left behind are deleted by the next Checkpointer of the directory (in the
background from its start, finished before its first save).

Crash test hook: with `POSTTRAIN_JAX_CRASH_AT=<point>:<step>` in the environment, `crash_point`
SIGKILLs the process at that point (tests/test_chaos.py, benchmarks/chaos_resume.py). The point
`save:<step>` is inside this module's save of `step`: every item and orbax's commit marker
written in the temporary directory, the rename that commits it not yet done (in the background
thread with `async_save`); the trainer adds `export:<sft.steps>` (sft_model/ exported, the
boundary checkpoint not yet written). Unset, the hook does nothing.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
from typing import Any, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp

from posttrain_jax.types import TrainState


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """When and where checkpoints are written."""
  every_steps: int = 50           # save every N steps (and at the end); 0 = only at the end
  max_to_keep: int = 2            # older checkpoints are deleted
  async_save: bool = False        # save in a background thread (the step loop continues)


CRASH_ENV = "POSTTRAIN_JAX_CRASH_AT"


def crash_point(point: str, step: int) -> None:
  """SIGKILLs this process if $POSTTRAIN_JAX_CRASH_AT is `<point>:<step>` (a test hook)."""
  if os.environ.get(CRASH_ENV) == f"{point}:{step}":
    os.kill(os.getpid(), signal.SIGKILL)


def _arm_save_crash() -> None:
  """Makes orbax's commit rename of a step directory call crash_point("save", step) first."""
  from orbax.checkpoint._src.path import async_path
  rename = async_path.rename
  if getattr(rename, "crash_armed", False):
    return

  async def crashing_rename(src, dst):
    if dst.name.isdigit():
      crash_point("save", int(dst.name))
    return await rename(src, dst)

  crashing_rename.crash_armed = True
  async_path.rename = crashing_rename


def _key_data(rng):
  """The raw key data of `rng`; for an abstract key (ShapeDtypeStruct), its abstract form."""
  if isinstance(rng, jax.ShapeDtypeStruct):
    out = jax.eval_shape(jax.random.key_data, rng)
    return jax.ShapeDtypeStruct(out.shape, out.dtype, sharding=rng.sharding)
  return jax.random.key_data(rng)


def _flat(tree) -> dict[str, Any]:
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {jax.tree_util.keystr(path): leaf for path, leaf in leaves}


def _flatten(state: TrainState) -> dict[str, Any]:
  return _flat(dataclasses.replace(state, rng=_key_data(state.rng)))


def _target(flat: dict[str, Any]) -> dict[str, Any]:
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
      flat)


def _unflatten(like, flat: dict[str, Any], where: pathlib.Path):
  """`flat` ({keystr: array}) in the tree structure of `like`."""
  paths, treedef = jax.tree_util.tree_flatten_with_path(like)
  missing = [jax.tree_util.keystr(p) for p, _ in paths if jax.tree_util.keystr(p) not in flat]
  if missing:
    raise ValueError(f"checkpoint {where} does not match this run's state "
                     f"(missing {missing[:3]}); was it written by another model/optimizer?")
  return jax.tree_util.tree_unflatten(treedef, [flat[jax.tree_util.keystr(p)] for p, _ in paths])


class Checkpointer:
  """Saves / restores (TrainState, extra JSON) under `directory/<step>`."""

  def __init__(self, directory: str | pathlib.Path, cfg: CheckpointConfig = CheckpointConfig()):
    self.cfg = cfg
    self.directory = pathlib.Path(directory).absolute()
    if os.environ.get(CRASH_ENV, "").startswith("save:"):
      _arm_save_crash()
    options = ocp.CheckpointManagerOptions(max_to_keep=cfg.max_to_keep, create=True,
                                           enable_async_checkpointing=cfg.async_save,
                                           cleanup_tmp_directories=True)
    self._mngr = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> Optional[int]:
    return self._mngr.latest_step()

  def should_save(self, step: int) -> bool:
    return self.cfg.every_steps > 0 and step % self.cfg.every_steps == 0

  def save(self, step: int, state: TrainState, extra: dict,
           arrays: Optional[dict[str, Any]] = None) -> None:
    """`arrays`: {item name: pytree of arrays} saved beside the state (e.g. "teacher"). `extra`
    is copied now: what is saved is its value at this call, even when the write is async."""
    items = {name: ocp.args.StandardSave(_flat(tree)) for name, tree in (arrays or {}).items()}
    if {"state", "extra"} & set(items):
      raise ValueError(f"checkpoint item names 'state' and 'extra' are taken, got {sorted(items)}")
    self._mngr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(_flatten(state)),
        extra=ocp.args.JsonSave(json.loads(json.dumps(extra))), **items),
        force=True)

  def wait(self) -> None:
    self._mngr.wait_until_finished()

  def read_extra(self, step: int) -> dict:
    """Only the JSON side-car of step `step` (no arrays are read)."""
    return self._mngr.restore(step, args=ocp.args.Composite(extra=ocp.args.JsonRestore()))["extra"]

  def restore(self, like: TrainState, step: Optional[int] = None) -> tuple[TrainState, dict]:
    """Restores step `step` (default: latest) into the structure and shardings of `like`
    (arrays, or ShapeDtypeStructs with shardings: `learner.abstract_train_state`)."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    out = self._mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(_target(_flatten(like))), extra=ocp.args.JsonRestore()))
    state = _unflatten(dataclasses.replace(like, rng=_key_data(like.rng)), out["state"],
                       self.directory / str(step))
    state = dataclasses.replace(state, rng=jax.random.wrap_key_data(np.asarray(state.rng)))
    return state, out["extra"]

  def has_arrays(self, step: int, name: str) -> bool:
    """Whether checkpoint `step` holds the extra item `name` (see `save`)."""
    return (self.directory / str(step) / name).is_dir()

  def restore_arrays(self, name: str, like, step: int):
    """Extra item `name` of checkpoint `step` in the structure and shardings of `like` (arrays,
    or ShapeDtypeStructs with shardings)."""
    if not self.has_arrays(step, name):
      raise FileNotFoundError(f"checkpoint {self.directory / str(step)} holds no {name!r} arrays")
    out = self._mngr.restore(step, args=ocp.args.Composite(
        **{name: ocp.args.StandardRestore(_target(_flat(like)))}))
    return _unflatten(like, out[name], self.directory / str(step))

  def close(self) -> None:
    self._mngr.wait_until_finished()
    self._mngr.close()
