"""`ModelConfig`: one config for the decoder families we support, read from HF `config.json`.

The families we serve (Llama 3.x, Qwen2.5, Qwen3 dense, ...) differ only in a few switches
(biases, q/k RMSNorm), so one decoder (`decoder.py`) serves all of them. This file reads the fields they
share; what a family reads or writes differently (which biases, q/k norm) lives in its own
file in `families/`, which also says what the family is.

Attention is full causal attention (with GQA and RoPE). A `config.json` asking for anything
else -- sliding windows, partial rotary dims, logit soft-capping, unknown RoPE scalings -- is
refused with a ConfigError naming the field, never loaded as something it is not.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional

import jax.numpy as jnp

from posttrain_jax.errors import UserError
from posttrain_jax.models import families
from posttrain_jax.models.config_checks import SUPPORTED_ROPE_TYPES, check_hf_fields

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class ConfigError(UserError, ValueError):
  """A HF config we cannot serve; the message names the field."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture and numerics of a decoder-only transformer."""
  family: str                     # a registered family name (models/families/), e.g. "qwen3"
  vocab_size: int                 # rows of the embedding / columns of the LM head
  hidden_size: int                # model width D
  intermediate_size: int          # SwiGLU inner width F
  num_layers: int                 # decoder blocks
  num_heads: int                  # query heads H
  num_kv_heads: int               # key/value heads (GQA: H % num_kv_heads == 0)
  head_dim: int                   # per-head width
  rms_norm_eps: float = 1e-6      # epsilon inside every RMSNorm
  rope_theta: float = 10000.0     # RoPE base
  rope_scaling: tuple[tuple[str, Any], ...] = ()  # frozen HF rope parameters beyond theta
  qkv_bias: bool = False          # bias on q/k/v projections
  o_bias: bool = False            # bias on the output projection
  mlp_bias: bool = False          # bias on gate/up/down projections
  qk_norm: bool = False           # RMSNorm over head_dim on q and k before RoPE (Qwen3)
  tie_word_embeddings: bool = False  # LM head = embedding^T
  max_position_embeddings: int = 4096  # longest context the RoPE tables are built for
  bos_token_id: Optional[int] = None
  eos_token_id: Any = None        # int or tuple of ints (HF lists become tuples: hashable)
  pad_token_id: Optional[int] = None
  param_dtype: str = "float32"    # storage dtype of parameters
  compute_dtype: str = "float32"  # dtype of matmuls/activations; norms and softmax stay fp32
  remat: bool = False             # recompute each block's activations in the backward pass

  def __post_init__(self):
    if isinstance(self.eos_token_id, list):
      object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
    if self.family not in families.FAMILIES:
      raise ConfigError(f"family={self.family!r} is not a registered model family; registered: "
                        f"{', '.join(families.names())}")
    if self.num_heads % self.num_kv_heads:
      raise ConfigError(f"num_attention_heads={self.num_heads} is not a multiple of "
                        f"num_key_value_heads={self.num_kv_heads}")
    for f in ("param_dtype", "compute_dtype"):
      if getattr(self, f) not in _DTYPES:
        raise ConfigError(f"{f}={getattr(self, f)!r}; valid: {sorted(_DTYPES)}")
    rope_type = dict(self.rope_scaling).get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
      raise ConfigError(f"rope_type {rope_type!r} is not supported; supported: "
                        f"{list(SUPPORTED_ROPE_TYPES)}")

  @property
  def param_jnp_dtype(self):
    return _DTYPES[self.param_dtype]

  @property
  def compute_jnp_dtype(self):
    return _DTYPES[self.compute_dtype]

  @property
  def architecture(self) -> str:
    return families.get(self.family).architectures[0]

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)

  def num_params(self) -> int:
    d, f, h, kv, hd = (self.hidden_size, self.intermediate_size, self.num_heads,
                       self.num_kv_heads, self.head_dim)
    attn = d * h * hd * 2 + d * kv * hd * 2
    attn += (h * hd + 2 * kv * hd) * self.qkv_bias + d * self.o_bias + 2 * hd * self.qk_norm
    mlp = 3 * d * f + (2 * f + d) * self.mlp_bias
    per_layer = attn + mlp + 2 * d
    head = 0 if self.tie_word_embeddings else d * self.vocab_size
    return self.vocab_size * d + self.num_layers * per_layer + d + head


def _require(hf: dict, key: str, path: str):
  if key not in hf:
    raise ConfigError(f"{path}: required field {key!r} is missing")
  return hf[key]


def _rope(hf: dict) -> tuple[float, tuple[tuple[str, Any], ...]]:
  """Reads RoPE from the v5 `rope_parameters` dict or the older `rope_theta`/`rope_scaling`."""
  params = dict(hf.get("rope_parameters") or {})
  scaling = dict(hf.get("rope_scaling") or {})
  theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
  params.update({k: v for k, v in scaling.items() if k not in params})
  if "type" in params and "rope_type" not in params:
    params["rope_type"] = params.pop("type")
  params.setdefault("rope_type", "default")
  return float(theta), tuple(sorted((k, _frozen(v)) for k, v in params.items()))


def _frozen(value: Any) -> Any:
  """JSON lists / objects as tuples, so that the config stays hashable (a jit static)."""
  if isinstance(value, list):
    return tuple(_frozen(v) for v in value)
  if isinstance(value, dict):
    return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
  return value


