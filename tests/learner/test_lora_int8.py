"""LoRA on an int8 base (LoRAConfig.base_dtype="int8", models/quant.py): the quantiser against a
numpy one, the int8 model against a float32 model of the dequantised kernels, training moves
only the adapters, the base's bytes, the embedded sampler on Learner.params, the merged HF
export, and the sharded learner (the scales follow their kernels' output axes)."""
import functools
import gc
import types
import weakref

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from posttrain_jax import batching
from posttrain_jax import learner as L
from posttrain_jax import sharding as shd
from posttrain_jax.engines.base import SamplingParams
from posttrain_jax.engines.jax_sampler import JaxSampler
from posttrain_jax.models import hf_io, lora, quant
from posttrain_jax.models.safetensors_io import read_header
from tests.support.learner import CFG, random_trajectories, small_model

INT8 = lora.LoRAConfig(rank=4, alpha=8.0, base_dtype="int8")
PROJ = ("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), \
    ("self_attn", "o_proj"), ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj")


def _batch(n=8, rows=4, seed=0):
  return batching.build_batch(random_trajectories(n, seed=seed), [0.0] * n,
                              batching.BatchConfig(rows=rows, seq_len=40, max_seqs=n, pack=True))


def _sft(lora_cfg=INT8):
  return L.LearnerConfig(loss="sft", lora=lora_cfg, optimizer=L.OptimizerConfig(learning_rate=1e-2))


def _host(tree):
  return jax.tree.map(np.asarray, jax.device_get(tree))


def _kernels(params):
  """(layer, module, proj) -> the kernel value of every block projection in a params dict."""
  return {(i, m, p): params["layers"][i][m][p]["kernel"]
          for i in range(CFG.num_layers) for m, p in PROJ}


def _numpy_quantise(w):
  """The reference: symmetric per output channel, round half to even, float32 throughout."""
  w = np.asarray(w, np.float32)
  s = np.abs(w).max(axis=0) / np.float32(127)
  q = np.clip(np.round(w / np.where(s > 0, s, np.float32(1))), -127, 127).astype(np.int8)
  return q, s.astype(np.float32)


def _logits(model, ids):
  pos = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
  hidden, _ = model(ids, pos)
  return np.asarray(model.logits(hidden))


def _others(params):
  """(path, leaf) of the base leaves that are not a block kernel's q or scale."""
  return [(p, x) for p, x in jax.tree_util.tree_leaves_with_path(params)
          if not isinstance(p[-1], jax.tree_util.GetAttrKey)]


def _at(tree, path):
  for k in path:
    tree = tree[k.key]
  return tree


@pytest.fixture(scope="module")
def run():
  """A 2-layer float32 model, an int8-base LoRA SFT learner on it, 3 steps on one batch. The
  model is dropped once the learner is built (as run/parts.py does): `float_kernels_alive`
  counts its float kernels still alive after that, `shared` whether each other base leaf is
  the model's own array."""
  model = small_model()
  base = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  refs = [weakref.ref(k) for k in _kernels(base).values()]
  learner = L.Learner(model, _sft())
  shared = [x is _at(base, p) for p, x in _others(learner.frozen)]
  host_base = _host(base)
  del model, base
  gc.collect()
  before = _host(learner.frozen)
  adapters = _host(learner.state.params)
  batch = _batch()
  losses = [learner.step(batch)["loss"] for _ in range(3)]
  return types.SimpleNamespace(base=host_base, learner=learner, before=before, shared=shared,
                               float_kernels_alive=sum(r() is not None for r in refs),
                               adapters=adapters, batch=batch, losses=losses)


