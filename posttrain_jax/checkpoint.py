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
it later, and the caller's lists and dicts may have moved on by then.

Multi-process jobs: the side-car is per process (each host iterates its own shard of the task
bank and holds its own rollout queue), but orbax writes a JSON item from the primary process
only. So `save` gathers every process's side-car (`multihost.all_gather_json`) and the primary
writes `{"process_count": n, "per_process": [extra_0, ..., extra_{n-1}]}`; `read_extra` /
`restore` hand each process its own entry. A checkpoint is resumed by as many processes as
wrote it (a different count is an error naming both: the data iterators' positions cannot be
split or merged). A one-process checkpoint is the side-car itself, as before. Temporary directories an
interrupted save left behind are deleted by the next Checkpointer of the directory (in the
background from its start, finished before its first save).

Disk faults. A save that fails because of the disk (full, read-only, over quota: an errno
anywhere in the exception chain, `errors.disk_errno`) raises `CheckpointWriteError`, naming the
step's directory, the cause, the latest complete checkpoint (which still restores: orbax
renames a step into place only once every file is written) and what to do. Before it is
raised, the orbax manager is closed and opened again (its background writers joined; it had
listed the failed step as saved, and an async one raises the same fault again at its next
save) and the failed step's temporary directory is deleted (it holds the space the next try
needs). With `async_save` the fault surfaces at the next `save`, `wait` or `close`, and names
the step that was in flight.

Crash test hook: with `POSTTRAIN_JAX_CRASH_AT=<point>:<step>` in the environment, `crash_point`
SIGKILLs the process at that point (tests/run/test_chaos.py, benchmarks/chaos_resume.py). The point
`save:<step>` is inside this module's save of `step`: every item and orbax's commit marker
written in the temporary directory, the rename that commits it not yet done (in the background
thread with `async_save`); the trainer adds `export:<sft.steps>` (sft_model/ exported, the
boundary checkpoint not yet written). Unset, the hook does nothing.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import pathlib
import shutil
import signal
import threading
import time
from typing import Any, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp

from posttrain_jax.errors import (DiskWriteError, UserError, disk_cause, disk_errno, disk_fix, format_bytes,
                                  free_note)
from posttrain_jax.multihost import all_gather_json
from posttrain_jax.types import TrainState


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """When and where checkpoints are written."""
  every_steps: int = 50           # save every N steps (and at the end); 0 = only at the end
  max_to_keep: int = 2            # older checkpoints are deleted
  async_save: bool = False        # save in a background thread (the step loop continues)


CRASH_ENV = "POSTTRAIN_JAX_CRASH_AT"
_TMP_SUFFIX = ".orbax-checkpoint-tmp"   # orbax's name for a step directory not yet committed


class CheckpointWriteError(DiskWriteError):
  """A checkpoint could not be written (disk full / read-only ...): the earlier ones are intact."""


class ProcessCountError(UserError, ValueError):
  """A checkpoint resumed by a different number of processes than wrote it."""


def _side_car(extra: dict) -> dict:
  """What is written for this process's `extra` (a copy; see the module docstring)."""
  everyone = all_gather_json(extra)
  if len(everyone) == 1:
    return everyone[0]
  return {"process_count": len(everyone), "per_process": everyone}


def _own(side_car: dict, where: pathlib.Path) -> dict:
  """This process's entry of a side-car read from `where`."""
  count = int(side_car.get("process_count", 1)) if "per_process" in side_car else 1
  if count != jax.process_count():
    raise ProcessCountError(
        f"checkpoint {where} was written by {count} process(es) and this job has "
        f"{jax.process_count()}: each process's data-iterator and rollout state cannot be split "
        f"or merged; resume with {count} process(es), or start over in a new --workdir")
  return side_car["per_process"][jax.process_index()] if count > 1 else side_car


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


def _join_writers(timeout_s: float = 60.0) -> None:
  """Waits (at most `timeout_s`) for orbax's writer threads. A failed synchronous save raises
  at the first failed write while the others still run: seen writing into the step's
  temporary directory as it was being removed, leaving it behind (1 run in 15)."""
  try:
    from orbax.checkpoint._src.futures import future
    writer = future._SignalingThread
  except (ImportError, AttributeError):  # another orbax: nothing known to wait for
    return
  deadline = time.monotonic() + timeout_s
  for t in threading.enumerate():
    if isinstance(t, writer) and t is not threading.current_thread():
      threading.Thread.join(t, max(0.0, deadline - time.monotonic()))  # not its raising join


