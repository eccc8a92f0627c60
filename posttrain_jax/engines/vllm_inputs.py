"""What the vLLM engine (vllm_engine.py) checks and sends: a model directory and its weights
before vLLM reads them (one EngineError naming the file), weight updates (fused q/k/v and
gate/up groups sent whole), LoRA ranks vLLM accepts, and our SamplingParams as vLLM's
(structured outputs for a response_format, the top-k alternatives read back)."""
from __future__ import annotations

import json
import os
import pathlib
from typing import Any, Iterable, Optional

from posttrain_jax.engines.base import EngineError, SamplingParams

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_model_dir(path: os.PathLike, need_tokenizer: bool = True) -> pathlib.Path:
  """Raises EngineError naming what is missing or unreadable in a HF model directory."""
  path = pathlib.Path(path)
  if not str(path) or not path.is_dir():
    raise EngineError(f"model directory {path} does not exist")
  cfg = path / "config.json"
  if not cfg.is_file():
    raise EngineError(f"{path}: no config.json (is this a HF model directory?)")
  try:
    conf = json.loads(cfg.read_text())
  except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
    raise EngineError(f"{cfg}: not valid JSON ({e})") from None
  if not isinstance(conf, dict) or "architectures" not in conf and "model_type" not in conf:
    raise EngineError(f"{cfg}: has neither 'architectures' nor 'model_type'")
  index = path / "model.safetensors.index.json"
  if index.is_file():
    try:
      files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, json.JSONDecodeError, KeyError, AttributeError) as e:
      raise EngineError(f"{index}: malformed index ({e})") from None
    for f in files:
      if not (path / f).is_file():
        raise EngineError(f"{index}: lists {f}, which is missing from {path}")
    weight_files = [path / f for f in files]
  else:
    weight_files = sorted(path.glob("*.safetensors"))
  if not weight_files:
    if any(path.glob("*.bin")) or any(path.glob("*.pt")):
      return path  # torch pickles: vLLM reads them; nothing cheap to check
    raise EngineError(f"{path}: no weights (*.safetensors or model.safetensors.index.json)")
  for f in weight_files:
    check_safetensors(f)
  if need_tokenizer and not any((path / t).is_file() for t in _TOKENIZER_FILES):
    raise EngineError(f"{path}: no tokenizer files ({', '.join(_TOKENIZER_FILES)}); add them "
                      "or set skip_tokenizer_init=True")
  return path


def check_safetensors(f: pathlib.Path) -> dict:
  """Header readable and every tensor's bytes inside the file (catches truncated files)."""
  from posttrain_jax.models.safetensors_io import SafetensorsError, read_header
  try:
    return read_header(f).tensors
  except SafetensorsError as e:
    raise EngineError(str(e)) from None


def checkpoint_shapes(path: os.PathLike) -> Optional[dict[str, tuple[int, ...]]]:
  """{HF name: shape} of a checked safetensors model directory (None for other formats)."""
  path = pathlib.Path(path)
  index = path / "model.safetensors.index.json"
  files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file()
           else sorted(p.name for p in path.glob("*.safetensors")))
  shapes = {}
  for f in files:
    shapes.update({k: tuple(v["shape"]) for k, v in check_safetensors(path / f).items()})
  return shapes or None


def hf_pairs(weights) -> Iterable[tuple[str, Any]]:
  """A model -> its (HF name, numpy) pairs; pairs pass through."""
  from posttrain_jax.models.weights import as_hf_tensors, is_model
  if is_model(weights):
    return as_hf_tensors(weights)
  if isinstance(weights, dict):
    raise EngineError("update_weights takes a Decoder or (HF name, array) pairs, not a dict; "
                      "for learner params use nnx.merge(learner.graphdef, params)")
  return weights


_FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def check_fused_groups(names: list[str]) -> None:
  """vLLM fuses q/k/v and gate/up into one tensor; a partial update must send whole groups.

  (Its in-place reload rebuilds each fused tensor from the parts it receives; a missing part
  is left uninitialised, which gave NaN log-probs.)
  """
  have = set(names)
  for name in names:
    for group in _FUSED:
      for part in group:
        tag = f".{part}."
        if tag in name:
          missing = [name.replace(tag, f".{o}.") for o in group
                     if name.replace(tag, f".{o}.") not in have]
          if missing:
            raise EngineError(f"partial weight update has {name!r} but not {missing[0]!r}: vLLM "
                              f"stores {'/'.join(group)} as one tensor; send them together")


def is_adapted_model(weights) -> bool:
  """`weights` is a model carrying LoRA adapters (its update goes to vLLM as an adapter)."""
  from posttrain_jax.models.lora import has_adapters
  from posttrain_jax.models.weights import is_model
  return is_model(weights) and has_adapters(weights)


def vllm_lora_rank(rank: int) -> int:
  """vLLM's max_lora_rank for adapters of rank `rank`: the smallest value it accepts ≥ rank."""
  import typing

  from vllm.config.lora import MaxLoRARanks
  allowed = sorted(typing.get_args(MaxLoRARanks))
  for r in allowed:
    if r >= rank:
      return r
  raise EngineError(f"LoRA rank {rank} exceeds vLLM's largest max_lora_rank {allowed[-1]}: "
                    "lower learner.lora.rank or set engine_config.adapter_sync=False (merged "
                    "weights)")


def _structured(response_format: Optional[str]):
  """SamplingParams.response_format (an OpenAI response_format, JSON text) as vLLM's structured
  outputs: json_object -> any JSON object, json_schema -> JSON following its `schema`."""
  if response_format is None:
    return None
  from vllm.sampling_params import StructuredOutputsParams
  fmt = json.loads(response_format)
  if fmt.get("type") == "json_object":
    return StructuredOutputsParams(json_object=True)
  if fmt.get("type") == "json_schema":
    return StructuredOutputsParams(json=(fmt.get("json_schema") or {}).get("schema") or {})
  raise EngineError(f"response_format {response_format}: valid types json_object, json_schema")


def vllm_sampling(sp: SamplingParams, n: int, seed: Optional[int], **extra):
  import vllm
  structured = _structured(sp.response_format)
  if structured is not None:
    extra["structured_outputs"] = structured
  return vllm.SamplingParams(
      n=n, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, max_tokens=sp.max_tokens,
      stop_token_ids=list(sp.stop_token_ids), ignore_eos=True, seed=seed, detokenize=False,
      skip_special_tokens=False, **extra)


def top_alternatives(ids: list[int], logprobs, k: int) -> Optional[list[list[tuple[int, float]]]]:
  """The k most likely (id, log-prob) of each position from vLLM's per-position dicts (they
  hold the top k by rank, plus the sampled token when it is not among them)."""
  if k == 0:
    return None
  return [sorted(((t, d[t].logprob) for t in d if d[t].rank is not None and d[t].rank <= k),
                 key=lambda x: -x[1])[:k] for d in logprobs[:len(ids)]]
