"""Learner invariances: micro-batched == full, fused == unfused == materialised, packed == unpacked."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain_jax import batching
from posttrain_jax import learner as L
from posttrain_jax.losses import CISPOConfig, GRPOConfig, M2POConfig, SFTConfig, get_loss
from tests.support.learner import random_trajectories, small_model


def _setup(loss="grpo", loss_cfg=None, pack=True, n=12, rows=8, seq_len=40, seed=0,
           on_policy=False, num_layers=2):
  model = small_model(num_layers=num_layers)
  graphdef, params = nnx.split(model, nnx.Param)
  params = nnx.to_pure_dict(params)
  trajs = random_trajectories(n, seed=seed)
  adv = np.random.default_rng(seed + 1).normal(size=n).tolist()
  batch = batching.build_batch(trajs, adv, batching.BatchConfig(rows=rows, seq_len=seq_len,
                                                                  max_seqs=16, pack=pack))
  batch = jax.tree.map(jnp.asarray, batch)
  spec = get_loss(loss)
  loss_cfg = loss_cfg or spec.config_cls()
  # old log-probs = learner's own + noise, so ratios are non-trivial and clipping is active;
  # behaviour log-probs near the old ones, so IS weights are spread around 1
  logp = L.token_logprobs(graphdef, params, batch)
  # a fixed function of (sequence, position): identical whatever the layout
  noise = 0.3 * jnp.sin(7.1 * batch.seq_ids + 1.3 * batch.positions + seed)
  beh_noise = 0.9 * jnp.cos(3.7 * batch.seq_ids + 2.9 * batch.positions + seed)
  old = (logp + noise) * batch.loss_mask
  batch = dataclasses.replace(batch, old_logp=None if on_policy else old,
                              behaviour_logp=(old + beh_noise) * batch.loss_mask,
                              ref_logp=(logp - noise) * batch.loss_mask)
  return graphdef, params, batch, spec, loss_cfg


def _grads(graphdef, params, batch, spec, loss_cfg, **cfg):
  fn = jax.jit(functools.partial(L.gradients, graphdef=graphdef, spec=spec, loss_cfg=loss_cfg,
                                 cfg=L.LearnerConfig(loss=spec.name, **cfg)))
  grads, metrics = fn(params, batch)
  return grads, {k: float(s / c) for k, (s, c) in metrics.items()}


def _close(a, b, rtol=2e-5, atol=1e-7):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


slow = pytest.mark.slow
LOSS_CASES = [
    pytest.param("sft", SFTConfig(), marks=slow),
    pytest.param("grpo", GRPOConfig(), marks=slow),
    ("grpo", GRPOConfig(aggregation="seq_mean_token_mean", kl_coef=0.1, dual_clip_c=3.0)),
    pytest.param("grpo", GRPOConfig(aggregation="seq_mean_token_sum_norm", max_len=16), marks=slow),
    ("gspo", None),
]


@pytest.mark.parametrize("loss,loss_cfg", LOSS_CASES)
def test_micro_batched_equals_full_batch(loss, loss_cfg):
  g, p, b, spec, lc = _setup(loss, loss_cfg)
  full, m_full = _grads(g, p, b, spec, lc, micro_batches=1)
  for m in (2, 4):
    micro, m_micro = _grads(g, p, b, spec, lc, micro_batches=m)
    _close(full, micro)
    for k in m_full:
      assert m_micro[k] == pytest.approx(m_full[k], rel=1e-5, abs=1e-6), k


@pytest.mark.parametrize("loss,loss_cfg", LOSS_CASES[1:4])
def test_fused_equals_unfused_equals_materialised(loss, loss_cfg):
  """The kernel paths against plain autodiff through materialised logits."""
  g, p, b, spec, lc = _setup(loss, loss_cfg)
  ref, m_ref = _grads(g, p, b, spec, lc, fused_loss=False, logprob_impl="reference")
  for fused in (False, True):
    got, m_got = _grads(g, p, b, spec, lc, fused_loss=fused, logprob_impl="chunked")
    _close(ref, got, rtol=1e-4, atol=1e-6)
    assert m_got["loss"] == pytest.approx(m_ref["loss"], rel=1e-5, abs=1e-6)


# Fused kernel vs materialised autodiff for the other separable forms: an off-policy
# correction (c_t from old and behaviour log-probs), CISPO's stop-gradient weight, the
# on-policy base (old_logp None: the kernel differentiates through sg(logp)), M2PO's mask.
# A one-layer model and 6 sequences in 4 rows keep the two compiles per case short.
FUSED_CASES = [
    ("grpo", GRPOConfig(correction="tis"), False),
    ("cispo", CISPOConfig(aggregation="seq_mean_token_mean", eps_low=0.2, eps_high=0.2,
                          kl_coef=0.05, correction="icepop"), False),
    ("grpo", GRPOConfig(kl_coef=0.1, kl_estimator="k2"), True),
    pytest.param("m2po", M2POConfig(tau=0.02), False, marks=slow),
]


@pytest.mark.parametrize("loss,loss_cfg,on_policy", FUSED_CASES)
def test_fused_equals_materialised(loss, loss_cfg, on_policy):
  g, p, b, spec, lc = _setup(loss, loss_cfg, n=6, rows=4, seq_len=24, on_policy=on_policy,
                             num_layers=1)
  assert (b.old_logp is None) == on_policy
  ref, m_ref = _grads(g, p, b, spec, lc, fused_loss=False, logprob_impl="reference")
  got, m_got = _grads(g, p, b, spec, lc, fused_loss=True, logprob_impl="chunked")
  assert max(float(np.abs(x).max()) for x in jax.tree.leaves(ref)) > 0
  _close(ref, got, rtol=1e-4, atol=1e-6)
  for k in m_ref:
    assert m_got[k] == pytest.approx(m_ref[k], rel=1e-5, abs=1e-6), k
  if "correction/mask_frac" in m_ref:   # a correction or mask: it really acts on some tokens
    assert m_ref["correction/mask_frac"] > 0 or m_ref["correction/clip_frac"] > 0, m_ref
    assert m_ref["correction/is_weight_mean"] > 0, m_ref


@pytest.mark.parametrize("loss,loss_cfg", LOSS_CASES)
def test_packed_equals_unpacked(loss, loss_cfg):
  packed = _setup(loss, loss_cfg, pack=True, rows=4, seq_len=64)
  unpacked = _setup(loss, loss_cfg, pack=False, rows=12, seq_len=16)
  g1, m1 = _grads(*packed)
  g2, m2 = _grads(*unpacked)
  assert packed[2].segment_ids.max() > 1  # really packed
  _close(g1, g2, rtol=1e-4, atol=1e-6)
  assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-5, abs=1e-6)


def test_step_changes_params_and_counts():
  model = small_model()
  learner = L.Learner(model, L.LearnerConfig(loss="sft", optimizer=L.OptimizerConfig(learning_rate=1e-2)))
  before = jax.tree.map(np.asarray, learner.params)
  batch = batching.build_batch(random_trajectories(8), [0.0] * 8, batching.BatchConfig(rows=4, seq_len=40, max_seqs=8))
  losses = [learner.step(batch)["loss"] for _ in range(5)]
  assert learner.step_count == 5
  assert losses[-1] < losses[0]  # overfits one batch
  moved = [not np.array_equal(a, np.asarray(b)) for a, b in
           zip(jax.tree.leaves(before), jax.tree.leaves(learner.params))]
  assert all(moved)


def test_micro_batches_must_divide_rows():
  g, p, b, spec, lc = _setup("sft")
  with pytest.raises(ValueError, match="micro_batches=3 does not divide the batch's 8 rows"):
    _grads(g, p, b, spec, lc, micro_batches=3)


def test_wrong_loss_config_type():
  with pytest.raises(TypeError, match="loss 'sft' takes a SFTConfig, got GRPOConfig"):
    L.Learner(small_model(), L.LearnerConfig(loss="sft"), GRPOConfig())


def test_unknown_loss_lists_registered():
  with pytest.raises(KeyError, match="unknown loss 'grpoo'.*grpo.*sft"):
    L.Learner(small_model(), L.LearnerConfig(loss="grpoo"))


@pytest.mark.devices(8)
@pytest.mark.slow  # > 30 s: CI's slow stage
def test_micro_batches_span_every_device():
  """Rows sharded over 8 devices, 2 micro-batches of 8 rows: each micro-batch is rows
  k, k+2, ... (so every device holds 1 row of each), inside the jitted accumulation as well,
  and the sharded gradients still equal the full batch's."""
  from posttrain_jax import sharding as shd
  from posttrain_jax.models import hf_io
  from tests.support.learner import CFG
  mesh = shd.make_mesh(shd.MeshConfig(fsdp=8))
  g, _, b, spec, lc = _setup("grpo", GRPOConfig(), n=16, rows=16, pack=False)
  params = nnx.to_pure_dict(nnx.state(hf_io.init_model(CFG, 0, mesh), nnx.Param))
  learner = L.Learner(hf_io.init_model(CFG, 0, mesh), L.LearnerConfig(loss="grpo"), mesh=mesh)
  put = learner.put_batch(jax.device_get(b))
  assert put.input_ids.sharding.shard_shape(put.input_ids.shape) == (2, 40)

  micro = jax.jit(L.split_micro_batches, static_argnums=1)(put, 2)
  for k in range(2):   # row r of micro-batch k is row 2r + k
    np.testing.assert_array_equal(np.asarray(micro.input_ids[k]), np.asarray(b.input_ids)[k::2])
  ids = micro.input_ids
  assert len(ids.addressable_shards) == 8
  assert {tuple(s.data.shape) for s in ids.addressable_shards} == {(2, 1, 40)}  # 1 row of each
  assert len({s.index[1].start for s in ids.addressable_shards}) == 8   # 8 different rows

  seen = []   # the micro-batch one accumulation step sees, as the compiler laid it out

  def accumulate(batch):
    def body(total, mb):
      jax.debug.inspect_array_sharding(mb.input_ids, callback=seen.append)
      return total + jnp.sum(mb.loss_mask), None
    return jax.lax.scan(body, 0.0, L.split_micro_batches(batch, 2))[0]

  assert float(jax.jit(accumulate)(put)) == float(jnp.sum(b.loss_mask))
  assert seen[0].shard_shape((8, 40)) == (1, 40) and len(seen[0].device_set) == 8

  full, m_full = _grads(g, params, put, spec, lc, micro_batches=1)
  micro_g, m_micro = _grads(g, params, put, spec, lc, micro_batches=2)
  _close(full, micro_g)
  for k in m_full:
    assert m_micro[k] == pytest.approx(m_full[k], rel=1e-5, abs=1e-6), k