class Checkpointer:
  """Saves / restores (TrainState, extra JSON) under `directory/<step>`."""

  def __init__(self, directory: str | pathlib.Path, cfg: CheckpointConfig = CheckpointConfig()):
    self.cfg = cfg
    self.directory = pathlib.Path(directory).absolute()
    self._in_flight: Optional[tuple[int, int]] = None  # (step, bytes) an async save still writes
    if os.environ.get(CRASH_ENV, "").startswith("save:"):
      _arm_save_crash()
    try:
      self._mngr = self._manager()
    except Exception as e:
      code = disk_errno(e)
      if code is None:
        raise
      raise CheckpointWriteError(
          f"cannot use checkpoint directory {self.directory}: {disk_cause(code)}"
          f"{free_note(code, self.directory)}; {disk_fix(code, self.directory)}", code) from e

  def _manager(self) -> ocp.CheckpointManager:
    # The step directory is made in `save` itself, not in orbax's background: made there, a
    # failed mkdir (read-only / full disk) left orbax's writer threads waiting for its
    # "directory created" signal for 300 s, so the process hung that long before it exited.
    options = ocp.CheckpointManagerOptions(
        max_to_keep=self.cfg.max_to_keep, create=True, cleanup_tmp_directories=True,
        enable_async_checkpointing=self.cfg.async_save,
        async_options=ocp.AsyncOptions(create_directories_asynchronously=False))
    return ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> Optional[int]:
    return self._mngr.latest_step()

  def should_save(self, step: int) -> bool:
    return self.cfg.every_steps > 0 and step % self.cfg.every_steps == 0

  def save(self, step: int, state: TrainState, extra: dict,
           arrays: Optional[dict[str, Any]] = None) -> None:
    """`arrays`: {item name: pytree of arrays} saved beside the state (e.g. "teacher"). `extra`
    is copied now: what is saved is its value at this call, even when the write is async.
    A disk fault raises `CheckpointWriteError` (module docstring)."""
    flats = {name: _flat(tree) for name, tree in (arrays or {}).items()}
    if {"state", "extra"} & set(flats):
      raise ValueError(f"checkpoint item names 'state' and 'extra' are taken, got {sorted(flats)}")
    flats["state"] = _flatten(state)
    nbytes = sum(int(getattr(x, "nbytes", 0)) for flat in flats.values() for x in flat.values())
    self.wait()  # an async save still in flight: its fault is reported as its own step's
    with self._disk_faults(step, nbytes):
      self._mngr.save(step, args=ocp.args.Composite(
          extra=ocp.args.JsonSave(_side_car(extra)),
          **{name: ocp.args.StandardSave(flat) for name, flat in flats.items()}),
          force=True)
    if self.cfg.async_save:
      self._in_flight = (step, nbytes)

  def wait(self) -> None:
    """Returns once no save is in flight (raises `CheckpointWriteError` if it failed)."""
    step, nbytes = self._in_flight or (None, 0)
    with self._disk_faults(step, nbytes):
      self._in_flight = None
      self._mngr.wait_until_finished()

  @contextlib.contextmanager
  def _disk_faults(self, step: Optional[int], nbytes: int):
    """Turns a disk fault while saving `step` (`nbytes` of arrays) into `CheckpointWriteError`,
    after removing the step's temporary directory and re-reading the steps on disk; other
    errors pass through."""
    try:
      yield
    except Exception as e:
      code = disk_errno(e)
      if code is None or step is None:
        raise
      self._recover(step)
      latest = self._latest_on_disk()
      kept = (f"checkpoint {latest} is still the latest and restores" if latest is not None
              else "no earlier checkpoint exists")
      size = (f", the step has {format_bytes(nbytes)} of arrays"
              if code in (errno.ENOSPC, errno.EDQUOT) else "")
      raise CheckpointWriteError(
          f"checkpoint {self.directory / str(step)} was not written: {disk_cause(code)}{size}"
          f"{free_note(code, self.directory)}; {kept}; {disk_fix(code, self.directory, False)}, "
          "then rerun the same command to resume", code) from e

  def _latest_on_disk(self) -> Optional[int]:
    try:
      return self.latest_step()
    except Exception:  # no manager could be made again: orbax's committed steps are the
      steps = [int(p.name) for p in self.directory.iterdir() if p.name.isdigit()]  # renamed ones
      return max(steps, default=None)

  def _recover(self, step: int) -> None:
    """After a failed save of `step`: a fresh manager (the old one's background writers
    joined; an async one would raise the same fault again at its next save, and had listed
    `step` as saved) and no temporary directory of `step`."""
    try:
      self._mngr.close()
    except Exception:  # the fault being reported, raised again by the writers it joins
      pass
    _join_writers()
    for _ in range(3):  # a writer still finishing may add a file while the tree is removed
      for tmp in self.directory.glob(f"{step}{_TMP_SUFFIX}*"):
        shutil.rmtree(tmp, ignore_errors=True)
      if not any(self.directory.glob(f"{step}{_TMP_SUFFIX}*")):
        break
    try:
      self._mngr = self._manager()
    except Exception:  # the disk refuses even that: the old one may still answer latest_step
      pass

  def read_extra(self, step: int) -> dict:
    """Only the JSON side-car of step `step` (no arrays are read)."""
    out = self._mngr.restore(step, args=ocp.args.Composite(extra=ocp.args.JsonRestore()))
    return _own(out["extra"], self.directory / str(step))

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
    return state, _own(out["extra"], self.directory / str(step))

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
    try:
      self.wait()
    finally:
      self._mngr.close()
