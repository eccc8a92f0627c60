"""Model families come from the registry: one file each, found automatically, and each one
round-trips through config.json and has an HF parity model (tests/support/hf.py)."""
import pkgutil

import numpy as np
import pytest

from posttrain_jax.models import families, hf_io
from posttrain_jax.models.config import ConfigError, ModelConfig, from_hf_dict, to_hf_dict
from posttrain_jax.models.weights import as_hf_tensors, as_params, is_model
from tests.support.hf import FAMILIES as PARITY_MODELS

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
             num_kv_heads=2, head_dim=8)


def test_every_family_file_is_registered_under_its_name():
  files = {m.name for m in pkgutil.iter_modules(families.__path__) if not m.name.startswith("_")}
  assert files == set(families.names())


def test_every_family_has_a_parity_model():
  assert set(PARITY_MODELS) == set(families.names())


def test_architectures_are_served_by_one_family_each():
  archs = families.architectures()
  assert len(archs) == len(set(archs))
  for name in families.names():
    for arch in families.get(name).architectures:
      assert families.for_hf({"architectures": [arch]}).name == name
    assert families.for_hf({"model_type": name}).name == name
  assert families.for_hf({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}) is None


@pytest.mark.parametrize("family", families.names())
@pytest.mark.parametrize("bias", [False, True])
def test_config_roundtrips_through_hf_dict(family, bias):
  switches = families.get(family).from_hf({"attention_bias": bias, "mlp_bias": bias})
  cfg = ModelConfig(family=family, **SMALL, **switches, rope_scaling=(("rope_type", "default"),))
  hf = to_hf_dict(cfg)
  assert hf["model_type"] == family and hf["architectures"] == [cfg.architecture]
  assert from_hf_dict(hf) == cfg


def test_family_switches_as_the_hf_classes_define_them():
  got = {n: families.get(n).from_hf({"attention_bias": True, "mlp_bias": True})
         for n in ("llama", "qwen2", "qwen3")}
  assert got == {
      "llama": dict(qkv_bias=True, o_bias=True, mlp_bias=True, qk_norm=False),
      "qwen2": dict(qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False),
      "qwen3": dict(qkv_bias=True, o_bias=True, mlp_bias=False, qk_norm=True)}


def test_unknown_family_lists_registered_ones():
  with pytest.raises(ConfigError, match="family='gpt2'.*registered: " + ", ".join(families.names())):
    ModelConfig(family="gpt2", **SMALL)


def test_weights_helpers_convert_a_model_and_pass_the_rest_through():
  model = hf_io.init_model(ModelConfig(family="qwen3", **SMALL, qk_norm=True), seed=0)
  assert is_model(model)
  params = as_params(model)
  assert not is_model(params) and as_params(params) is params
  pairs = list(as_hf_tensors(model))
  assert dict(pairs).keys() == dict(hf_io.hf_tensors(model)).keys()
  np.testing.assert_array_equal(dict(pairs)["model.embed_tokens.weight"],
                                np.asarray(model.embed_tokens[...]))
  assert as_hf_tensors(pairs) is pairs
