"""The task bank: sources of `Task`s and the grain pipeline that streams them to the actors.

Sources (the file readers are in files.py; registered in `SOURCES` with `@register_task_source(name, reads_path=...,
eval_tasks=...)`, chosen by `TaskBankConfig.source`; every module of posttrain_jax/tasks/ is
imported on the first lookup, so a new source is one file there):

* "jsonl": a file with one JSON object per line (blank lines skipped), e.g.
  `{"id": "q1", "prompt": "12+7=", "answer": "19", "level": 1}`. The prompt is a string or a
  list of chat messages; the answer a string or a number. The file is scanned once when opened:
  every line is parsed and checked, byte offsets are indexed, and any malformed line is reported
  with file name and line number; `__getitem__` then reads one line with `os.pread`, so large
  files are never held in memory.
* "parquet": a parquet file (pyarrow, memory-mapped) with the same columns.
* "hf_disk": a Hugging Face `datasets` Dataset or DatasetDict written with `save_to_disk`
  (read with `load_from_disk`; pick the split of a DatasetDict with `hf_split`).
* "synthetic": a generator from `synthetic.GENERATORS` ("arithmetic", "countdown").
* peers' task suites, each in its own file with its grader, chosen by `dataset=
  "<source>:<name>"`: "reasoning_gym" (reasoning_gym_suite.py), "humaneval", "bfcl"; a suite
  held in memory registers with `register_split_source(name, split)`.
A source that reads a file (`reads_path`) holds its rows out by hash or takes a separate
`eval_path`; one that generates its tasks (`reads_path=False`) gives its held-out tasks itself
(`eval_tasks(cfg, n)`).

Column names are configurable (`prompt_field`, `answer_field`, `id_field`); every other column
lands in `Task.metadata`. A row without an id is named "<file name>:<line or row number>".

Pipeline (grain's MapDataset API): source -> this process's shard `[process_index::process_count]`
-> `shuffle(seed)` -> `repeat(num_epochs)` (reshuffled every epoch) -> iterator. Every step is an
index permutation, so the order depends only on the config: the same seed gives the same order in
every process and run. `TaskBank.iterator()` returns a `TaskIterator` whose `get_state()` /
`set_state()` (JSON-serialisable; also `get_state_bytes()` / `set_state_bytes()`) resume exactly
where it stopped; the state carries a fingerprint of the config and refuses to load into a
different pipeline. An endless synthetic stream is not shuffled (its tasks are random already).

Held-out evaluation data is either a separate file (`eval_path`) or a fraction of the rows chosen
by a fixed hash of the prompt (files) or of the problem key (synthetic), see `task.is_held_out`;
held-out rows never appear in the training stream. `TaskBank.eval_tasks()` returns them as a list.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from typing import Any, Callable, Optional

import grain
import numpy as np

from posttrain_jax.tasks import synthetic
from posttrain_jax.tasks.task import Task
from posttrain_jax.errors import UserError
from posttrain_jax.registry import Registry


class TaskBankError(UserError, ValueError):
  """Malformed task data or config; the message names the file, the line or the field."""


@dataclasses.dataclass(frozen=True)
class TaskBankConfig:
  """Where tasks come from and in which order they are streamed."""
  source: str = "synthetic"            # a SOURCES name: "jsonl", "parquet", "hf_disk",
                                       # "synthetic", or a source registered in tasks/
  path: Optional[str] = None           # jsonl/parquet file or save_to_disk directory (files only)
  hf_split: Optional[str] = None       # hf_disk: split of a saved DatasetDict ("train", "test")
  prompt_field: str = "prompt"         # files: column of the prompt (string or chat messages)
  answer_field: str = "answer"         # files: column of the reference answer
  id_field: str = "id"                 # files: column of the task id (optional per row)
  chat: bool = False                   # give string prompts as [{"role": "user", "content": p}]
  dataset: Optional[str] = None        # a task suite's dataset, "<source>:<name>"
                                       # (reasoning_gym:basic_arithmetic, humaneval,
                                       # bfcl:simple); its prefix selects `source`
  dataset_config: Any = None           # that dataset's own options (a dict; the source's doc)
  generator: str = "arithmetic"        # synthetic: a synthetic.GENERATORS name
  generator_config: Any = None         # synthetic: ArithmeticConfig/CountdownConfig; None: default
  synthetic_size: Optional[int] = None  # synthetic: tasks per epoch; None = an endless stream
  seed: int = 0                        # shuffle seed and synthetic stream seed, in [0, 2**32)
  shuffle: bool = True                 # shuffle rows, reshuffled each epoch (not endless streams)
  num_epochs: Optional[int] = None     # passes over the data; None = repeat forever
  eval_fraction: float = 0.0           # held out by a fixed hash of the prompt / problem key
  eval_path: Optional[str] = None      # a separate eval file/dir of the same source kind
  eval_size: Optional[int] = None      # at most this many eval tasks; None: all (synthetic: 256)
  process_index: int = 0               # this process's shard (jax.process_index())
  process_count: int = 1               # number of shards (jax.process_count())
  even_shards: bool = False            # drop len % process_count rows so shards are equal
  read_threads: int = 0                # grain ReadOptions.num_threads (0: read in the caller)

  def __post_init__(self):
    if self.dataset:
      prefix = self.dataset.split(":", 1)[0]
      if prefix not in SOURCES:
        raise TaskBankError(f"TaskBankConfig.dataset {self.dataset!r}: no task source "
                            f"{prefix!r}; registered sources: {', '.join(SOURCES.names())}")
      if self.source not in ("synthetic", prefix):
        raise TaskBankError(f"TaskBankConfig: source {self.source!r} and dataset "
                            f"{self.dataset!r} disagree; give the dataset alone")
      object.__setattr__(self, "source", prefix)
    if self.source not in SOURCES:
      raise TaskBankError(f"TaskBankConfig.source {self.source!r} is unknown; "
                          f"registered sources: {', '.join(SOURCES.names())}")
    is_file = SOURCES.get(self.source).reads_path
    if is_file and not self.path:
      raise TaskBankError(f"TaskBankConfig.path is required for source {self.source!r}")
    if not is_file and (self.path or self.eval_path):
      raise TaskBankError(f"TaskBankConfig.path / eval_path do not apply to source "
                          f"{self.source!r}: it reads no file")
    if not 0.0 <= self.eval_fraction < 1.0:
      raise TaskBankError(f"TaskBankConfig.eval_fraction must be in [0, 1), "
                          f"got {self.eval_fraction}")
    if self.eval_path and self.eval_fraction:
      raise TaskBankError("TaskBankConfig: give eval_path or eval_fraction, not both")
    if not 0 <= self.process_index < self.process_count:
      raise TaskBankError(f"TaskBankConfig: need 0 <= process_index < process_count, got "
                          f"{self.process_index} and {self.process_count}")
    if not 0 <= self.seed < 2**32:
      raise TaskBankError(f"TaskBankConfig.seed must be in [0, 2**32), got {self.seed}")
    if self.num_epochs is not None and self.num_epochs < 1:
      raise TaskBankError(f"TaskBankConfig.num_epochs must be >= 1 or None, "
                          f"got {self.num_epochs}")
    if self.source == "synthetic" and self.synthetic_size is None and self.num_epochs is not None:
      raise TaskBankError("TaskBankConfig: an endless synthetic stream has no epochs; set "
                          "synthetic_size to use num_epochs")
    if self.eval_size is not None and self.eval_size < 0:
      raise TaskBankError(f"TaskBankConfig.eval_size must be >= 0, got {self.eval_size}")


class SubsetSource:
  """The rows `indices` of another source (e.g. its training part), random access."""

  def __init__(self, source: Any, indices: np.ndarray):
    self.source, self.indices = source, np.asarray(indices, np.int64)

  def __len__(self) -> int:
    return len(self.indices)

  def __getitem__(self, index: int) -> Task:
    return self.source[int(self.indices[index])]

  def __repr__(self) -> str:
    return f"SubsetSource({self.source!r}, rows={len(self)})"


@dataclasses.dataclass(frozen=True)
class TaskSourceSpec:
  """A registered task source: `open(cfg, path, eval_fraction)` -> a random-access source of
  Tasks (`__len__`, `__getitem__`; sys.maxsize rows = endless); a file source also has
  `held_out`, a bool per row. `eval_tasks(cfg, n)`: a generating source's held-out tasks."""
  name: str
  open: Callable[..., Any]
  reads_path: bool = True
  eval_tasks: Optional[Callable[[Any, int], list]] = None


