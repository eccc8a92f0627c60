"""Moving HF-named tensors from the learner into a running vLLM worker, without a disk file.

The learner packs `(HF name, array)` pairs into ONE safetensors buffer (each array copied
once, with its transpose and dtype cast fused into that copy), and hands the buffer to the
vLLM worker either

- `shm`: as a file in a RAM-backed directory (`/dev/shm`): only its path crosses the
  process boundary; the worker maps it and wraps each tensor zero-copy; or
- `bytes`: as the buffer itself inside `collective_rpc` kwargs (tensors in kwargs arrive as
  plain lists, bytes arrive intact); it is copied several times on the way (msgpack, ZMQ,
  the executor's queue), so it is the slower fallback for machines without a shared tmpfs.

Inside the worker, `WeightReceiver.ptj_reload_weights` (a vLLM worker extension: its methods
are mixed into the worker class and run with `self.model_runner`) calls
`model_runner.reload_weights(weights_iterator=...)`, vLLM's in-place reload: the model's own
`load_weights` (QKV / gate-up stacking, tied heads) followed by the platform's weight
post-processing (e.g. the CPU repacking), so the result equals a fresh load of the same
checkpoint. The caller must reset the prefix cache afterwards (cached KV blocks were
computed with the old weights).

Room for the `shm` file. tmpfs allocates a page when it is first touched, and a touch past
the file system's size is a SIGBUS: the learner died with no message when /dev/shm was
smaller than the weights (docker's default is 64 MB). `pack_file` therefore checks the room
first (`statvfs`; a reused file's own pages count as room) and allocates the whole file before
mapping it (`posix_fallocate`, which fails with ENOSPC instead of a signal); either failure is
a `DiskWriteError` naming the path, the bytes needed and free, and the fixes (a bigger
/dev/shm, `VLLMEngineConfig.shm_dir`, or `weight_transport="bytes"`). So is a directory
where the file cannot be created (read-only, not writable).

This module must import in a vLLM worker process: numpy / torch only, never JAX (the
safetensors header code it shares with the loader, models/safetensors_io.py, imports none;
posttrain_jax.errors is stdlib only).
"""
from __future__ import annotations

import errno
import mmap
import os
import warnings
from typing import Iterable, Optional

import numpy as np

from posttrain_jax.errors import DiskWriteError, disk_cause, disk_errno, format_bytes
from posttrain_jax.models.safetensors_io import encode_header, read_header

# safetensors dtype codes <-> numpy / torch dtype names.
_CODES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64",
          "int64": "I64", "int32": "I32", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
_TORCH = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64",
          "I64": "int64", "I32": "int32", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def _np_dtype(name: str) -> np.dtype:
  if name == "bfloat16":
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16)
  return np.dtype(name)


def pack_layout(pairs: Iterable[tuple[str, np.ndarray]], dtype: Optional[str] = None):
  """(header bytes, [(name, array, offset, out dtype)], total bytes) of a safetensors buffer.

  `dtype` ("float32" | "bfloat16" | "float16") casts floating tensors; None keeps each one's.
  """
  header, items, offset = {}, [], 0
  for name, arr in pairs:
    arr = np.asarray(arr)
    out = arr.dtype if dtype is None or arr.dtype.kind not in "fV" else _np_dtype(dtype)
    code = _CODES.get(out.name)
    if code is None:
      raise TypeError(f"tensor {name!r}: dtype {arr.dtype} cannot be sent to vLLM")
    nbytes = int(np.prod(arr.shape, dtype=np.int64)) * out.itemsize
    header[name] = {"dtype": code, "shape": list(arr.shape),
                    "data_offsets": [offset, offset + nbytes]}
    items.append((name, arr, offset, out))
    offset += nbytes
  return encode_header(header), items, offset


# Pre-fault the whole mapping in one call: page by page faults made copies 4x slower.
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
_BLOCK = 32  # rows per tile of a transposing copy (measured best of 16..256)


def _copy(dst: np.ndarray, src: np.ndarray) -> None:
  """dst[...] = src with a dtype cast; a transposed 2-D view is copied in row tiles.

  `np.copyto(dst, w.T)` walks `w` column-wise (0.4-0.6 GB/s here); copying `_BLOCK` source
  rows at a time keeps both sides in cache (4-5 GB/s).
  """
  if src.ndim == 2 and not src.flags.c_contiguous and src.T.flags.c_contiguous:
    w = src.T
    for r in range(0, w.shape[0], _BLOCK):
      np.copyto(dst[:, r:r + _BLOCK], w[r:r + _BLOCK].T, casting="unsafe")
  else:
    np.copyto(dst, src, casting="unsafe")


