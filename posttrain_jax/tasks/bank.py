"""The task bank: sources of `Task`s and the grain pipeline that streams them to the actors.

Sources (registered in `SOURCES` with `@register_task_source(name, reads_path=...,
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
from typing import Any, Callable, Iterator, Optional

import grain
import numpy as np

from posttrain_jax.tasks import synthetic
from posttrain_jax.tasks.task import Task, TaskError, is_held_out
from posttrain_jax.errors import PathNotFoundError, UserError
from posttrain_jax.registry import Registry

_MAX_REPORTED_ERRORS = 5


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


# ----------------------------------------------------------------------------------------------
# Rows -> Tasks.

@dataclasses.dataclass(frozen=True)
class _Fields:
  prompt: str
  answer: str
  id: str
  chat: bool


def _row_to_task(row: Any, fields: _Fields, default_id: str) -> Task:
  """A Task from one row; raises TaskError with a message naming the field (not the place)."""
  if not isinstance(row, dict):
    raise TaskError(f"expected a JSON object, got {type(row).__name__}")
  for k, v in row.items():  # a lone "\ud800" escape is no text: hashing or tokenizing it fails
    if _has_surrogate(k) or _has_surrogate(v):
      name = repr(k) if not _has_surrogate(k) else "with a lone surrogate in its name"
      raise TaskError(f"field {name} holds a lone surrogate escape (\\ud800-\\udfff), not text")
  for name, what in ((fields.prompt, "prompt"), (fields.answer, "answer")):
    if name not in row:
      hint = (f"; set TaskBankConfig.{what}_field if the {what} is in another field"
              if len(row) else "")
      raise TaskError(f"missing field {name!r} (fields present: {sorted(row)}){hint}")
  prompt, answer = row[fields.prompt], row[fields.answer]
  if answer is None:
    raise TaskError(f"field {fields.answer!r} is null")
  if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
    raise TaskError(f"field {fields.answer!r} must be a string or a number, "
                    f"got {type(answer).__name__}")
  if prompt is None:
    raise TaskError(f"field {fields.prompt!r} is null")
  if fields.chat and isinstance(prompt, str):
    prompt = synthetic.format_prompt(prompt, chat=True)
  raw_id = row.get(fields.id)
  task_id = default_id if raw_id is None or raw_id == "" else str(raw_id)
  metadata = {k: v for k, v in row.items() if k not in (fields.prompt, fields.answer, fields.id)}
  try:
    return Task(id=task_id, prompt=prompt, answer=str(answer), metadata=metadata)
  except TaskError as e:   # re-word "task 'x': ..." as a field error
    raise TaskError(str(e).replace(f"task {task_id!r}: ", "")) from None


def _has_surrogate(value: Any) -> bool:
  try:
    json.dumps(value, ensure_ascii=False).encode("utf-8")
  except UnicodeEncodeError:
    return True
  return False


def _prompt_key(task: Task) -> str:
  return json.dumps(task.prompt, sort_keys=True, ensure_ascii=False)


class _Scan:
  """Collects per-row problems while a source is opened and raises them all at once."""

  def __init__(self, where: str, unit: str = "row"):
    self.where, self.unit, self.errors, self.count = where, unit, [], 0
    self.ids: dict[str, str] = {}

  def add(self, place: str, msg: str):
    """`place` is the full location, e.g. "data/train.jsonl:7" or "data/t.parquet row 7"."""
    self.count += 1
    if len(self.errors) < _MAX_REPORTED_ERRORS:
      self.errors.append(f"{place}: {msg}")

  def check_id(self, task: Task, place: str):
    # a default id ("<file>:<line>") is unique among defaults but can meet an explicit one
    first = self.ids.setdefault(task.id, place)
    if first != place:
      self.add(place, f"duplicate id {task.id!r} (first seen at {first})")

  def raise_if_any(self, n_rows: int):
    if self.count:
      hidden = self.count - len(self.errors)
      more = f"\n  ... and {hidden} more" if hidden else ""
      raise TaskBankError(f"{self.where}: {self.count} malformed {self.unit}(s), nothing loaded:\n  "
                          + "\n  ".join(self.errors) + more)
    if n_rows == 0:
      raise TaskBankError(f"{self.where}: contains no tasks")


def _check_exists(path: str, kind: str, want_dir: bool):
  if not os.path.exists(path):
    raise PathNotFoundError(f"{kind} {path!r} does not exist")
  if want_dir and not os.path.isdir(path):
    raise TaskBankError(f"{kind} {path!r} must be a directory written by save_to_disk")
  if not want_dir and os.path.isdir(path):
    raise TaskBankError(f"{kind} {path!r} is a directory; expected a file")


# ----------------------------------------------------------------------------------------------
# Sources: grain RandomAccessDataSource-compatible (`__len__`, `__getitem__` -> Task).

class JsonlSource:
  """Random access over a JSONL file, validated and indexed (byte offsets) when opened.

  `held_out[i]` says whether row i is in the held-out split of `eval_fraction`.
  """

  def __init__(self, path: str, *, prompt_field: str = "prompt", answer_field: str = "answer",
               id_field: str = "id", chat: bool = False, eval_fraction: float = 0.0):
    _check_exists(path, "JSONL file", want_dir=False)
    self.path = path
    self._fields = _Fields(prompt_field, answer_field, id_field, chat)
    self._name = os.path.basename(path)
    offsets, lengths, lines, held_out = [], [], [], []
    scan = _Scan(path, unit="line")
    with open(path, "rb") as f:
      offset = 0
      for lineno, raw in enumerate(f, start=1):
        start, offset = offset, offset + len(raw)
        if not raw.strip():
          continue
        task = self._parse(raw, lineno, scan)
        if task is None:
          continue
        scan.check_id(task, f"{path}:{lineno}")
        offsets.append(start)
        lengths.append(len(raw))
        lines.append(lineno)
        held_out.append(is_held_out(_prompt_key(task), eval_fraction))
    scan.raise_if_any(len(offsets))
    self._offsets = np.asarray(offsets, np.int64)
    self._lengths = np.asarray(lengths, np.int64)
    self._lines = np.asarray(lines, np.int64)
    self.held_out = np.asarray(held_out, bool)
    self._fd: Optional[int] = None

  def _parse(self, raw: bytes, lineno: int, scan: Optional[_Scan]) -> Optional[Task]:
    """The Task on one line; a problem goes to `scan` (at open) or raises (after open)."""
    try:
      row = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
      msg = f"not UTF-8 text ({e.reason} at byte {e.start})"
    except json.JSONDecodeError as e:
      msg = f"not valid JSON ({e.msg} at column {e.colno})"
    except RecursionError:
      msg = "not JSON we read (nested too deeply)"
    except ValueError as e:  # an integer of more than 4300 digits
      msg = f"not JSON we read ({str(e).split(';')[0]})"
    else:
      try:
        return _row_to_task(row, self._fields, f"{self._name}:{lineno}")
      except TaskError as e:
        msg = str(e)
    if scan is None:
      raise TaskBankError(f"{self.path}:{lineno}: {msg} (the file changed after it was opened)")
    scan.add(f"{self.path}:{lineno}", msg)
    return None

  def __len__(self) -> int:
    return len(self._offsets)

  def __getitem__(self, index: int) -> Task:
    if not -len(self) <= index < len(self):
      raise IndexError(f"row {index} out of range for {len(self)} rows in {self.path}")
    if self._fd is None:
      self._fd = os.open(self.path, os.O_RDONLY)
    raw = os.pread(self._fd, int(self._lengths[index]), int(self._offsets[index]))
    return self._parse(raw, int(self._lines[index]), scan=None)

  def __getstate__(self):
    state = dict(self.__dict__)
    state["_fd"] = None
    return state

  def __del__(self):
    fd = getattr(self, "_fd", None)
    if fd is not None:
      os.close(fd)

  def __repr__(self) -> str:
    return f"JsonlSource({self.path!r}, rows={len(self)})"


class _ArrowRowsSource:
  """Shared scan/validation for table-like sources; subclasses set `_rows(i)` and `_scan_iter`."""

  def _validate(self, where: str, columns: list[str], eval_fraction: float):
    f = self._fields
    missing = [c for c in (f.prompt, f.answer) if c not in columns]
    if missing:
      raise TaskBankError(f"{where}: missing column(s) {missing}; columns present: {columns}; "
                          "set TaskBankConfig.prompt_field / answer_field")
    scan = _Scan(where)
    held_out = []
    for i, row in enumerate(self._scan_rows([c for c in (f.prompt, f.answer, f.id)
                                             if c in columns])):
      try:
        task = _row_to_task(row, f, f"{self._name}:{i}")
      except TaskError as e:
        scan.add(f"{where} row {i}", str(e))
        held_out.append(False)
        continue
      scan.check_id(task, f"{where} row {i}")
      held_out.append(is_held_out(_prompt_key(task), eval_fraction))
    scan.raise_if_any(len(held_out))
    self.held_out = np.asarray(held_out, bool)


class ParquetSource(_ArrowRowsSource):
  """Random access over a parquet file (memory-mapped pyarrow table), validated when opened."""

  def __init__(self, path: str, *, prompt_field: str = "prompt", answer_field: str = "answer",
               id_field: str = "id", chat: bool = False, eval_fraction: float = 0.0):
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
    _check_exists(path, "parquet file", want_dir=False)
    self.path = path
    self._fields = _Fields(prompt_field, answer_field, id_field, chat)
    self._name = os.path.basename(path)
    try:
      self._table = pq.read_table(path, memory_map=True)
    except Exception as e:  # pyarrow raises several types for a bad file
      raise TaskBankError(f"{path}: cannot read as parquet: {e}") from None
    self._validate(path, self._table.column_names, eval_fraction)

  def _scan_rows(self, columns: list[str]) -> Iterator[dict]:
    for batch in self._table.select(columns).to_batches(max_chunksize=4096):
      yield from batch.to_pylist()

  def __len__(self) -> int:
    return self._table.num_rows

  def __getitem__(self, index: int) -> Task:
    if not -len(self) <= index < len(self):
      raise IndexError(f"row {index} out of range for {len(self)} rows in {self.path}")
    index = int(index) % len(self)
    row = self._table.slice(index, 1).to_pylist()[0]
    return _row_to_task(row, self._fields, f"{self._name}:{index}")

  def __repr__(self) -> str:
    return f"ParquetSource({self.path!r}, rows={len(self)})"


class HfDiskSource(_ArrowRowsSource):
  """Random access over a Hugging Face dataset saved with `save_to_disk`."""

  def __init__(self, path: str, *, split: Optional[str] = None, prompt_field: str = "prompt",
               answer_field: str = "answer", id_field: str = "id", chat: bool = False,
               eval_fraction: float = 0.0):
    _check_exists(path, "saved HF dataset directory", want_dir=True)
    try:
      import datasets  # pylint: disable=g-import-not-at-top
    except ImportError:
      raise TaskBankError("source 'hf_disk' needs the `datasets` package: "
                          "pip install datasets") from None
    try:
      ds = datasets.load_from_disk(path)
    except FileNotFoundError as e:
      raise TaskBankError(f"{path}: not a dataset written by save_to_disk ({e})") from None
    if isinstance(ds, datasets.DatasetDict):
      if split is None or split not in ds:
        raise TaskBankError(f"{path} holds a DatasetDict; set TaskBankConfig.hf_split to one of "
                            f"{sorted(ds)} (got {split!r})")
      ds = ds[split]
    elif split is not None:
      raise TaskBankError(f"{path} holds a single Dataset, not a DatasetDict; "
                          f"leave TaskBankConfig.hf_split unset (got {split!r})")
    self.path, self.split = path, split
    self._ds = ds.with_format(None)
    self._fields = _Fields(prompt_field, answer_field, id_field, chat)
    self._name = os.path.basename(os.path.normpath(path)) + (f"/{split}" if split else "")
    self._validate(f"{path}" + (f"[{split}]" if split else ""), list(ds.column_names),
                   eval_fraction)

  def _scan_rows(self, columns: list[str]) -> Iterator[dict]:
    for batch in self._ds.select_columns(columns).iter(batch_size=4096):
      n = len(batch[columns[0]])
      for i in range(n):
        yield {c: batch[c][i] for c in columns}

  def __len__(self) -> int:
    return len(self._ds)

  def __getitem__(self, index: int) -> Task:
    if not -len(self) <= index < len(self):
      raise IndexError(f"row {index} out of range for {len(self)} rows in {self.path}")
    index = int(index) % len(self)
    return _row_to_task(self._ds[index], self._fields, f"{self._name}:{index}")

  def __repr__(self) -> str:
    return f"HfDiskSource({self.path!r}, split={self.split!r}, rows={len(self)})"


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


def _file_kwargs(cfg: TaskBankConfig, eval_fraction: float) -> dict[str, Any]:
  return dict(prompt_field=cfg.prompt_field, answer_field=cfg.answer_field,
              id_field=cfg.id_field, chat=cfg.chat, eval_fraction=eval_fraction)


@register_task_source("jsonl")
def _open_jsonl(cfg: TaskBankConfig, path: str, eval_fraction: float = 0.0) -> JsonlSource:
  return JsonlSource(path, **_file_kwargs(cfg, eval_fraction))


@register_task_source("parquet")
def _open_parquet(cfg: TaskBankConfig, path: str, eval_fraction: float = 0.0) -> ParquetSource:
  return ParquetSource(path, **_file_kwargs(cfg, eval_fraction))


@register_task_source("hf_disk")
def _open_hf_disk(cfg: TaskBankConfig, path: str, eval_fraction: float = 0.0) -> HfDiskSource:
  return HfDiskSource(path, split=cfg.hf_split, **_file_kwargs(cfg, eval_fraction))


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
