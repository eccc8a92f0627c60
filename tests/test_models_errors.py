"""Bad input gets one clear error naming the problem."""
import json

import pytest

from posttrain_jax.models import hf_io
from posttrain_jax.models.config import ConfigError
from posttrain_jax.models.safetensors_io import SafetensorsError
from tests.hf_testing import save_random_hf_model


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
  conf["architectures"], conf["model_type"] = ["MistralForCausalLM"], "mistral"
  (tmp_path / "config.json").write_text(json.dumps(conf))
  with pytest.raises(ConfigError, match="MistralForCausalLM.*LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
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
