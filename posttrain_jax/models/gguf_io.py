"""GGUF in, HF directory out: a llama.cpp model file becomes a normal HF model directory.

`gguf_to_hf(file, out)` writes config.json, model.safetensors (float32), the tokenizer and its
chat template (from the file's metadata) and generation_config.json; transformers and vLLM load
the result like any HF checkpoint. `resolve_model_path(path)` is what every model path of a
config goes through: a directory is returned as it is, a `.gguf` file is converted once into a
cache directory (`$PTJ_CACHE_DIR/gguf/`, default `~/.cache/posttrain_jax/gguf/`) keyed by the
file's absolute path, size and mtime, and that directory is returned.

Weights. Each tensor is dequantised by the `gguf` package (llama.cpp's own reference code in
Python): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants, F16, BF16, F32. A block of Q4_1, for
example, holds 32 weights as 4-bit q with a float16 scale d and minimum m: w = d * q + m.
Dequantised values are exact in float32, so they are stored in float32 (no second rounding).
A type the package cannot dequantise is one `GGUFError` naming the tensor and the type.

llama.cpp's converter permutes the rows of Q and K of a "llama" model: its rotary embedding
rotates neighbouring rows as pairs, HF's the two halves of each head. With h heads of d rows,
GGUF's matrix is HF's viewed as [h, 2, d/2, in] with axes 1 and 2 swapped; `_unpermute` views
it as [h, d/2, 2, in] and swaps them back.

Tokenizer. transformers builds a fast tokenizer from the GGUF vocabulary, merges and special
ids (`gguf_file=`); the chat template is the file's `tokenizer.chat_template`.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
from typing import Iterator, Optional

import numpy as np

from posttrain_jax.errors import UserError
from posttrain_jax.models.fsutil import atomic_directory
from posttrain_jax.models.safetensors_io import write_safetensors

SUPPORTED_ARCHITECTURES = ("llama",)

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class GGUFError(UserError, ValueError):
  """A GGUF file we cannot convert; the message names the file and the tensor or key."""


def is_gguf(path: os.PathLike) -> bool:
  p = pathlib.Path(path)
  return p.suffix.lower() == ".gguf" and p.is_file()


def _reader(path: pathlib.Path):
  try:
    from gguf import GGUFReader
  except ImportError:
    raise GGUFError(f"{path}: reading a GGUF file needs the `gguf` package "
                    "(pip install 'posttrain_jax[gguf]' or pip install gguf)") from None
  if not path.is_file():
    raise GGUFError(f"GGUF file {path} does not exist")
  try:
    return GGUFReader(str(path))
  except Exception as e:  # a truncated or foreign file: the reader's own words
    raise GGUFError(f"{path}: not a GGUF file we can read ({type(e).__name__}: {e})") from None


def _field(reader, key: str, path: pathlib.Path, default=None, required: bool = False):
  field = reader.fields.get(key)
  if field is None:
    if required:
      raise GGUFError(f"{path}: metadata key {key!r} is missing")
    return default
  return field.contents()


def hf_config(reader, path: pathlib.Path) -> dict:
  """The HF config.json dict of the model in `reader` (llama architecture)."""
  arch = _field(reader, "general.architecture", path, required=True)
  if arch not in SUPPORTED_ARCHITECTURES:
    raise GGUFError(f"{path}: general.architecture={arch!r}; supported: "
                    f"{', '.join(SUPPORTED_ARCHITECTURES)}")
  names = {t.name for t in reader.tensors}
  if "rope_freqs.weight" in names or _field(reader, f"{arch}.rope.scaling.type", path):
    raise GGUFError(f"{path}: rope scaling (rope_freqs / {arch}.rope.scaling.*) is not "
                    "supported by this converter")

  def key(k, **kw):
    return _field(reader, f"{arch}.{k}", path, **kw)

  hidden = int(key("embedding_length", required=True))
  heads = int(key("attention.head_count", required=True))
  vocab = _field(reader, "tokenizer.ggml.tokens", path, required=True)
  eos = _field(reader, "tokenizer.ggml.eos_token_id", path)
  return {
      "architectures": ["LlamaForCausalLM"],
      "model_type": "llama",
      "hidden_act": "silu",
      "hidden_size": hidden,
      "intermediate_size": int(key("feed_forward_length", required=True)),
      "num_hidden_layers": int(key("block_count", required=True)),
      "num_attention_heads": heads,
      "num_key_value_heads": int(key("attention.head_count_kv", default=heads)),
      "head_dim": int(key("rope.dimension_count", default=hidden // heads)),
      "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", default=1e-5)),
      "rope_theta": float(key("rope.freq_base", default=10000.0)),
      "max_position_embeddings": int(key("context_length", default=4096)),
      "vocab_size": int(key("vocab_size", default=len(vocab))),
      "tie_word_embeddings": "output.weight" not in names,
      "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id", path),
      "eos_token_id": eos,
      "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id", path),
      "torch_dtype": "float32",
  }


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
  """GGUF's rotary row order back to HF's (module docstring)."""
  d = w.shape[0] // heads
  return w.reshape(heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(name: str, path: pathlib.Path) -> str:
  if name in _TOP_NAMES:
    return _TOP_NAMES[name]
  parts = name.split(".")
  if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
    return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
  raise GGUFError(f"{path}: tensor {name!r} has no place in a llama model")


def hf_tensors(reader, cfg: dict, path: pathlib.Path) -> Iterator[tuple[str, np.ndarray]]:
  """(HF name, float32 array) for each tensor of `reader`, dequantised, Q/K un-permuted."""
  from gguf.quants import dequantize
  for t in reader.tensors:
    name = _hf_name(t.name, path)
    try:
      w = dequantize(t.data, t.tensor_type)
    except NotImplementedError:
      raise GGUFError(f"{path}: tensor {t.name!r} is quantised as {t.tensor_type.name}, which "
                      "the gguf package cannot dequantise") from None
    w = np.ascontiguousarray(w, dtype=np.float32)
    if name.endswith("q_proj.weight"):
      w = _unpermute(w, cfg["num_attention_heads"])
    elif name.endswith("k_proj.weight"):
      w = _unpermute(w, cfg["num_key_value_heads"])
    yield name, w


def _write_tokenizer(path: pathlib.Path, out: pathlib.Path) -> None:
  from transformers import AutoTokenizer
  try:
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
  except Exception as e:
    raise GGUFError(f"{path}: transformers could not build its tokenizer "
                    f"({type(e).__name__}: {e})") from None
  tok.save_pretrained(str(out))


def gguf_to_hf(path: os.PathLike, out_dir: os.PathLike) -> pathlib.Path:
  """Converts the GGUF file `path` into the HF directory `out_dir` (module docstring); the
  directory appears whole or not at all."""
  path, out_dir = pathlib.Path(path), pathlib.Path(out_dir)
  reader = _reader(path)
  cfg = hf_config(reader, path)
  with atomic_directory(out_dir) as tmp:
    write_safetensors(tmp / "model.safetensors", hf_tensors(reader, cfg, path))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
           if cfg[k] is not None}
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
    _write_tokenizer(path, tmp)
    (tmp / "SOURCE").write_text(f"converted from {path.resolve()} by posttrain_jax\n")
  return out_dir


def cache_dir() -> pathlib.Path:
  root = os.environ.get("PTJ_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                          "posttrain_jax")
  return pathlib.Path(root) / "gguf"


def resolve_model_path(path: os.PathLike, cache: Optional[os.PathLike] = None) -> pathlib.Path:
  """A HF model directory for `path`: the directory itself, or a `.gguf` file's conversion
  (made once, kept in the cache; a changed file gets a new one)."""
  p = pathlib.Path(path)
  if not is_gguf(p):
    return p
  st = p.stat()
  key = hashlib.sha256(f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
  out = pathlib.Path(cache or cache_dir()) / f"{p.stem}-{key}"
  if not (out / "config.json").exists():
    if out.exists():  # a directory without config.json is not ours to trust
      shutil.rmtree(out)
    gguf_to_hf(p, out)
  return out


__all__ = ["gguf_to_hf", "resolve_model_path", "is_gguf", "hf_config", "GGUFError",
           "SUPPORTED_ARCHITECTURES"]
