"""LoRA adapters in Hugging Face PEFT's format: adapter_config.json + adapter_model.safetensors.

PEFT names an adapter after the module it wraps inside `PeftModel` (`base_model.model.` + the
transformers module path) and stores torch's [out, in] layout:

    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight   = A^T   [r, in]
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight   = B^T   [out, r]

and computes y = x W^T + (lora_alpha / r) · x A^T B^T, which is ours (lora.py) with s = alpha / r.
`PeftModel.from_pretrained(base, dir)` (or vLLM's LoRA loading) then applies the adapters to
the base checkpoint they were trained on. `target_modules` lists the projection names when
every block carries the same set, else every adapted module's full path.

Multi-process: every process must call `save_peft_adapter` (adapters are all-gathered); only
process 0 writes.
"""
from __future__ import annotations

import json
import os
import pathlib
from typing import Optional

import jax
import numpy as np

from posttrain_jax.models.decoder import Decoder
from posttrain_jax.models.fsutil import atomic_directory
from posttrain_jax.models.hf_io import hf_name
from posttrain_jax.models.lora import adapted
from posttrain_jax.models.safetensors_io import write_safetensors

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def _module_name(path: tuple) -> str:
  """Our projection path -> its transformers module path (model.layers.0.self_attn.q_proj)."""
  return hf_name(path + ("kernel",))[0].removesuffix(".weight")


def _host(arr) -> np.ndarray:
  from jax.experimental import multihost_utils
  return (np.asarray(arr) if arr.is_fully_addressable
          else np.asarray(multihost_utils.process_allgather(arr, tiled=True)))


def peft_tensors(model: Decoder) -> list[tuple[str, np.ndarray]]:
  """(PEFT name, host float32 array) of every adapter of `model`, in PEFT's [out, in] layout."""
  out = []
  for path, lin in adapted(model):
    name = "base_model.model." + _module_name(path)
    out.append((f"{name}.lora_A.weight", _host(lin.lora_a[...]).astype(np.float32).T))
    out.append((f"{name}.lora_B.weight", _host(lin.lora_b[...]).astype(np.float32).T))
  return out


def adapter_config(model: Decoder, *, alpha: float, dropout: float = 0.0,
                   base_model_name_or_path: Optional[str] = None) -> dict:
  """PEFT's LoraConfig of `model`'s adapters (rank read from the adapters themselves)."""
  found = list(adapted(model))
  if not found:
    raise ValueError("the model carries no LoRA adapters (LearnerConfig.lora.rank = 0?): "
                     "export it with hf_io.save_hf_model instead")
  ranks = {lin.lora_a.shape[1] for _, lin in found}
  if len(ranks) != 1:
    raise ValueError(f"adapters of several ranks {sorted(ranks)}: PEFT's config has one r")
  per_layer: dict = {}
  for path, _ in found:
    per_layer.setdefault(path[1], set()).add(path[-1])
  names = set().union(*per_layer.values())
  uniform = len(per_layer) == model.cfg.num_layers and all(v == names for v in per_layer.values())
  targets = sorted(names) if uniform else [_module_name(path) for path, _ in found]
  return {
      "peft_type": "LORA",
      "task_type": "CAUSAL_LM",
      "base_model_name_or_path": base_model_name_or_path,
      "r": ranks.pop(),
      "lora_alpha": alpha,
      "lora_dropout": dropout,
      "target_modules": targets,
      "bias": "none",
      "fan_in_fan_out": False,
      "inference_mode": True,
      "init_lora_weights": True,
      "use_rslora": False,
      "use_dora": False,
      "modules_to_save": None,
  }


def write_adapter(directory: os.PathLike, tensors: list[tuple[str, np.ndarray]],
                  config: dict) -> int:
  """Writes `peft_tensors` and `adapter_config` output into the existing `directory` (this
  process alone, not atomically: an engine's private copy); the bytes written."""
  directory = pathlib.Path(directory)
  write_safetensors(directory / WEIGHTS_FILE, tensors)
  text = json.dumps(config, indent=2)
  (directory / CONFIG_FILE).write_text(text)
  return (directory / WEIGHTS_FILE).stat().st_size + len(text.encode())


def save_peft_adapter(model: Decoder, out_dir: os.PathLike, *, alpha: float, dropout: float = 0.0,
                      base_model_name_or_path: Optional[str] = None) -> pathlib.Path:
  """Writes `model`'s adapters (a LoRA learner's `model()`; `alpha`, `dropout`: its LoRAConfig's)
  to `out_dir` as a PEFT adapter, atomically (written beside it, renamed into place)."""
  out_dir = pathlib.Path(out_dir)
  config = adapter_config(model, alpha=alpha, dropout=dropout,
                          base_model_name_or_path=base_model_name_or_path)
  tensors = peft_tensors(model)   # every process gathers
  if jax.process_index() == 0:
    with atomic_directory(out_dir, sum(a.nbytes for _, a in tensors)) as tmp:
      write_adapter(tmp, tensors, config)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(f"save_peft_adapter {out_dir}")
  return out_dir


__all__ = ["save_peft_adapter", "adapter_config", "peft_tensors", "write_adapter", "CONFIG_FILE",
           "WEIGHTS_FILE"]
