"""Minimal safetensors reader/writer over numpy memory maps (bf16 via ml_dtypes).

Format: 8-byte little-endian header length N, N bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`, then the
raw little-endian tensor bytes. Reading maps the file and hands out zero-copy views, so a
loader can slice each device's shard of a tensor without reading the rest of it.

`read_header` / `encode_header` are the one parser and the one encoder of that header, for
files and for in-memory buffers alike (vLLM weight pushes, engines/vllm_worker.py). This
module imports no JAX: the vLLM worker process imports it.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import struct
from typing import Callable, Iterable, Iterator, Union

import ml_dtypes
import numpy as np

from posttrain_jax.errors import UserError

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


class SafetensorsError(UserError, ValueError):
  """A malformed or unreadable safetensors file; the message names the file (and tensor)."""


@dataclasses.dataclass(frozen=True)
class Header:
  """A parsed safetensors header."""
  tensors: dict[str, dict]  # name -> {"dtype": code, "shape": [...], "data_offsets": [b, e]}
  metadata: dict            # the "__metadata__" entry ({} when absent)
  data_start: int           # byte offset of the data section (8 + header length)


def read_header(source: Union[os.PathLike, str, bytes, bytearray, memoryview],
                name: str = "buffer") -> Header:
  """The header of a safetensors file (a path: only the header is read) or of a buffer.

  Checked: the header length fits the file, the JSON is an object of tensor entries, and
  every tensor's bytes lie inside the file, so a truncated file fails here, by name.
  `name` names a buffer in errors (a path names itself).
  """
  if isinstance(source, (str, os.PathLike)):
    try:
      with open(source, "rb") as f:
        def read(offset: int, n: int) -> bytes:
          f.seek(offset)
          return f.read(n)
        return _parse(read, os.fstat(f.fileno()).st_size, str(source))
    except OSError as e:
      raise SafetensorsError(f"{source}: not a readable safetensors file ({e})") from None
  raw = memoryview(source).cast("B")
  return _parse(lambda offset, n: bytes(raw[offset:offset + n]), raw.nbytes, name)


def _parse(read: Callable[[int, int], bytes], size: int, where: str) -> Header:
  """`read(offset, n)` returns up to n bytes at offset; `size` is the whole file's."""
  try:
    (n,) = struct.unpack("<Q", read(0, 8))
    if 8 + n > size:
      raise ValueError(f"header length {n} exceeds the file size {size}")
    tensors = json.loads(read(8, n))
    if not isinstance(tensors, dict):
      raise ValueError("the header is not a JSON object")
    metadata = tensors.pop("__metadata__", None) or {}
    end = max((int(v["data_offsets"][1]) for v in tensors.values()), default=0)
  except (ValueError, KeyError, TypeError, IndexError, struct.error) as e:
    raise SafetensorsError(f"{where}: not a readable safetensors file ({e})") from None
  if 8 + n + end > size:
    raise SafetensorsError(f"{where}: truncated ({size} bytes, its header needs {8 + n + end})")
  return Header(tensors, metadata, 8 + n)


def encode_header(tensors: dict[str, dict], metadata: dict | None = None) -> bytes:
  """Length prefix + JSON header (padded so that the data section is 8-byte aligned)."""
  header = dict(tensors)
  if metadata is not None:
    header["__metadata__"] = metadata
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)
  return struct.pack("<Q", len(blob)) + blob


class SafetensorsFile:
  """Read-only view of one .safetensors file."""

  def __init__(self, path: os.PathLike):
    self.path = pathlib.Path(path)
    header = read_header(self.path)
    self.metadata = header.metadata
    self._header = header.tensors
    self._data_start = header.data_start
    self._mmap = None

  def names(self) -> list[str]:
    return list(self._header)

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._header[name]["shape"])

  def dtype(self, name: str) -> np.dtype:
    code = self._header[name]["dtype"]
    if code not in _DTYPES:
      raise SafetensorsError(f"{self.path}: tensor {name!r} has unsupported dtype {code}")
    return np.dtype(_DTYPES[code])

  def get(self, name: str) -> np.ndarray:
    """Zero-copy view of tensor `name` (read-only)."""
    if self._mmap is None:
      self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
    info = self._header[name]
    begin, end = info["data_offsets"]
    raw = self._mmap[self._data_start + begin:self._data_start + end]
    dtype = self.dtype(name)
    shape = self.shape(name)
    if raw.size != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
      raise SafetensorsError(f"{self.path}: tensor {name!r} byte size does not match its shape")
    return raw.view(dtype).reshape(shape)


def write_safetensors(path: os.PathLike, tensors: Iterable[tuple[str, np.ndarray]],
                      metadata: dict | None = None) -> None:
  """Writes (name, array) pairs; arrays are consumed one at a time after the header."""
  items = [(name, np.ascontiguousarray(arr)) for name, arr in tensors]
  header, offset = {}, 0
  for name, arr in items:
    if arr.dtype not in _NAMES:
      raise SafetensorsError(f"{path}: tensor {name!r} has unsupported dtype {arr.dtype}")
    header[name] = {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape),
                    "data_offsets": [offset, offset + arr.nbytes]}
    offset += arr.nbytes
  with open(path, "wb") as f:
    f.write(encode_header(header, {"format": "pt", **(metadata or {})}))
    for _, arr in items:
      f.write(arr.tobytes())


class Checkpoint:
  """All tensors of a HF checkpoint directory: one file or a sharded `*.index.json`."""

  def __init__(self, directory: os.PathLike):
    self.dir = pathlib.Path(directory)
    index = self.dir / "model.safetensors.index.json"
    single = self.dir / "model.safetensors"
    self._where: dict[str, SafetensorsFile] = {}
    if index.exists():
      try:
        weight_map = json.loads(index.read_text())["weight_map"]
      except (json.JSONDecodeError, KeyError) as e:
        raise SafetensorsError(f"{index}: malformed index ({e})") from None
      files = {}
      for name, fname in weight_map.items():
        if fname not in files:
          if not (self.dir / fname).exists():
            raise SafetensorsError(f"{index}: lists {fname} which does not exist in {self.dir}")
          files[fname] = SafetensorsFile(self.dir / fname)
        self._where[name] = files[fname]
    elif single.exists():
      f = SafetensorsFile(single)
      self._where = {name: f for name in f.names()}
    else:
      others = sorted(p.name for p in self.dir.glob("*.safetensors"))
      if len(others) == 0:
        raise SafetensorsError(
            f"{self.dir}: no weights found (expected model.safetensors or "
            "model.safetensors.index.json)")
      for fname in others:
        f = SafetensorsFile(self.dir / fname)
        self._where.update({name: f for name in f.names()})

  def __contains__(self, name: str) -> bool:
    return name in self._where

  def names(self) -> list[str]:
    return list(self._where)

  def file_of(self, name: str) -> SafetensorsFile:
    return self._where[name]

  def get(self, name: str) -> np.ndarray:
    return self._where[name].get(name)

  def items(self) -> Iterator[tuple[str, np.ndarray]]:
    for name in self._where:
      yield name, self.get(name)
