"""HF checkpoints in and out: `config.json` + `*.safetensors` (+ tokenizer files).

Loading never builds an unsharded copy of the model: the model is created abstractly
(`nnx.eval_shape`), and each parameter is filled by `jax.make_array_from_callback`, which asks
for exactly the slice each local device holds, read from a memory-mapped tensor.

Names: our parameter path `layers.3.self_attn.q_proj.kernel` is HF's
`model.layers.3.self_attn.q_proj.weight` transposed; `scale` -> `weight`;
`embed_tokens` -> `model.embed_tokens.weight`; `lm_head.kernel` -> `lm_head.weight`^T.

A model with LoRA adapters (models/lora.py) is exported merged (W + s·A·B): the HF directory
is a plain model; peft_io.py writes the adapters alone.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import pathlib
import shutil
from typing import Iterator, Optional

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from posttrain_jax import sharding as shd
from posttrain_jax.errors import PathNotFoundError, UserError
from posttrain_jax.models.config import ConfigError, ModelConfig, from_hf_dict, to_hf_dict
from posttrain_jax.models.decoder import Decoder
from posttrain_jax.models.fsutil import atomic_directory
from posttrain_jax.models.gguf_io import resolve_model_path
from posttrain_jax.models.lora import merged
from posttrain_jax.models.safetensors_io import Checkpoint, SafetensorsError, write_safetensors

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json", "vocab.json", "merges.txt")


class CheckpointError(UserError, ValueError):
  """A checkpoint that does not match its config; the message names the tensor and file."""


def _check_model_dir(path: pathlib.Path) -> None:
  if not path.exists():
    raise PathNotFoundError(f"model directory {path} does not exist")
  if not path.is_dir():
    raise PathNotFoundError(f"model directory {path} is a file, not a directory")


def read_model_config(path: os.PathLike, **overrides) -> ModelConfig:
  """Reads `<path>/config.json` into a ModelConfig (overrides: dtypes, remat); `path` may be
  a `.gguf` file (models/gguf_io.py converts it once)."""
  path = resolve_model_path(path)
  _check_model_dir(path)
  cfg_path = path / "config.json"
  if not cfg_path.exists():
    raise PathNotFoundError(f"{path}: no config.json (is this a HF model directory?)")
  try:
    hf = json.loads(cfg_path.read_bytes().decode("utf-8"))
  except UnicodeDecodeError as e:
    raise ConfigError(f"{cfg_path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
  except json.JSONDecodeError as e:
    raise ConfigError(f"{cfg_path}: not valid JSON ({e})") from None
  except (RecursionError, ValueError) as e:  # nested too deeply; an int of > 4300 digits
    raise ConfigError(f"{cfg_path}: not JSON we read ({str(e).split(';')[0]})") from None
  return from_hf_dict(hf, str(cfg_path), **overrides)


def hf_name(path: tuple) -> tuple[str, bool]:
  """Our parameter path -> (HF tensor name, transpose?)."""
  parts = [str(p) for p in path]
  if parts[0] == "lm_head":
    return "lm_head.weight", True
  leaf = parts[-1]
  if parts == ["embed_tokens"]:
    return "model.embed_tokens.weight", False
  transpose = leaf == "kernel"
  parts[-1] = {"kernel": "weight", "scale": "weight"}.get(leaf, leaf)
  return "model." + ".".join(parts), transpose


def _sharding_of(var, mesh: Optional[Mesh], rules):
  if mesh is None:
    return SingleDeviceSharding(jax.devices()[0])
  axes = var.get_metadata().get("axes") or (None,) * len(var.shape)
  return NamedSharding(mesh, shd.logical_to_spec(axes, rules, mesh, var.shape))


def param_shardings(model: Decoder, mesh: Mesh, rules=shd.DEFAULT_RULES):
  """{path: NamedSharding} for every parameter, from its logical axes."""
  state = nnx.state(model, nnx.Param)
  return {path: _sharding_of(var, mesh, rules) for path, var in nnx.to_flat_state(state)}


def abstract_model(cfg: ModelConfig, mesh: Optional[Mesh] = None, rules=shd.DEFAULT_RULES):
  """The model with ShapeDtypeStruct parameters (no memory allocated)."""
  return nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0), mesh=mesh, rules=rules))


def init_model(cfg: ModelConfig, seed: int = 0, mesh: Optional[Mesh] = None,
               rules=shd.DEFAULT_RULES) -> Decoder:
  """A randomly initialised model, each parameter created directly in its sharding."""
  graphdef, abs_state = nnx.split(abstract_model(cfg, mesh, rules))
  shardings = jax.tree.map(lambda v: _sharding_of(v, mesh, rules), abs_state,
                           is_leaf=lambda x: isinstance(x, nnx.Variable))

  @functools.partial(jax.jit, out_shardings=nnx.to_pure_dict(shardings))
  def make():
    return nnx.to_pure_dict(nnx.state(Decoder(cfg, nnx.Rngs(seed), mesh=mesh, rules=rules)))

  nnx.replace_by_pure_dict(abs_state, make())
  return nnx.merge(graphdef, abs_state)


def load_hf_model(path: os.PathLike, mesh: Optional[Mesh] = None, rules=shd.DEFAULT_RULES,
                  **overrides) -> Decoder:
  """Loads a HF checkpoint directory into a (sharded) Decoder.

  `overrides` replace ModelConfig fields (param_dtype, compute_dtype, remat). `path` may be a
  `.gguf` file (models/gguf_io.py converts it once).
  """
  path = resolve_model_path(path)
  cfg = read_model_config(path, **overrides)
  ckpt = Checkpoint(path)
  graphdef, state = nnx.split(abstract_model(cfg, mesh, rules))
  missing = []
  for ours, var in nnx.to_flat_state(state):
    name, transpose = hf_name(ours)
    if name not in ckpt:
      missing.append(name)
      continue
    src = ckpt.get(name)
    src = src.T if transpose else src
    if tuple(src.shape) != tuple(var.shape):
      want = tuple(reversed(var.shape)) if transpose else tuple(var.shape)
      raise CheckpointError(
          f"tensor {name!r} in {ckpt.file_of(name).path} has shape {tuple(ckpt.get(name).shape)}, "
          f"but config.json implies {want}")
    dtype = var.dtype
    var.set_value(jax.make_array_from_callback(
        var.shape, _sharding_of(var, mesh, rules),
        lambda idx, src=src, dtype=dtype: np.asarray(src[idx]).astype(dtype)))
  if missing:
    shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
    raise CheckpointError(f"{path}: checkpoint is missing tensor(s) {shown}")
  return nnx.merge(graphdef, state)


def _export_dtype(dtype: Optional[str]):
  import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)
  if dtype is None:
    return None
  return np.dtype({"float32": np.float32, "bfloat16": ml_dtypes.bfloat16,
                   "float16": np.float16}[dtype])


def hf_tensors(model: Decoder, dtype: Optional[str] = None) -> Iterator[tuple[str, np.ndarray]]:
  """(HF name, host numpy array) for every parameter, one at a time, in HF layout (LoRA
  adapters merged into their kernels).

  Multi-process: an array that is not fully addressable is all-gathered, one tensor per
  collective, so every process must iterate to the end, in step with the others.
  """
  from jax.experimental import multihost_utils

  model = merged(model)
  np_dtype = _export_dtype(dtype)
  for ours, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    name, transpose = hf_name(ours)
    arr = var[...]
    host = (np.asarray(arr) if arr.is_fully_addressable
            else np.asarray(multihost_utils.process_allgather(arr, tiled=True)))
    host = host.T if transpose else host
    yield name, (host if np_dtype is None else host.astype(np_dtype))


class ExportError(RuntimeError):
  """Process 0 failed to write an export; raised on the other processes (process 0 raises the
  cause itself)."""


def _shard_plan(model: Decoder, dtype: Optional[str],
                max_shard_bytes: int) -> tuple[list[list[str]], int]:
  """HF names grouped into safetensors files of at most `max_shard_bytes` (a tensor larger than
  that gets a file of its own), in `hf_tensors` order, from the shapes alone; and the tensors'
  total bytes."""
  np_dtype = _export_dtype(dtype)
  shards, size, total = [[]], 0, 0
  for ours, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    itemsize = np.dtype(var.dtype if np_dtype is None else np_dtype).itemsize
    nbytes = int(np.prod(var.shape, dtype=np.int64)) * itemsize
    if shards[-1] and size + nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(hf_name(ours)[0])
    size += nbytes
    total += nbytes
  return shards, total


@contextlib.contextmanager
def _naming(fname: str):
  """An OS error without a file name (a failed `write`) gets `fname`, for the message."""
  try:
    yield
  except OSError as e:
    if e.filename is not None or e.errno is None:  # named already, or not the OS's error
      raise
    raise OSError(e.errno, e.strerror, fname) from e


def _write_export(tensors: Iterator[tuple[str, np.ndarray]], plan: list[list[str]], nbytes: int,
                  cfg, out_dir: pathlib.Path, tokenizer_dir: Optional[os.PathLike],
                  chat_template: Optional[str] = None) -> None:
  """Writes the directory from `tensors`, each safetensors file as soon as its last tensor
  arrives (host memory: one file's tensors), all under a temporary name renamed at the end.
  A full or read-only disk: `DiskWriteError` naming the file, the `nbytes` to write and the
  fix (models/fsutil.py); `out_dir` is left as it was."""
  with atomic_directory(out_dir, nbytes) as tmp:
    weight_map, total = {}, 0
    for i, names in enumerate(plan):
      fname = ("model.safetensors" if len(plan) == 1
               else f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors")
      shard = [next(tensors) for _ in names]
      assert [n for n, _ in shard] == names, "hf_tensors and _shard_plan disagree on the order"
      with _naming(fname):
        write_safetensors(tmp / fname, shard)
      weight_map.update({name: fname for name in names})
      total += sum(arr.nbytes for _, arr in shard)
      del shard
    if len(plan) > 1:
      (tmp / "model.safetensors.index.json").write_text(json.dumps(
          {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (tmp / "config.json").write_text(json.dumps(to_hf_dict(cfg), indent=2))
    if tokenizer_dir is not None:
      for fname in TOKENIZER_FILES:
        src = pathlib.Path(tokenizer_dir) / fname
        if src.exists():
          shutil.copy2(src, tmp / fname)
    if chat_template is not None:   # transformers reads it before tokenizer_config.json's
      (tmp / "chat_template.jinja").write_text(chat_template)


def save_hf_model(model: Decoder, out_dir: os.PathLike, *, tokenizer_dir: Optional[os.PathLike] = None,
                  dtype: Optional[str] = None, max_shard_bytes: int = 2 << 30,
                  chat_template: Optional[str] = None) -> pathlib.Path:
  """Exports to a HF directory (config.json, safetensors shards, tokenizer files; a
  `chat_template` given, the run's `model.chat_template`, is written as chat_template.jinja).

  The directory appears atomically: written next to `out_dir` and renamed into place, so a
  crash never leaves a half-written checkpoint. Process 0 holds one safetensors file's
  tensors in host memory at a time (`max_shard_bytes`).

  Multi-process: every process must call it. Every process takes part in gathering the
  sharded parameters; only process 0 writes; every process returns only once `out_dir` is in
  place (a barrier after the write). If process 0 fails to write, nothing is left behind and
  every process raises: process 0 the cause, the others an `ExportError`.
  """
  out_dir = pathlib.Path(out_dir)
  model = merged(model)   # LoRA adapters folded into their kernels (a no-op without)
  cfg = model.cfg if dtype is None else model.cfg.replace(param_dtype=dtype)
  plan, nbytes = _shard_plan(model, dtype, max_shard_bytes)
  tensors = hf_tensors(model, dtype)
  if jax.process_count() == 1:
    _write_export(tensors, plan, nbytes, cfg, out_dir, tokenizer_dir, chat_template)
    return out_dir
  from jax.experimental import multihost_utils
  error = None
  if jax.process_index() == 0:
    try:
      _write_export(tensors, plan, nbytes, cfg, out_dir, tokenizer_dir, chat_template)
    except Exception as e:  # re-raised below, once the others are released
      error = e
  for _ in tensors:  # the others' gathers (and process 0's, after a failed write) need everyone
    pass
  ok = multihost_utils.broadcast_one_to_all(np.int32(error is None))  # the barrier
  if error is not None:
    raise error
  if not int(ok):
    raise ExportError(f"process 0 failed to write {out_dir} (its log has the cause); nothing "
                      "was left behind")
  return out_dir


def load_tokenizer(path: os.PathLike, chat_template: Optional[str] = None,
                   field: str = "model.chat_template"):
  """The tokenizer (with its chat template) stored beside the weights, via transformers; `path`
  may be a `.gguf` file (models/gguf_io.py converts it once). `chat_template` replaces the
  stored template: a chat format's name or a Jinja file (chat_templates.template_override)."""
  from transformers import AutoTokenizer
  from posttrain_jax.models.chat_templates import template_override
  template = template_override(chat_template, field) if chat_template else None
  path = resolve_model_path(path)
  _check_model_dir(path)
  if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
    raise PathNotFoundError(f"{path}: no tokenizer files (tokenizer.json / tokenizer_config.json)")
  tokenizer = AutoTokenizer.from_pretrained(str(path))
  if template is not None:
    tokenizer.chat_template = template
  return tokenizer


__all__ = ["read_model_config", "load_hf_model", "save_hf_model", "hf_tensors", "hf_name",
           "init_model", "abstract_model", "param_shardings", "load_tokenizer",
           "CheckpointError", "ConfigError", "ExportError", "SafetensorsError"]