def test_int8_kernels_match_numpy_and_the_model_is_the_float_model_of_their_values(run):
  """Per kernel: q equals a numpy quantiser's, |W − q·s| ≤ s/2 elementwise (+ float32 ulps),
  and the int8 learner's base log-probs (adapters off) equal a float32 model whose kernels are
  numpy's q·s (≤ 1e-5); a zero column dequantises to 0 (no NaN)."""
  float_params = jax.tree.map(np.asarray, run.base)
  for key, k in _kernels(run.learner.frozen).items():
    w = np.asarray(_kernels(run.base)[key])
    q_ref, s_ref = _numpy_quantise(w)
    assert k.q.dtype == np.int8 and k.scale.dtype == np.float32 and k.scale.shape == w.shape[1:]
    np.testing.assert_array_equal(np.asarray(k.q), q_ref, err_msg=str(key))
    np.testing.assert_array_max_ulp(np.asarray(k.scale), s_ref, maxulp=1)  # XLA: x · (1/127)
    q, s = np.asarray(k.q).astype(np.float32), np.asarray(k.scale)
    err = np.abs(w - q * s)
    assert (err <= s / 2 + 2 * np.spacing(np.abs(w))).all(), (key, (err / s).max())
    assert (err / s).max() > 0.45                     # the bound is tight, not vacuous
    i, m, p = key
    float_params["layers"][i][m][p]["kernel"] = q_ref.astype(np.float32) * s_ref
  w = np.asarray(_kernels(run.base)[(0, "mlp", "up_proj")]).copy()
  w[:, 3] = 0.0
  zero = quant.dequantize(quant.quantize(w))
  assert np.isfinite(np.asarray(zero)).all() and not np.asarray(zero)[:, 3].any()

  graphdef, _ = nnx.split(small_model(), nnx.Param)   # a plain float32 graph, no adapters
  ref = jax.jit(functools.partial(L.token_logprobs, graphdef))(float_params, run.batch)
  got = run.learner.logprobs(run.batch, run.learner.adapters_off())
  assert np.abs(np.asarray(ref)).max() > 1.0
  np.testing.assert_allclose(got, np.asarray(ref), atol=1e-5, rtol=0)


def test_an_int8_base_trains_and_only_the_adapters_move(run):
  """3 SFT steps lower the loss; every adapter moved; the frozen base is int8 kernels with
  float32 scales before and after, bit for bit, and every other base leaf is the model's own
  float32 array (not copied); once the model is dropped no float kernel stays alive; the step
  compiled once; the optimizer holds adapters only; abstract_frozen matches the base."""
  learner = run.learner
  assert run.losses[-1] < run.losses[0], run.losses
  for (path, a), b in zip(jax.tree.leaves_with_path(run.adapters),
                          jax.tree.leaves(_host(learner.state.params))):
    assert a.dtype == np.float32 and not np.array_equal(a, b), jax.tree_util.keystr(path)
  mu = learner.state.opt_state[1][0].mu
  assert jax.tree.structure(mu) == jax.tree.structure(run.adapters)
  kernels = _kernels(learner.frozen)
  assert len(kernels) == 7 * CFG.num_layers
  assert all(isinstance(k, quant.Int8Kernel) and k.q.dtype == np.int8
             and k.scale.dtype == np.float32 for k in kernels.values())
  assert all(isinstance(k, quant.Int8Kernel) for k in _kernels(run.before).values())
  after = _host(learner.frozen)
  assert jax.tree.structure(after) == jax.tree.structure(run.before)
  for (path, a), b in zip(jax.tree.leaves_with_path(run.before), jax.tree.leaves(after)):
    np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
  others = _others(learner.frozen)
  assert len(others) == 1 + CFG.num_layers * 4 + 1   # embedding, 4 norms per layer, final norm
  assert all(x.dtype == np.float32 for _, x in others) and all(run.shared)
  assert run.float_kernels_alive == 0
  assert learner._step._cache_size() == 1
  abstract = L.abstract_frozen(hf_io.abstract_model(CFG), _sft())  # what aot.py's estimate reads
  assert jax.tree.structure(abstract) == jax.tree.structure(learner.frozen)
  for a, x in zip(jax.tree.leaves(abstract), jax.tree.leaves(learner.frozen)):
    assert (a.shape, a.dtype, a.sharding) == (x.shape, x.dtype, x.sharding)


def test_int8_base_bytes_and_the_sampler_reads_learner_params(run):
  """The frozen base's measured bytes, int8 vs float32 (block kernels: in·out + 4·out bytes
  against 4·in·out, 4·in/(in+4) smaller); the embedded sampler fed `Learner.params` (int8 base
  + adapters) decodes greedily the same tokens as one on the dequantised, merged float model."""
  f32_base = run.base          # what base_dtype="float32" holds: the model's arrays (here on host)
  nbytes = lambda t: sum(x.nbytes for x in jax.tree.leaves(t))
  i8, f32 = nbytes(run.learner.frozen), nbytes(f32_base)
  i8_k, f32_k = nbytes(_kernels(run.learner.frozen)), nbytes(_kernels(f32_base))
  print(f"\nfrozen base bytes: int8 {i8} vs float32 {f32} ({f32 / i8:.2f}x); block kernels: "
        f"int8+scales {i8_k} vs float32 {f32_k} ({f32_k / i8_k:.2f}x)")
  shapes = [np.shape(k) for k in _kernels(run.base).values()]
  assert i8_k == sum(din * dout + 4 * dout for din, dout in shapes)
  assert f32_k == sum(4 * din * dout for din, dout in shapes)
  assert f32 - i8 == f32_k - i8_k and f32_k / i8_k > 3.5

  prompts, sp = [[3, 4, 5, 6, 7], [9, 2]], SamplingParams(max_tokens=12, temperature=0.0)
  engine = JaxSampler(run.learner.model())
  engine.update_weights(run.learner.params, version=3)
  got = engine.generate(prompts, sp, seed=0)
  reference = JaxSampler(lora.merged(run.learner.model())).generate(prompts, sp, seed=0)
  for (a,), (b,) in zip(got, reference):
    assert a.version == 3 and len(a.token_ids) == 12
    assert a.token_ids == b.token_ids
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)