# config.json fields that change attention in ways the decoder does not implement, with the
# values that mean "off".
_ATTENTION_OFF = {
    "partial_rotary_factor": (None, 1, 1.0),   # RoPE on only part of head_dim
    "attn_logit_softcapping": (None,),         # tanh soft-capping of attention logits
    "final_logit_softcapping": (None,),        # tanh soft-capping of the LM head's logits
    "attention_chunk_size": (None,),           # chunked local attention (Llama 4)
}


def _sliding_window(hf: dict) -> Optional[str]:
  """What in `hf` turns sliding-window attention on (`field=value`), or None when it is off.

  Qwen2/3 carry `sliding_window` with a `use_sliding_window` switch (false in released
  checkpoints), which enables the window from layer `max_window_layers` on; a config without
  the switch (Mistral style) has a window whenever `sliding_window` is set.
  """
  window = hf.get("sliding_window")
  if window is None:
    return None
  if "use_sliding_window" not in hf:
    return f"sliding_window={window}"
  first = hf.get("max_window_layers") or 0
  if hf["use_sliding_window"] and first < hf.get("num_hidden_layers", 0):
    return f"use_sliding_window=true with sliding_window={window}, max_window_layers={first}"
  return None


def _refuse_unimplemented_attention(hf: dict, path: str) -> None:
  """A ConfigError naming the first field that asks for more than full causal attention."""
  layer_types = hf.get("layer_types")
  if layer_types is not None:  # per-layer kinds (transformers writes them) decide
    for i, kind in enumerate(layer_types):
      if kind != "full_attention":
        raise ConfigError(f"{path}: layer_types[{i}]={kind!r} is not supported (full attention "
                          "only): every entry must be 'full_attention'")
  else:
    sliding = _sliding_window(hf)
    if sliding is not None:
      raise ConfigError(f"{path}: {sliding}: sliding-window attention is not supported (full "
                        "attention only); if the model was trained with full attention, set "
                        "sliding_window to null")
  rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
  fields = [(f, hf.get(f), off) for f, off in _ATTENTION_OFF.items()]
  fields.append(("rope_parameters.partial_rotary_factor", rope.get("partial_rotary_factor"),
                 _ATTENTION_OFF["partial_rotary_factor"]))
  for field, value, off in fields:
    if value not in off:
      raise ConfigError(f"{path}: {field}={value!r} is not supported (the decoder implements "
                        f"plain causal attention only); remove it or set it to "
                        f"{json.dumps(off[-1])}")


def from_hf_dict(hf: dict, path: str = "config.json", **overrides) -> ModelConfig:
  """Translates a HF `config.json` dict into a ModelConfig (overrides: dtypes, remat)."""
  check_hf_fields(hf, path, ConfigError)
  family = families.for_hf(hf)
  if family is None:
    raise ConfigError(
        f"{path}: unsupported architecture (architectures={hf.get('architectures')!r:.80}, "
        f"model_type={hf.get('model_type')!r:.40}); supported: "
        f"{', '.join(families.architectures())}")
  _refuse_unimplemented_attention(hf, path)
  if hf.get("hidden_act", "silu") != "silu":
    raise ConfigError(f"{path}: hidden_act={hf['hidden_act']!r}; only 'silu' (SwiGLU) is supported")
  heads = _require(hf, "num_attention_heads", path)
  hidden = _require(hf, "hidden_size", path)
  theta, scaling = _rope(hf)
  kw = dict(
      family=family.name,
      vocab_size=_require(hf, "vocab_size", path),
      hidden_size=hidden,
      intermediate_size=_require(hf, "intermediate_size", path),
      num_layers=_require(hf, "num_hidden_layers", path),
      num_heads=heads,
      num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or hidden // heads,
      rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
      rope_theta=theta,
      rope_scaling=scaling,
      tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
      max_position_embeddings=hf.get("max_position_embeddings", 4096),
      bos_token_id=hf.get("bos_token_id"),
      eos_token_id=hf.get("eos_token_id"),
      pad_token_id=hf.get("pad_token_id"),
  )
  kw.update(family.from_hf(hf))
  kw.update(overrides)
  return ModelConfig(**kw)


def to_hf_dict(cfg: ModelConfig) -> dict:
  """The HF `config.json` for `cfg` (loadable by transformers and vLLM)."""
  rope = {"rope_type": "default", "rope_theta": cfg.rope_theta, **dict(cfg.rope_scaling)}
  hf = {
      "architectures": [cfg.architecture],
      "model_type": cfg.family,
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.hidden_size,
      "intermediate_size": cfg.intermediate_size,
      "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim,
      "hidden_act": "silu",
      "rms_norm_eps": cfg.rms_norm_eps,
      "rope_theta": cfg.rope_theta,
      "rope_parameters": rope,
      "tie_word_embeddings": cfg.tie_word_embeddings,
      "max_position_embeddings": cfg.max_position_embeddings,
      "bos_token_id": cfg.bos_token_id,
      "eos_token_id": (list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple)
                       else cfg.eos_token_id),
      "pad_token_id": cfg.pad_token_id,
      "torch_dtype": cfg.param_dtype,
      "dtype": cfg.param_dtype,
      "use_cache": True,
  }
  if dict(cfg.rope_scaling).get("rope_type", "default") != "default":
    hf["rope_scaling"] = rope
  hf.update(families.get(cfg.family).to_hf(cfg))
  return hf