SOURCES: Registry[TaskSourceSpec] = Registry("task source", discover="posttrain_jax.tasks")


def register_task_source(name: str, *, reads_path: bool = True,
                         eval_tasks: Optional[Callable[[Any, int], list]] = None):
  """Decorator registering `open(cfg, path, eval_fraction) -> source` under `name`."""
  def deco(fn):
    SOURCES.register(name)(TaskSourceSpec(name, fn, reads_path, eval_tasks))
    return fn
  return deco


class ListSource:
  """Tasks held in a list, random access (a suite small enough to hold in memory)."""

  def __init__(self, tasks: list[Task]):
    self.tasks = tasks

  def __len__(self) -> int:
    return len(self.tasks)

  def __getitem__(self, index: int) -> Task:
    return self.tasks[int(index)]


def register_split_source(name: str, split: Callable[..., list[Task]]) -> None:
  """Registers a suite held in memory: `split(cfg, held)` gives its training (held=False) or
  held-out (held=True) tasks; the held-out ones are cut to `eval_size`."""
  def eval_tasks(cfg: TaskBankConfig, n: int) -> list[Task]:
    return split(cfg, held=True)[:n]

  def open_source(cfg: TaskBankConfig, path: Optional[str] = None,
                  eval_fraction: float = 0.0) -> ListSource:
    del path, eval_fraction
    return ListSource(split(cfg, held=False))

  register_task_source(name, reads_path=False, eval_tasks=eval_tasks)(open_source)


