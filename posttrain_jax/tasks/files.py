"""Task sources that read a file: "jsonl", "parquet" and "hf_disk" (tasks/bank.py's docstring
says what each reads). Rows become `Task`s through the configured column names; every other
column lands in `Task.metadata`; a malformed row is reported with its file and line or row."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Iterator, Optional

import numpy as np

from posttrain_jax.errors import PathNotFoundError
from posttrain_jax.tasks import synthetic
from posttrain_jax.tasks.bank import TaskBankConfig, TaskBankError, register_task_source
from posttrain_jax.tasks.task import Task, TaskError, is_held_out

_MAX_REPORTED_ERRORS = 5


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
