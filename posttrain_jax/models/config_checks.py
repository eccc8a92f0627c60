"""The types and ranges of the `config.json` fields `config.from_hf_dict` reads, checked first.

A config.json is input from outside: a hand edit, a truncated download, a hostile file. Before
any field is used, each one we read is checked here, so a wrong value is one `ConfigError`
naming the file and the key (`config.json: num_attention_heads=0 must be a positive integer`),
never a KeyError / TypeError / ZeroDivisionError from deep inside, nor a model that builds with
a size of zero. Sizes must be positive and below 2**31 (every size of a real model is far below
it; above it, index arithmetic in int32 would wrap). Nothing is allocated here.
"""
from __future__ import annotations

import math
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_LIMIT = 1 << 31
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "max_position_embeddings")      # a positive int if present
_OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "sliding_window", "max_window_layers")
_BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window")
_DICTS = ("rope_scaling", "rope_parameters")


def _is_int(v: Any) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _token_id(v: Any) -> bool:
  return _is_int(v) and 0 <= v < _LIMIT


def check_hf_fields(hf: Any, path: str, error: type) -> None:
  """Raises `error` (ConfigError) naming `path` and the first field of `hf` we cannot read."""
  if not isinstance(hf, dict):
    raise error(f"{path}: must hold a JSON object, got {type(hf).__name__}")

  def bad(key: str, what: str, value: Any = None):
    value = hf.get(key) if value is None else value
    raise error(f"{path}: {key}={value!r:.80} {what}")

  for key in _SIZES:
    if key in hf and not (_is_int(hf[key]) and 0 < hf[key] < _LIMIT):
      bad(key, "must be a positive integer below 2**31")
  for key in _OPTIONAL_SIZES:
    v = hf.get(key)
    if v is not None and not (_is_int(v) and 0 <= v < _LIMIT and (v or key == "max_window_layers")):
      bad(key, "must be a positive integer below 2**31 or null")
  for key in _BOOLS:
    if hf.get(key) is not None and not isinstance(hf[key], bool):
      bad(key, "must be true or false")
  for key in _DICTS:
    if hf.get(key) is not None and not isinstance(hf[key], dict):
      bad(key, "must be an object or null")
  arch = hf.get("architectures")
  if arch is not None and not (isinstance(arch, list) and all(isinstance(a, str) for a in arch)):
    bad("architectures", "must be a list of strings")
  if hf.get("model_type") is not None and not isinstance(hf["model_type"], str):
    bad("model_type", "must be a string")
  if "hidden_act" in hf and not isinstance(hf["hidden_act"], str):
    bad("hidden_act", "must be a string")
  layer_types = hf.get("layer_types")
  if layer_types is not None and not isinstance(layer_types, list):
    bad("layer_types", "must be a list of strings or null")
  if "rms_norm_eps" in hf and not (_is_num(hf["rms_norm_eps"]) and hf["rms_norm_eps"] > 0):
    bad("rms_norm_eps", "must be a positive number")
  for key in ("bos_token_id", "pad_token_id"):
    if hf.get(key) is not None and not _token_id(hf[key]):
      bad(key, "must be a non-negative integer or null")
  eos = hf.get("eos_token_id")
  if eos is not None and not (_token_id(eos) or (isinstance(eos, list) and
                                                  all(_token_id(e) for e in eos))):
    bad("eos_token_id", "must be a non-negative integer, a list of them, or null")
  _check_shapes(hf, bad)
  _check_rope(hf, path, error)


def _check_shapes(hf: dict, bad) -> None:
  """Heads divide evenly and each head's width is even (RoPE rotates pairs)."""
  heads, hidden = hf.get("num_attention_heads"), hf.get("hidden_size")
  kv = hf.get("num_key_value_heads")
  if heads and kv and heads % kv:
    bad("num_key_value_heads", f"must divide num_attention_heads={heads}")
  head_dim = hf.get("head_dim")
  if head_dim is None and heads and hidden:
    if hidden < heads:
      bad("hidden_size", f"is below num_attention_heads={heads}: no head_dim "
          "(hidden_size // num_attention_heads) to derive; set head_dim")
    head_dim = hidden // heads
  if head_dim and head_dim % 2:
    bad("head_dim", "must be even (RoPE rotates pairs of dimensions)", head_dim)


def _check_rope(hf: dict, path: str, error: type) -> None:
  """RoPE's theta and the scaling parameters rope.py reads, as config.py merges them."""
  params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
  theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
  if not (_is_num(theta) and theta > 0):
    raise error(f"{path}: rope_theta={theta!r:.80} must be a positive number")
  kind = params.get("rope_type", params.get("type", "default"))
  if kind not in SUPPORTED_ROPE_TYPES:
    raise error(f"{path}: rope_type {kind!r:.80} is not supported; supported: "
                f"{list(SUPPORTED_ROPE_TYPES)}")
  need = {"linear": ("factor",),
          "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                     "original_max_position_embeddings")}.get(kind, ())
  for key in need:
    v = params.get(key)
    if not (_is_num(v) and v > 0):
      raise error(f"{path}: rope_scaling.{key}={v!r:.80} must be a positive number "
                  f"(rope_type {kind!r})")
  if kind == "llama3" and not params["high_freq_factor"] > params["low_freq_factor"]:
    raise error(f"{path}: rope_scaling.high_freq_factor={params['high_freq_factor']!r} must "
                f"exceed low_freq_factor={params['low_freq_factor']!r}")
