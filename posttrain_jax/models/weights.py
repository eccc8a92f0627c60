"""A model turned into the form an engine installs, so that engines need not know model classes.

`Engine.update_weights(weights, version)` takes either a model or weights already in the
engine's own form: the `nnx.Param` state (the embedded JAX sampler) or `(HF name, array)`
pairs (vLLM, OpenAI-compatible servers). A model is any `nnx.Module` of this package, i.e.
one carrying a `ModelConfig` as `cfg` (every family builds one); these helpers convert it
and pass everything else through unchanged.
"""
from __future__ import annotations

from typing import Any, Iterable

from flax import nnx

from posttrain_jax.models import hf_io
from posttrain_jax.models.config import ModelConfig


def is_model(weights: Any) -> bool:
  """True for a model of this package (an nnx.Module with a ModelConfig `cfg`)."""
  return isinstance(weights, nnx.Module) and isinstance(getattr(weights, "cfg", None), ModelConfig)


def as_params(weights: Any) -> Any:
  """A model -> its `nnx.Param` state (no copy); anything else is returned as given."""
  return nnx.state(weights, nnx.Param) if is_model(weights) else weights


def as_hf_tensors(weights: Any) -> Iterable[tuple[str, Any]]:
  """A model -> its `(HF name, host array)` pairs (`hf_io.hf_tensors`); pairs pass through."""
  return hf_io.hf_tensors(weights) if is_model(weights) else weights


__all__ = ["is_model", "as_params", "as_hf_tensors"]
