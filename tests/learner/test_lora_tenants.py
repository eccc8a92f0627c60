"""One adapter per tenant (posttrain_jax/tenants.py): a step trains the selected tenant's row
exactly as a one-tenant learner would and leaves every other row's bits alone; one compiled
step serves every tenant; checkpoints resume the whole stack."""
import dataclasses

import jax
import numpy as np
import pytest

from posttrain_jax import learner as L
from posttrain_jax import sharding as shd
from posttrain_jax import tenants as tn
from posttrain_jax.checkpoint import CheckpointConfig, Checkpointer
from posttrain_jax.models import hf_io, lora
from tests.learner.test_lora import LORA, _assert_trees_equal, _batch, _host, _sft
from tests.support.learner import CFG, small_model

TENANTS = dataclasses.replace(LORA, tenants=("acme", "globex", "initech"))


def _arrays(state):
  """A TrainState's leaves as host arrays (the rng as its key data)."""
  return _host(dataclasses.replace(state, rng=jax.random.key_data(state.rng)))


def _assert_close(a, b):
  """Equal to the last bit or two: the stacked step is another XLA program than the one-tenant
  step (fused differently), the arithmetic the same."""
  la, lb = jax.tree.leaves_with_path(_host(a)), jax.tree.leaves_with_path(_host(b))
  assert [p for p, _ in la] == [p for p, _ in lb]
  for (path, x), (_, y) in zip(la, lb):
    np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-8, err_msg=jax.tree_util.keystr(path))


def test_a_step_trains_the_selected_tenant_only_and_as_one_tenant_would():
  """Tenant "globex" trained twice, "acme" once, with dropout and 2 micro-batches: each row
  equals a one-adapter learner given that tenant's batches (same init; to ~1e-7, another XLA
  program), "initech" is untouched bit for bit; per-tenant step counts; one compile for all
  tenants; adapters off is the shared base for each."""
  cfg = _sft(dataclasses.replace(TENANTS, dropout=0.1), micro_batches=2)
  one = _sft(dataclasses.replace(LORA, dropout=0.1), micro_batches=2)
  model = small_model(num_layers=1)
  multi = L.Learner(model, cfg)
  start = _arrays(multi.state)
  plan = [("globex", 0), ("acme", 1), ("globex", 2)]
  for tenant, seed in plan:
    multi.select(tenant)
    multi.step(_batch(seed=seed))
  assert multi._step._cache_size() == 1
  for tenant, seeds in (("acme", [1]), ("globex", [0, 2])):
    ref = L.Learner(model, one)
    for seed in seeds:
      ref.step(_batch(seed=seed))
    row = tn.take(multi.state, tn.tenant_index(multi.tenants, tenant))
    _assert_close(row.params, ref.state.params)
    _assert_close(row.opt_state, ref.state.opt_state)
    multi.select(tenant)
    assert multi.step_count == ref.step_count == len(seeds)
    _assert_close(multi.params, ref.params)
  _assert_trees_equal(tn.take(_arrays(multi.state), 2), tn.take(start, 2))   # initech: never trained
  multi.select("initech")
  assert multi.step_count == 0
  for tenant in TENANTS.tenants:   # every tenant's reference: the shared base, adapters zero
    multi.select(tenant)
    leaves = jax.tree_util.tree_flatten_with_path(multi.adapters_off())[0]
    adapters = [v for k, v in leaves if "lora" in jax.tree_util.keystr(k)]
    base = [v for k, v in leaves if "lora" not in jax.tree_util.keystr(k)]
    assert adapters and not any(np.any(np.asarray(v)) for v in adapters)
    frozen = {id(x) for x in jax.tree.leaves(multi.frozen)}
    assert base and all(id(v) in frozen for v in base)
  with pytest.raises(KeyError, match="'hooli' has no adapter.*acme"):
    multi.select("hooli")


def test_the_stack_checkpoints_and_resumes_bit_for_bit(tmp_path):
  model = small_model(num_layers=1)
  cfg = _sft(TENANTS)
  straight = L.Learner(model, cfg)
  ckpt = Checkpointer(tmp_path, CheckpointConfig())
  plan = [("acme", 0), ("initech", 1), ("acme", 2), ("initech", 3)]
  for i, (tenant, seed) in enumerate(plan):
    if i == 2:
      ckpt.save(2, straight.state, {"step": 2})
      ckpt.wait()
    straight.select(tenant)
    straight.step(_batch(seed=seed))
  abstract = L.abstract_train_state(model, cfg)
  assert jax.tree.leaves(abstract.params)[0].shape[0] == 3
  state, _ = ckpt.restore(abstract)
  resumed = L.Learner(model, cfg, state=state)
  for tenant, seed in plan[2:]:
    resumed.select(tenant)
    resumed.step(_batch(seed=seed))
  ckpt.close()
  _assert_trees_equal(_arrays(resumed.state), _arrays(straight.state))


@pytest.mark.devices(8)
def test_stacked_adapters_keep_their_sharding_behind_the_tenant_axis():
  mesh = shd.make_mesh(shd.MeshConfig(fsdp=4, tensor=2))
  multi = L.Learner(hf_io.init_model(CFG.replace(num_layers=1), 0, mesh), _sft(TENANTS),
                    mesh=mesh)
  q = multi.state.params["layers"][0]["self_attn"]["q_proj"]
  assert q["lora_a"].shape[0] == 3
  assert q["lora_a"].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", None)
  assert q["lora_b"].sharding.spec == jax.sharding.PartitionSpec(None, None, "tensor")
  multi.select("globex")
  multi.step(_batch(rows=8))
  assert q["lora_a"].sharding.spec == multi.state.params["layers"][0]["self_attn"][
      "q_proj"]["lora_a"].sharding.spec


def test_tenants_need_adapters_and_distinct_names():
  with pytest.raises(ValueError, match="needs adapters"):
    lora.LoRAConfig(tenants=("a",))
  with pytest.raises(ValueError, match="twice"):
    lora.LoRAConfig(rank=2, tenants=("a", "a"))
