"""Sharded forward on 8 CPU devices (fsdp=4 x tensor=2) == unsharded; params sharded per rules."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from posttrain_jax import sharding as shd
from posttrain_jax.models import hf_io
from posttrain_jax.models.config import ModelConfig
from tests.support.hf import save_random_hf_model

needs8 = pytest.mark.devices(8)  # tests/conftest.py gives 8 CPU devices; fewer fail there

CFG = ModelConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True,
                  tie_word_embeddings=False)


def _forward(model, ids, pos):
  return nnx.jit(lambda m, i, p: m.logits(m(i, p)[0]))(model, ids, pos)


@needs8
def test_sharded_forward_equals_unsharded():
  mesh = shd.make_mesh(shd.MeshConfig(fsdp=4, tensor=2))
  ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, (4, 16)))
  pos = jnp.broadcast_to(jnp.arange(16), ids.shape)
  ref = np.asarray(_forward(hf_io.init_model(CFG, 3), ids, pos))
  sharded = hf_io.init_model(CFG, 3, mesh)
  got = np.asarray(_forward(sharded, ids, pos))
  assert np.abs(got - ref).max() <= 1e-5


@needs8
def test_params_sharded_as_rules_say():
  mesh = shd.make_mesh(shd.MeshConfig(fsdp=4, tensor=2))
  model = hf_io.init_model(CFG, 0, mesh)
  expected = {
      ("embed_tokens",): P("tensor", "fsdp"),
      ("layers", 0, "self_attn", "q_proj", "kernel"): P("fsdp", "tensor"),
      ("layers", 0, "self_attn", "k_proj", "kernel"): P("fsdp", "tensor"),
      ("layers", 0, "self_attn", "o_proj", "kernel"): P("tensor", "fsdp"),
      ("layers", 1, "mlp", "gate_proj", "kernel"): P("fsdp", "tensor"),
      ("layers", 1, "mlp", "down_proj", "kernel"): P("tensor", "fsdp"),
      ("layers", 1, "input_layernorm", "scale"): P(None),
      ("lm_head", "kernel"): P("fsdp", "tensor"),
  }
  flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
  for path, spec in expected.items():
    arr = flat[path][...]
    assert arr.sharding.spec == spec, (path, arr.sharding.spec)
    shard_shape = arr.addressable_shards[0].data.shape
    want = tuple(d // (np.prod([mesh.shape[a] for a in ((s,) if isinstance(s, str) else s)]) if s else 1)
                 for d, s in zip(arr.shape, tuple(spec) + (None,) * (arr.ndim - len(spec))))
    assert shard_shape == want, (path, shard_shape, want)


@needs8
def test_loader_fills_sharded_arrays(tmp_path):
  torch_model = save_random_hf_model("llama", tmp_path)
  mesh = shd.make_mesh(shd.MeshConfig(fsdp=4, tensor=2))
  model = hf_io.load_hf_model(tmp_path, mesh=mesh)
  q = model.layers[0].self_attn.q_proj.kernel[...]
  assert q.sharding.spec == P("fsdp", "tensor")
  assert q.addressable_shards[0].data.shape == (48 // 4, 48 // 2)
  ref = torch_model.model.layers[0].self_attn.q_proj.weight.detach().numpy().T
  np.testing.assert_array_equal(np.asarray(q), ref)


@pytest.mark.devices(2)
def test_indivisible_dimension_is_replicated():
  mesh = shd.make_mesh(shd.MeshConfig(fsdp=-1), devices=jax.devices()[:2])
  assert shd.logical_to_spec(("embed", "mlp"), mesh=mesh, shape=(3, 8)) == P(None, None)
  assert shd.logical_to_spec(("embed", "mlp"), mesh=mesh, shape=(4, 8)) == P("fsdp", None)


def test_mesh_that_does_not_divide_devices():
  with pytest.raises(shd.MeshError, match="needs 6 devices but there are 8"):
    shd.mesh_shape(shd.MeshConfig(data=1, fsdp=3, tensor=2), 8)
  with pytest.raises(shd.MeshError, match="do not divide the 8 devices"):
    shd.mesh_shape(shd.MeshConfig(fsdp=-1, tensor=3), 8)
  assert shd.mesh_shape(shd.MeshConfig(fsdp=-1, tensor=2), 8) == (1, 4, 2)


def test_unknown_logical_axis():
  with pytest.raises(KeyError, match="no sharding rule"):
    shd.logical_to_spec(("embedding_typo",))
