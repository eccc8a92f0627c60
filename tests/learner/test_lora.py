"""LoRA in the learner: fresh adapters change nothing, adapter gradients against a float64 torch
reference, only adapters move, micro-batches, sharded adapters, checkpoints resume bit for bit."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from posttrain_jax import batching
from posttrain_jax import learner as L
from posttrain_jax import sharding as shd
from posttrain_jax.checkpoint import CheckpointConfig, Checkpointer
from posttrain_jax.config_io import ConfigTypeError
from posttrain_jax.losses import SFTConfig, get_loss
from posttrain_jax.models import hf_io, lora
from posttrain_jax.run_config import base_config, run_config_from_dict
from tests.support.hf import save_random_hf_model
from tests.support.learner import CFG, random_trajectories, small_model

LORA = lora.LoRAConfig(rank=4, alpha=8.0)


def _batch(n=8, rows=4, pack=True, seed=0):
  return batching.build_batch(random_trajectories(n, seed=seed), [0.0] * n,
                              batching.BatchConfig(rows=rows, seq_len=40, max_seqs=n, pack=pack))


def _sft(lora_cfg=LORA, lr=1e-2, **kw):
  return L.LearnerConfig(loss="sft", lora=lora_cfg,
                         optimizer=L.OptimizerConfig(learning_rate=lr), **kw)


def _host(tree):
  return jax.tree.map(np.asarray, jax.device_get(tree))


def _at(tree, path):
  for k in path:
    tree = tree[k]
  return tree


def _assert_trees_equal(a, b):
  la, lb = jax.tree.leaves_with_path(_host(a)), jax.tree.leaves_with_path(_host(b))
  assert [p for p, _ in la] == [p for p, _ in lb]
  for (path, x), (_, y) in zip(la, lb):
    np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))


def test_fresh_adapters_leave_the_model_unchanged():
  """B = 0: the adapted model's logits are the base model's, bit for bit (op by op); the
  learner's jitted log-probs agree (XLA fuses the two graphs differently: last-bit
  differences); the reference (adapters off) equals the policy exactly at the start."""
  model = small_model(num_layers=1)
  graphdef, adapters, base = lora.attach(model, LORA)
  fresh = lora.init_adapters(adapters, seed=3)
  q = fresh["layers"][0]["self_attn"]["q_proj"]
  assert q["lora_a"].shape == (CFG.hidden_size, 4)
  assert q["lora_b"].shape == (4, CFG.num_heads * CFG.head_dim)
  assert np.all(np.asarray(q["lora_b"]) == 0)
  bound = CFG.hidden_size ** -0.5        # PEFT's kaiming-uniform(a=sqrt(5)) on [r, in]
  a = np.asarray(q["lora_a"])
  assert np.abs(a).max() <= bound and np.abs(a).max() > 0.8 * bound and a.std() > 0.4 * bound
  adapted = nnx.merge(graphdef, lora.join(base, fresh))
  ids = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 12))
  pos = jnp.broadcast_to(jnp.arange(12), ids.shape)
  np.testing.assert_array_equal(np.asarray(adapted.logits(adapted(jnp.asarray(ids), pos)[0])),
                                np.asarray(model.logits(model(jnp.asarray(ids), pos)[0])))

  batch = _batch()
  learner = L.Learner(model, _sft())                 # the base: model's arrays, not donated
  plain = L.Learner(small_model(num_layers=1), L.LearnerConfig(loss="sft"))
  policy = learner.logprobs(batch)
  np.testing.assert_allclose(policy, plain.logprobs(batch), rtol=0, atol=2e-6)
  np.testing.assert_array_equal(learner.logprobs(batch, learner.adapters_off()), policy)


def _torch_sft_grads(hf, adapters, batch, scale):
  """d/dA, d/dB of the token-mean SFT loss with every adapted weight W + s (A B)^T, in float64
  torch (transformers' own forward: independent of our model code)."""
  leaves = {}
  weights = {}
  params = dict(hf.named_parameters())
  for path, leaf in jax.tree.leaves_with_path(adapters):
    keys = tuple(k.key for k in path)
    leaves[keys] = torch.tensor(np.asarray(leaf), dtype=torch.float64, requires_grad=True)
  for keys in {k[:-1] for k in leaves}:
    name = "model." + ".".join(str(k) for k in keys) + ".weight"
    a, b = leaves[keys + ("lora_a",)], leaves[keys + ("lora_b",)]
    weights[name] = params[name] + scale * (a @ b).T
  mask = torch.tensor(np.asarray(batch.loss_mask), dtype=torch.float64)
  out = torch.func.functional_call(hf, weights, args=(), kwargs=dict(
      input_ids=torch.tensor(np.asarray(batch.input_ids), dtype=torch.long),
      attention_mask=torch.tensor(np.asarray(batch.segment_ids) > 0, dtype=torch.long),
      position_ids=torch.tensor(np.asarray(batch.positions), dtype=torch.long)))
  logp = torch.log_softmax(out.logits, -1).gather(
      -1, torch.tensor(np.asarray(batch.target_ids), dtype=torch.long)[..., None])[..., 0]
  loss = -(logp * mask).sum() / mask.sum()
  loss.backward()
  return {k: v.grad.numpy() for k, v in leaves.items()}


def test_adapter_gradients_match_a_float64_torch_reference(tmp_path):
  """Our float32 gradients w.r.t. every A and B (full batch and 2 micro-batches) against
  torch autograd in float64 through transformers with W + s·(A B)^T substituted."""
  hf = save_random_hf_model("qwen3", tmp_path).double().eval()
  hf.config._attn_implementation = "eager"
  model = hf_io.load_hf_model(tmp_path)
  graphdef, adapters, base = lora.attach(model, LORA)
  rng = np.random.default_rng(1)
  adapters = jax.tree_util.tree_map_with_path(   # B ≠ 0: d/dA is not trivially 0
      lambda p, x: (jnp.asarray(rng.normal(size=x.shape) * 0.3, jnp.float32)
                    if p[-1].key == "lora_b" else x), lora.init_adapters(adapters, seed=0))
  batch = _batch(n=6, rows=6, pack=False)
  assert int(np.max(batch.segment_ids)) == 1        # one sequence per row, as torch sees it
  ref = _torch_sft_grads(hf, adapters, batch, LORA.scale)
  for micro in (1, 2):
    grads, _ = jax.jit(lambda p, b: L.gradients(
        p, b, graphdef=graphdef, spec=get_loss("sft"), loss_cfg=SFTConfig(), frozen=base,
        cfg=_sft(micro_batches=micro)))(adapters, jax.tree.map(jnp.asarray, batch))
    ours = {tuple(k.key for k in p): np.asarray(g) for p, g in jax.tree.leaves_with_path(grads)}
    assert ours.keys() == ref.keys() and len(ref) == 2 * 7 * 2   # 7 projections x 2 layers
    for k, r in ref.items():
      assert np.abs(r).max() > 1e-4, k
      np.testing.assert_allclose(ours[k], r, rtol=1e-4, atol=1e-5 * np.abs(r).max(),
                                 err_msg=f"{k} micro_batches={micro}")


def test_a_step_moves_only_the_adapters():
  """A bfloat16 base (float32 adapters): the optimizer holds moments for the adapters alone;
  3 steps change every adapter and leave the base bit for bit (the float32 base: the
  checkpoint test below)."""
  model = small_model(num_layers=1)
  before = _host(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  learner = L.Learner(model, _sft(dataclasses.replace(LORA, base_dtype="bfloat16")))
  adapters = _host(learner.state.params)
  mu = learner.state.opt_state[1][0].mu            # clip, then adamw's ScaleByAdamState
  assert jax.tree.structure(mu) == jax.tree.structure(adapters)   # no state for the base
  batch = _batch()
  start = learner.logprobs(batch)
  losses = [learner.step(batch)["loss"] for _ in range(3)]
  assert losses[-1] < losses[0]
  reference = learner.adapters_off()                  # the base: adapters at 0, not a copy
  up = ("layers", 0, "mlp", "up_proj")
  assert _at(reference, up)["kernel"] is _at(learner.frozen, up)["kernel"]
  np.testing.assert_array_equal(learner.logprobs(batch, reference), start)
  assert np.abs(learner.logprobs(batch) - start).max() > 1e-3
  for (path, a), b in zip(jax.tree.leaves_with_path(adapters),
                          jax.tree.leaves(_host(learner.state.params))):
    assert not np.array_equal(a, b), jax.tree_util.keystr(path)
  expected = jax.tree.map(lambda x: x.astype(jnp.bfloat16), before)
  _assert_trees_equal(learner.frozen, expected)      # the base, bit for bit
  whole = learner.params                              # the graph's dict: base + adapters
  assert _at(whole, up)["kernel"] is _at(learner.frozen, up)["kernel"]
  assert _at(whole, up)["kernel"].dtype == jnp.bfloat16
  assert _at(whole, up)["lora_b"].dtype == jnp.float32


def test_only_the_targeted_projections_get_adapters():
  cfg = lora.LoRAConfig(rank=2, target_modules=("q_proj", "layers.1.mlp.*"))
  _, adapters, _ = lora.attach(hf_io.abstract_model(CFG), cfg)   # shapes only
  paths = sorted(".".join(str(k) for k in p[:-1])
                 for p, _ in nnx.to_flat_state(adapters) if p[-1] == "lora_a")
  assert paths == ["layers.0.self_attn.q_proj", "layers.1.mlp.down_proj", "layers.1.mlp.gate_proj",
                   "layers.1.mlp.up_proj", "layers.1.self_attn.q_proj"]
  with pytest.raises(ValueError, match=r"matches no projection.*'q_proj'"):
    lora.attach(hf_io.abstract_model(CFG), lora.LoRAConfig(rank=2, target_modules=("query",)))


def test_lora_config_flows_from_the_run_config():
  flags = base_config()           # what --config.rl.learner.lora.rank=8 etc. override
  flags.rl.learner.lora.rank = 8
  flags.rl.learner.lora.alpha = 32.0
  flags.rl.learner.lora.target_modules = ("q_proj", "v_proj")
  cfg = run_config_from_dict(flags.to_dict())     # as launch/train.py reads the flags
  assert cfg.rl.learner.lora == lora.LoRAConfig(rank=8, alpha=32.0,
                                                target_modules=("q_proj", "v_proj"))
  assert cfg.sft.learner.lora == lora.LoRAConfig() and not cfg.sft.learner.lora.enabled
  with pytest.raises(ConfigTypeError, match=r"config\.rl\.learner\.lora\.rank: expected int"):
    run_config_from_dict({"rl": {"learner": {"loss": "grpo", "lora": {"rank": "eight"}}}})
  with pytest.raises(ValueError, match="base_dtype is 'int4'"):
    lora.LoRAConfig(rank=8, base_dtype="int4")


@pytest.mark.devices(8)
def test_adapters_are_sharded_by_their_logical_axes():
  """fsdp=4 x tensor=2: A of q_proj [embed, r] splits over fsdp, its B [r, heads] over tensor;
  a sharded step gives the unsharded step's adapters."""
  mesh = shd.make_mesh(shd.MeshConfig(fsdp=4, tensor=2))
  sharded = L.Learner(hf_io.init_model(CFG.replace(num_layers=1), 0, mesh), _sft(), mesh=mesh)
  q = sharded.state.params["layers"][0]["self_attn"]["q_proj"]
  assert q["lora_a"].sharding.spec == jax.sharding.PartitionSpec("fsdp", None)
  assert q["lora_b"].sharding.spec == jax.sharding.PartitionSpec(None, "tensor")
  mu_q = sharded.state.opt_state[1][0].mu["layers"][0]["self_attn"]["q_proj"]
  assert mu_q["lora_a"].sharding.spec == q["lora_a"].sharding.spec
  single = L.Learner(small_model(num_layers=1), _sft())
  batch = _batch(rows=8)
  for learner in (sharded, single):
    learner.step(batch)
  for a, b in zip(jax.tree.leaves(_host(sharded.state.params)),
                  jax.tree.leaves(_host(single.state.params))):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_checkpoint_holds_adapters_and_resumes_bit_for_bit(tmp_path):
  """4 steps straight == 2 steps, the checkpoint saved there restored into a new learner, 2
  steps (dropout on and 2 micro-batches: the rng and the accumulation resume too). The
  checkpoint holds the adapters and their moments only; the float32 base never moves."""
  cfg = _sft(dataclasses.replace(LORA, dropout=0.1), micro_batches=2)
  batches = [_batch(seed=s) for s in range(4)]
  model = small_model(num_layers=1)   # its arrays are the frozen base of both learners
  base = _host(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  straight = L.Learner(model, cfg)
  ckpt = Checkpointer(tmp_path, CheckpointConfig())
  for i, b in enumerate(batches):
    if i == 2:
      ckpt.save(2, straight.state, {"step": 2})
      ckpt.wait()
    straight.step(b)
  _assert_trees_equal(straight.frozen, base)
  saved = json.loads((tmp_path / "2" / "state" / "_METADATA").read_text())["tree_metadata"]
  arrays = [k for k in saved if "params" in k or "mu" in k or "nu" in k]
  assert len(arrays) == 3 * 2 * 7 and all(k.endswith(("['lora_a']\",)", "['lora_b']\",)"))
                                             for k in arrays), arrays[:3]
  state, extra = ckpt.restore(L.abstract_train_state(model, cfg))
  assert extra == {"step": 2}
  resumed = L.Learner(model, cfg, state=state)
  for b in batches[2:]:
    resumed.step(b)
  ckpt.close()
  _assert_trees_equal(resumed.state.params, straight.state.params)
  _assert_trees_equal(resumed.state.opt_state, straight.state.opt_state)
  assert resumed.step_count == straight.step_count == 4


def test_a_lora_learner_refuses_an_abstract_model():
  with pytest.raises(ValueError, match="needs the base weights"):
    L.Learner(hf_io.abstract_model(CFG), _sft())