def test_merged_export_of_an_int8_base_reloads_with_the_int8_models_logits(run, tmp_path):
  """merged() / save_hf_model write the dequantised W + s·A·B in float32; load_hf_model of the
  directory gives the int8 LoRA model's logits (≤ 1e-5)."""
  model = run.learner.model()
  plain = lora.merged(model)
  assert all(np.asarray(k).dtype == np.float32
             for k in _kernels(nnx.to_pure_dict(nnx.state(plain, nnx.Param))).values())
  hf_io.save_hf_model(model, tmp_path / "hf")
  tensors = read_header(tmp_path / "hf" / "model.safetensors").tensors
  assert {t["dtype"] for t in tensors.values()} == {"F32"}
  assert not any("lora" in name or "scale" in name for name in tensors)
  loaded = hf_io.load_hf_model(tmp_path / "hf")
  ids = np.random.default_rng(1).integers(0, CFG.vocab_size, (2, 11))
  want, got = _logits(model, ids), _logits(loaded, ids)
  assert np.abs(want - _logits(small_model(), ids)).max() > 1e-3  # int8 + adapters ≠ float base
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_an_unknown_base_dtype_names_the_valid_ones():
  with pytest.raises(ValueError, match=r"base_dtype is 'int4'; valid: \['bfloat16', 'float32', "
                                       r"'int8'\]"):
    lora.LoRAConfig(rank=8, base_dtype="int4")


@pytest.mark.devices(8)
def test_a_sharded_int8_base_keeps_scales_on_the_kernels_output_axis(run):
  """fsdp=4 x tensor=2: q's sharding is the float kernel's, its scale's the kernel's output axis
  (q_proj [embed, heads] -> P("tensor"), down_proj [mlp, embed] -> P("fsdp")); abstract_frozen
  says the same; the same 3 steps sharded give the unsharded learner's adapters."""
  mesh = shd.make_mesh(shd.MeshConfig(fsdp=4, tensor=2))
  model = hf_io.init_model(CFG, 0, mesh)               # small_model()'s values, sharded
  sharded = L.Learner(model, _sft(), mesh=mesh)
  q_proj = sharded.frozen["layers"][0]["self_attn"]["q_proj"]["kernel"]
  down = sharded.frozen["layers"][1]["mlp"]["down_proj"]["kernel"]
  assert q_proj.q.sharding.spec == P("fsdp", "tensor") and q_proj.scale.sharding.spec == P("tensor")
  assert down.q.sharding.spec == P("tensor", "fsdp") and down.scale.sharding.spec == P("fsdp")
  abstract = L.abstract_frozen(model, _sft(), mesh)
  assert jax.tree.structure(abstract) == jax.tree.structure(sharded.frozen)
  for a, x in zip(jax.tree.leaves(abstract), jax.tree.leaves(sharded.frozen)):
    assert (a.shape, a.dtype) == (x.shape, x.dtype)
    assert a.sharding.is_equivalent_to(x.sharding, x.ndim)
  _assert_close(sharded.frozen, run.before, rtol=0, atol=0)   # the same int8 base
  for _ in range(3):
    sharded.step(run.batch)
  _assert_close(sharded.state.params, run.learner.state.params, rtol=1e-4, atol=1e-6)


def _assert_close(a, b, **tol):
  la, lb = jax.tree.leaves_with_path(_host(a)), jax.tree.leaves(_host(b))
  assert len(la) == len(lb)
  for (path, x), y in zip(la, lb):
    np.testing.assert_allclose(x, y, err_msg=jax.tree_util.keystr(path), **tol)