def _synthetic_eval_tasks(cfg: TaskBankConfig, n: int) -> list[Task]:
  """`n` distinct tasks from the held-out stream of seed 0 (fewer if its problem space is
  smaller)."""
  if cfg.eval_fraction <= 0:
    raise TaskBankError("no held-out split: set TaskBankConfig.eval_fraction > 0")
  gen_cfg = synthetic.GENERATORS.get(cfg.generator).config_cls() if cfg.generator_config is None \
      else cfg.generator_config
  return synthetic.distinct_tasks(cfg.generator, gen_cfg, n, seed=0, partition=synthetic.EVAL,
                                  eval_fraction=cfg.eval_fraction, chat=cfg.chat)


@register_task_source("synthetic", reads_path=False, eval_tasks=_synthetic_eval_tasks)
def _open_synthetic(cfg: TaskBankConfig, path: Optional[str] = None,
                    eval_fraction: float = 0.0) -> synthetic.SyntheticSource:
  del path
  return synthetic.SyntheticSource(cfg.generator, cfg.generator_config, seed=cfg.seed,
                                   size=cfg.synthetic_size, partition=synthetic.TRAIN,
                                   eval_fraction=eval_fraction, chat=cfg.chat)


# ----------------------------------------------------------------------------------------------
# The checkpointable iterator.

class TaskIterator(grain.DatasetIterator):
  """A grain DatasetIterator over Tasks whose state names the pipeline it belongs to.

  `get_state()` -> `{"fingerprint": str, "position": <grain state>}` (JSON-serialisable);
  `set_state()` raises `TaskBankError` for a state saved by a different task bank config.
  """

  def __init__(self, parent: grain.DatasetIterator, fingerprint: str):
    super().__init__(parent)
    self.fingerprint = fingerprint

  def __next__(self) -> Task:
    return next(self._parent)

  def get_state(self) -> dict[str, Any]:
    return {"fingerprint": self.fingerprint, "position": self._parent.get_state()}

  def set_state(self, state: dict[str, Any]) -> None:
    if not isinstance(state, dict) or "fingerprint" not in state or "position" not in state:
      raise TaskBankError("not a TaskIterator state: expected keys 'fingerprint' and 'position'")
    if state["fingerprint"] != self.fingerprint:
      raise TaskBankError(
          f"this iterator state was saved by a different task bank (fingerprint "
          f"{state['fingerprint']} != {self.fingerprint}): source, data, seed, shuffle, epochs, "
          "eval split or shard differ; resume with the TaskBankConfig of the saved run")
    self._parent.set_state(state["position"])

  def get_state_bytes(self) -> bytes:
    return json.dumps(self.get_state(), sort_keys=True).encode("utf-8")

  def set_state_bytes(self, data: bytes) -> None:
    try:
      state = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise TaskBankError(f"iterator state is not valid JSON: {e}") from None
    self.set_state(state)


# ----------------------------------------------------------------------------------------------
# The bank.