def pack_into(buf, header: bytes, items) -> None:
  """Writes the header and every array into `buf` (a writable buffer of the total size)."""
  raw = np.frombuffer(buf, dtype=np.uint8)
  raw[:len(header)] = np.frombuffer(header, np.uint8)
  start = len(header)
  for _, arr, offset, out in items:
    n = arr.size * out.itemsize
    _copy(raw[start + offset:start + offset + n].view(out).reshape(arr.shape), arr)


def pack_bytes(pairs, dtype: Optional[str] = None) -> bytearray:
  header, items, total = pack_layout(pairs, dtype)
  buf = bytearray(len(header) + total)
  pack_into(buf, header, items)
  return buf


def pack_file(path: str, pairs, dtype: Optional[str] = None) -> int:
  """Writes the buffer to `path` through a shared mapping (no intermediate copy); its size.

  An existing file is overwritten in place: on tmpfs its pages stay allocated (a fresh file
  pays for allocating and zeroing them on every update). The file is allocated in full
  before it is mapped, so a file system without room raises `DiskWriteError` (module
  docstring) instead of killing the process with SIGBUS; a file this call created is then
  removed.
  """
  header, items, total = pack_layout(pairs, dtype)
  size = len(header) + total
  existed = os.path.exists(path)
  try:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
  except OSError as e:
    code = disk_errno(e)
    if code is None:
      raise
    raise DiskWriteError(f"weight-sync buffer {path}: cannot create it: {disk_cause(code)}; "
                         + _FIXES, code) from e
  try:
    try:
      _allocate(fd, path, size)
      with mmap.mmap(fd, size, flags=_MAP_FLAGS) as m:
        pack_into(m, header, items)
        del items
    except BaseException:
      if not existed:
        os.unlink(path)
      raise
  finally:
    os.close(fd)
  return size


def _allocate(fd: int, path: str, size: int) -> None:
  """Makes the open file `path` exactly `size` bytes, every page allocated, or raises
  `DiskWriteError` (the room is checked first: statvfs's free bytes + the file's own)."""
  if os.fstat(fd).st_size > size:
    os.ftruncate(fd, size)  # a smaller update than the last: give the tail back first
  held = os.fstat(fd).st_blocks * 512
  vfs = os.fstatvfs(fd)
  free = vfs.f_bavail * vfs.f_frsize
  if size > held + free:
    raise _no_room(path, size, held, free, vfs.f_blocks * vfs.f_frsize)
  if not hasattr(os, "posix_fallocate"):  # not Linux: the check above is all we can do
    os.ftruncate(fd, size)
    return
  try:
    os.posix_fallocate(fd, 0, size)
  except OSError as e:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):  # the room went to someone else meanwhile
      free = os.fstatvfs(fd).f_bavail * vfs.f_frsize
      raise _no_room(path, size, os.fstat(fd).st_blocks * 512, free,
                     vfs.f_blocks * vfs.f_frsize) from e
    if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
      code = disk_errno(e)
      if code is None:
        raise
      raise DiskWriteError(f"weight-sync buffer {path}: cannot allocate {format_bytes(size)}: "
                           f"{disk_cause(code)}; " + _FIXES, code) from e
    os.ftruncate(fd, size)  # a file system without fallocate: the room was checked above


def _no_room(path: str, size: int, held: int, free: int, capacity: int) -> DiskWriteError:
  d = os.path.dirname(os.path.abspath(path))
  mine = f" + {format_bytes(held)} this buffer already holds" if held else ""
  return DiskWriteError(
      f"weight-sync buffer {path}: needs {format_bytes(size)}, but {d} (a file system of "
      f"{format_bytes(capacity)}) has {format_bytes(free)} free{mine}. Give it room (docker run "
      f"--shm-size=<more than {format_bytes(size)}>; Kubernetes: an emptyDir with medium: "
      f"Memory on /dev/shm), or {_FIXES}", errno.ENOSPC)


_FIXES = ("point VLLMEngineConfig.shm_dir (config.rl.engine_config.shm_dir) at a writable "
          "RAM-backed directory with room, or set weight_transport='bytes' (no file; slower)")


