"""Bad input gets one clear error naming the problem."""
import json

import pytest

from posttrain_jax.models import families, hf_io
from posttrain_jax.models.config import ConfigError
from posttrain_jax.models.safetensors_io import SafetensorsError
from tests.support.hf import save_random_hf_model


def test_missing_directory(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    hf_io.load_hf_model(tmp_path / "nope")


def test_missing_config(tmp_path):
  with pytest.raises(FileNotFoundError, match="no config.json"):
    hf_io.load_hf_model(tmp_path)


def test_missing_weights(tmp_path):
  save_random_hf_model("qwen2", tmp_path)
  (tmp_path / "model.safetensors").unlink()
  with pytest.raises(SafetensorsError, match="no weights found"):
    hf_io.load_hf_model(tmp_path)


def test_unsupported_architecture_lists_supported(tmp_path):
  save_random_hf_model("qwen2", tmp_path)
  conf = json.loads((tmp_path / "config.json").read_text())
  conf["architectures"], conf["model_type"] = ["GPT2LMHeadModel"], "gpt2"
  (tmp_path / "config.json").write_text(json.dumps(conf))
  supported = ", ".join(families.architectures())  # LlamaForCausalLM, Qwen2ForCausalLM, ...
  with pytest.raises(ConfigError, match=f"GPT2LMHeadModel.*supported: {supported}$"):
    hf_io.load_hf_model(tmp_path)


def test_shape_mismatch_names_tensor(tmp_path):
  save_random_hf_model("qwen3", tmp_path)
  conf = json.loads((tmp_path / "config.json").read_text())
  conf["intermediate_size"] = 96
  (tmp_path / "config.json").write_text(json.dumps(conf))
  with pytest.raises(hf_io.CheckpointError, match=r"tensor 'model\.layers\.0\.mlp\.\w+_proj\.weight' in .*model\.safetensors has shape \(\d+, \d+\), but config\.json implies"):
    hf_io.load_hf_model(tmp_path)


def test_missing_tensor_named(tmp_path):
  save_random_hf_model("llama", tmp_path)
  conf = json.loads((tmp_path / "config.json").read_text())
  conf["num_hidden_layers"] = 3
  (tmp_path / "config.json").write_text(json.dumps(conf))
  with pytest.raises(hf_io.CheckpointError, match=r"missing tensor\(s\) model\.layers\.2\."):
    hf_io.load_hf_model(tmp_path)


def test_unsupported_rope_type(tmp_path):
  save_random_hf_model("llama", tmp_path)
  conf = json.loads((tmp_path / "config.json").read_text())
  conf["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
  (tmp_path / "config.json").write_text(json.dumps(conf))
  with pytest.raises(ConfigError, match="'yarn' is not supported.*llama3"):
    hf_io.load_hf_model(tmp_path)


def test_corrupt_safetensors(tmp_path):
  save_random_hf_model("qwen2", tmp_path)
  (tmp_path / "model.safetensors").write_bytes(b"\x05")
  with pytest.raises(SafetensorsError, match="model.safetensors: not a readable safetensors"):
    hf_io.load_hf_model(tmp_path)


def _edit_config(path, family, **fields):
  save_random_hf_model(family, path)
  conf = json.loads((path / "config.json").read_text())
  conf.update(fields)
  for k in [k for k, v in fields.items() if v is _DROP]:
    del conf[k]
  (path / "config.json").write_text(json.dumps(conf))
  return conf


_DROP = object()


@pytest.mark.parametrize("family, fields, message", [
    # Mistral style: a window is on whenever it is set (Llama's config has no switch for it).
    ("llama", dict(sliding_window=4096), r"sliding_window=4096: sliding-window attention"),
    # Qwen2: the switch turns the window on from layer max_window_layers (1 of 2) on.
    ("qwen2", dict(sliding_window=16, use_sliding_window=True, max_window_layers=1,
                   layer_types=_DROP), r"use_sliding_window=true with sliding_window=16"),
    # Per-layer kinds, as transformers writes them, decide when present.
    ("qwen3", dict(sliding_window=16, layer_types=["full_attention", "sliding_attention"]),
     r"layer_types\[1\]='sliding_attention'"),
])
def test_sliding_window_attention_refused(tmp_path, family, fields, message):
  _edit_config(tmp_path, family, **fields)
  with pytest.raises(ConfigError, match=r"config\.json: " + message):
    hf_io.load_hf_model(tmp_path)


@pytest.mark.parametrize("fields", [
    # Released Qwen2.5 / Qwen3 configs: a window size, switched off.
    dict(sliding_window=131072, use_sliding_window=False, max_window_layers=28, layer_types=_DROP),
    # Switched on, but from layer 28 on: none of our 2 layers has a window (as HF reads it).
    dict(sliding_window=131072, use_sliding_window=True, max_window_layers=28, layer_types=_DROP),
    dict(sliding_window=None, use_sliding_window=True, layer_types=_DROP),
])
def test_sliding_window_that_is_off_still_loads(tmp_path, fields):
  _edit_config(tmp_path / "plain", "qwen2")
  _edit_config(tmp_path / "edited", "qwen2", **fields)
  assert hf_io.read_model_config(tmp_path / "edited") == hf_io.read_model_config(tmp_path / "plain")
  from transformers import AutoConfig  # transformers reads it as full attention too
  assert AutoConfig.from_pretrained(tmp_path / "edited").layer_types == ["full_attention"] * 2


@pytest.mark.parametrize("fields, message", [
    (dict(partial_rotary_factor=0.5), r"partial_rotary_factor=0\.5 is not supported.*set it to 1\.0"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}),
     r"rope_parameters\.partial_rotary_factor=0\.25"),
    (dict(attn_logit_softcapping=50.0), r"attn_logit_softcapping=50\.0 .*set it to null"),
    (dict(attention_chunk_size=8192), r"attention_chunk_size=8192"),
])
def test_other_unimplemented_attention_refused(tmp_path, fields, message):
  _edit_config(tmp_path, "llama", **fields)
  with pytest.raises(ConfigError, match=message):
    hf_io.load_hf_model(tmp_path)