class TaskBank:
  """Opens (and validates) the sources of a `TaskBankConfig`; builds datasets and iterators.

      bank = TaskBank(TaskBankConfig(source="jsonl", path="train.jsonl", eval_fraction=0.05))
      it = bank.iterator()              # endless, shuffled, this process's shard
      task = next(it)
      state = it.get_state()            # JSON; later: bank.iterator().set_state(state)
      held_out = bank.eval_tasks()      # list[Task], disjoint from the training stream
  """

  def __init__(self, cfg: TaskBankConfig):
    self.cfg = cfg
    self.spec = spec = SOURCES.get(cfg.source)
    opener = spec.open
    if not spec.reads_path:
      self.train_source = opener(cfg, None, cfg.eval_fraction)
      self._eval_source = None
    else:
      full = opener(cfg, cfg.path, cfg.eval_fraction)
      if cfg.eval_fraction > 0:
        if full.held_out.all():
          raise TaskBankError(f"{cfg.path}: eval_fraction={cfg.eval_fraction} holds out every "
                              f"one of its {len(full)} rows; nothing is left to train on")
        self.train_source = SubsetSource(full, np.flatnonzero(~full.held_out))
        self._eval_source = SubsetSource(full, np.flatnonzero(full.held_out))
      else:
        self.train_source = full
        self._eval_source = opener(cfg, cfg.eval_path) if cfg.eval_path else None
    self.fingerprint = self._fingerprint()

  @property
  def endless(self) -> bool:
    """Whether the training source itself is infinite (an unsized synthetic stream)."""
    return len(self.train_source) >= sys.maxsize

  def _fingerprint(self) -> str:
    cfg = self.cfg
    ident = {
        "source": cfg.source, "file": os.path.basename(os.path.normpath(cfg.path or "")),
        "hf_split": cfg.hf_split, "fields": [cfg.prompt_field, cfg.answer_field, cfg.id_field],
        "chat": cfg.chat, "generator": None if self.spec.reads_path else cfg.generator,
        "generator_config": None if self.spec.reads_path else repr(cfg.generator_config),
        "synthetic_size": cfg.synthetic_size, "seed": cfg.seed, "shuffle": cfg.shuffle,
        "num_epochs": cfg.num_epochs, "eval_fraction": cfg.eval_fraction,
        "shard": [cfg.process_index, cfg.process_count, cfg.even_shards],
        "rows": min(len(self.train_source), sys.maxsize),
    }
    if cfg.dataset:  # only then: the fingerprints of runs without one stay as they were
      ident.update(dataset=cfg.dataset, dataset_config=repr(cfg.dataset_config))
    blob = json.dumps(ident, sort_keys=True, default=str).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()[:16]

  def dataset(self) -> grain.MapDataset:
    """This process's training stream as a grain MapDataset of Tasks (sharded, shuffled, repeated)."""
    cfg = self.cfg
    ds = grain.MapDataset.source(self.train_source)
    if self.endless:
      return ds[cfg.process_index::cfg.process_count]
    n = len(ds)
    if cfg.even_shards:
      ds = ds[:n - n % cfg.process_count]
    ds = ds[cfg.process_index::cfg.process_count]
    if len(ds) == 0:
      raise TaskBankError(f"shard {cfg.process_index} of {cfg.process_count} is empty: only {n} "
                          "training tasks")
    if cfg.shuffle:
      ds = ds.shuffle(seed=cfg.seed)
    return ds.repeat(cfg.num_epochs)

  def iterator(self) -> TaskIterator:
    """A fresh, checkpointable iterator over `dataset()`."""
    read = grain.ReadOptions(num_threads=self.cfg.read_threads,
                             prefetch_buffer_size=max(self.cfg.read_threads, 1) * 4)
    parent = self.dataset().to_iter_dataset(read).__iter__()
    return TaskIterator(parent, self.fingerprint)

  def eval_tasks(self, shard: bool = False) -> list[Task]:
    """The held-out tasks (at most `eval_size`), in a seed-independent order.

    A source that generates its tasks gives `eval_size` (default 256) held-out tasks itself
    (synthetic: distinct tasks from the held-out stream of seed 0). With `shard`, only this
    process's `[process_index::process_count]` slice.
    """
    cfg = self.cfg
    if not self.spec.reads_path:
      if self.spec.eval_tasks is None:
        raise TaskBankError(f"task source {cfg.source!r} has no held-out tasks")
      tasks = self.spec.eval_tasks(cfg, 256 if cfg.eval_size is None else cfg.eval_size)
    else:
      if self._eval_source is None:
        raise TaskBankError("no held-out split: set TaskBankConfig.eval_fraction or eval_path")
      n = len(self._eval_source) if cfg.eval_size is None else min(cfg.eval_size,
                                                                    len(self._eval_source))
      tasks = [self._eval_source[i] for i in range(n)]
    return tasks[cfg.process_index::cfg.process_count] if shard else tasks