def unpack_torch(buf):
  """[(name, torch tensor)] viewing `buf` (zero-copy; the tensors keep `buf` alive)."""
  import torch
  raw = memoryview(buf)
  header = read_header(raw, name="weight buffer")
  start = header.data_start
  out = []
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # read-only buffers: vLLM only reads them
    for name, info in header.tensors.items():
      begin, end = info["data_offsets"]
      dtype = getattr(torch, _TORCH[info["dtype"]])
      t = torch.frombuffer(raw, dtype=torch.uint8, count=end - begin, offset=start + begin)
      out.append((name, t.view(dtype).view(info["shape"])))
  return out


class WeightReceiver:
  """vLLM worker extension (`LLM(worker_extension_cls=<this class's qualified name>)`)."""

  def ptj_reload_weights(self, payload: Optional[bytes] = None, path: Optional[str] = None,
                         version: Optional[int] = None) -> int:
    """Loads weights in place from safetensors bytes, or from a path: one .safetensors file
    (mapped) or a HF model directory (its *.safetensors files). Returns #tensors loaded.
    `version`: the policy version these weights are, kept for `ptj_version` (the server's own
    record: a restarted server answers None, i.e. its start weights, whatever a client thinks)."""
    if (payload is None) == (path is None):
      raise ValueError("ptj_reload_weights takes exactly one of payload / path")
    if payload is not None:
      buffers = [payload]
    else:
      files = ([path] if os.path.isfile(path) else sorted(
          os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors")))
      if not files:
        raise FileNotFoundError(f"{path}: no .safetensors file")
      buffers = []
      for f in files:
        with open(f, "rb") as fh:
          buffers.append(mmap.mmap(fh.fileno(), 0, flags=_MAP_FLAGS, prot=mmap.PROT_READ))
    tensors = [t for buf in buffers for t in unpack_torch(buf)]
    del buffers
    model = self.model_runner.get_model()
    try:
      self.model_runner.reload_weights(weights_iterator=iter(tensors))
    except BaseException:
      _abandon_layerwise_reload(model)
      raise
    n = len(tensors)
    del tensors
    _refresh_tied_head(model)
    self._ptj_version = version
    return n

  def ptj_version(self) -> Optional[int]:
    """The version of the last successful `ptj_reload_weights`; None = the start weights."""
    return getattr(self, "_ptj_version", None)

  def ptj_refresh_tied_head(self) -> bool:
    """Re-packs a tied LM head after vLLM's own `reload_weights` (see _refresh_tied_head)."""
    return _refresh_tied_head(self.model_runner.get_model())


def _abandon_layerwise_reload(model) -> None:
  """After a failed reload: put back every layer vLLM had not finished, so the next works.

  vLLM's reload swaps each layer's tensors for placeholders and buffers incoming weights
  until the layer is complete; an exception midway leaves that state behind and every later
  reload fails the same way. Layers already processed keep their new weights.
  """
  try:
    from vllm.model_executor.model_loader.reload import layerwise as lw
  except ImportError:  # another vLLM version: nothing we know how to undo
    return
  for layer in model.modules():
    info = lw.LAYERWISE_INFO.get(layer)
    if info is None or not info.can_load():
      continue
    if info.kernel_tensors is not None:
      lw._place_kernel_tensors(layer, info)
    info.reset()
  if hasattr(model, "_original_do_torchao_reload"):
    model._do_torchao_reload = model._original_do_torchao_reload


def _refresh_tied_head(model) -> bool:
  """Re-derives a tied LM head's kernel data from the (reloaded) embedding.

  With tied embeddings, vLLM's `lm_head` shares the embedding's storage, but on CPU its
  forward uses a packed copy (oneDNN) made when the model was loaded. The checkpoint has no
  `lm_head.weight`, so `reload_weights` never re-processes the head and the logits would
  keep coming from the OLD embedding (measured: up to 1.3 logits off). Re-running the head's
  post-load processing re-packs it; on GPU the processing is a no-op.
  """
  head = getattr(model, "lm_head", None)
  w = getattr(head, "weight", None)
  if w is None or w.numel() == 0:
    return False
  tied = any(p.data_ptr() == w.data_ptr() for m in model.modules() if m is not head
             for p in m.parameters(recurse=False))
  if not tied:
    return False
  method = getattr(head, "quant_method", None)
  if method is None or not hasattr(method, "process_weights_after_loading"):
    return False
  method.process_weights_after_loading(head)
  return True
