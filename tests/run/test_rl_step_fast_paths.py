"""The RL step's fast paths against their slow paths: a trimmed batch (batching.fit_shape)
trains exactly like the padded one (loss, gradients, metrics, through every LM-head kernel,
micro-batched on a mesh, one shape on every process of a job, a bounded number of compiles),
and a report-only reference forward every `kl_every` versions changes nothing but when the
`kl` metric appears (absent, not 0, in metrics.jsonl and the plot)."""
import ast
import dataclasses

import jax
import numpy as np
import pytest

from posttrain_jax import batching
from posttrain_jax.advantages import AdvantageConfig
from posttrain_jax.kernels import lm_head
from posttrain_jax.learner import Learner, LearnerConfig, OptimizerConfig
from posttrain_jax.losses import FullDistillConfig, GRPOConfig, GSPOConfig, M2POConfig, get_loss
from posttrain_jax.metrics import MetricsWriter, plot_run, read_metrics
from posttrain_jax.run.rl_step import rl_step
from posttrain_jax.sharding import MeshConfig, make_mesh
from posttrain_jax.models import hf_io
from posttrain_jax.types import TrainBatch, Trajectory
from tests.support.distributed import run_processes
from tests.support.learner import (CFG, VOCAB, FixedSource, assert_same_training, grads,
                                   random_trajectories, small_model, with_scored_fields)

FULL = batching.BatchConfig(rows=32, seq_len=40, max_seqs=32, pack=False, trim=False)


def _batch(n=12, pack=False, seed=0):
  trajs = random_trajectories(n, seed=seed)
  adv = np.random.default_rng(seed).normal(size=n).tolist()
  cfg = dataclasses.replace(FULL, pack=pack)
  return batching.build_batch(trajs, adv, cfg)


def _allowed_sizes(unit, cap):
  """The bucket sizes, written out: unit·{1, 2, 3} and unit·{4, 5, 6, 7}·2^j, and the cap."""
  sizes = {unit * u for u in (1, 2, 3)} | {unit * m << j for m in (4, 5, 6, 7) for j in range(12)}
  return sorted({s for s in sizes if s < cap} | {cap})


def test_bucket_is_the_smallest_allowed_size_and_keeps_at_most_a_quarter():
  for unit, cap in ((1, 1000), (8, 48), (8, 2048), (16, 128)):
    allowed = _allowed_sizes(unit, cap)
    for n in range(1, cap + 1):
      b = batching.bucket(n, unit, cap)
      assert b == min(a for a in allowed if a >= n), (n, unit, cap)
      assert b % unit == 0 or b == cap
      assert b - n < max(0.25 * n, unit), (n, b)
  # a bounded number of shapes: 28 position buckets for any length up to 2048
  assert len({batching.bucket(n, 8, 2048) for n in range(1, 2049)}) == 28


@pytest.mark.parametrize("pack", [False, True])
def test_fit_shape_cuts_only_padding_to_buckets(pack):
  full = with_scored_fields(_batch(pack=pack))
  small = batching.fit_shape(full, row_multiple=8, seq_bucket=8)
  r, t = small.input_ids.shape
  used = np.asarray(full.segment_ids) > 0
  used_rows = np.nonzero(used.any(1))[0].max() + 1
  used_len = np.nonzero(used.any(0))[0].max() + 1
  assert (r, t) == (batching.bucket(used_rows, 8, 32), batching.bucket(used_len, 8, 40))
  assert r * t < full.input_ids.size
  assert small.teacher_hidden.shape == (r, t, CFG.hidden_size)
  for f in dataclasses.fields(full):
    a, b = getattr(full, f.name), getattr(small, f.name)
    if f.name == "seq_valid":      # per sequence, not per position: kept whole
      np.testing.assert_array_equal(a, b)
      continue
    if a is None:                  # prefix_ids where no prefix is shared
      assert b is None, f.name
      continue
    np.testing.assert_array_equal(np.asarray(a)[:r, :t], b, err_msg=f.name)
    outside = np.asarray(a).copy()
    outside[:r, :t] = 0
    assert not outside.any(), f"{f.name}: fit_shape dropped a non-padding value"


def test_fit_shape_keeps_rows_that_are_not_a_multiple_never_grows_and_agrees():
  full = _batch(n=3)
  cfg = dataclasses.replace(FULL, rows=12)
  odd = batching.build_batch(random_trajectories(3), [0.0] * 3, cfg)
  assert batching.fit_shape(odd, row_multiple=8).input_ids.shape[0] == 12
  tiny = batching.fit_shape(full, row_multiple=8, seq_bucket=64)
  assert tiny.input_ids.shape == (8, 40)   # the bucket is capped at the configured seq_len
  assert batching.fit_shape(full, 8, agree=lambda s: (32, 40)) is full
  assert batching.fit_shape(full, 8, agree=lambda s: (24, 16)).input_ids.shape == (24, 16)


def test_fit_shape_refuses_an_agreed_shape_that_would_cut_a_used_position():
  full = _batch(n=3)
  r, t = batching.fitted_shape(full, 8)
  for bad in ((r, t - 8), (r - 1, t), (64, t), (r, 48)):
    with pytest.raises(ValueError, match="agreed shape"):
      batching.fit_shape(full, 8, agree=lambda s, bad=bad: bad)


LOSS_CASES = [
    ("grpo", GRPOConfig(aggregation="token_mean")),
    ("grpo", GRPOConfig(aggregation="seq_mean_token_sum_norm", max_len=9, kl_coef=0.1)),
    ("gspo", GSPOConfig()),
    ("m2po", M2POConfig(tau=0.5, ratio_base="behaviour")),
    ("full_distill", FullDistillConfig(topk=None, impl="chunked")),
]


@pytest.mark.parametrize("name,loss_cfg", LOSS_CASES,
                         ids=[f"{n}-{i}" for i, (n, _) in enumerate(LOSS_CASES)])
def test_trimmed_batch_has_the_padded_batchs_loss_and_gradients(name, loss_cfg):
  full = with_scored_fields(_batch(pack=True))
  small = batching.fit_shape(full, row_multiple=8)
  assert np.prod(small.input_ids.shape) < np.prod(full.input_ids.shape) / 2
  assert assert_same_training(full, small, name, loss_cfg) != 0


@pytest.mark.parametrize("impl", ["reference", "pallas_gpu", "pallas_tpu"])
def test_trimmed_batch_trains_alike_through_each_lm_head_kernel(impl):
  """The learner's kernel, with the block sizes it uses (the defaults), on a trimmed N that
  no block divides on TPU (a partial edge block); pallas runs interpreted on CPU."""
  full = _batch(pack=True)
  small = batching.fit_shape(full, row_multiple=8)
  n = int(np.prod(small.input_ids.shape))
  assert n < full.input_ids.size
  if impl == "pallas_tpu":
    assert n % lm_head.default_block_sizes(impl).block_n and n > lm_head.default_block_sizes(
        impl).block_n
  assert_same_training(full, small, "grpo", GRPOConfig(), logprob_impl=impl)


def test_the_padded_vs_trimmed_comparison_sees_one_cut_token():
  """The check above can fail: cutting the last used position (one real token) moves it."""
  from flax import nnx
  full = _batch(pack=False)
  used_len = int(np.nonzero((np.asarray(full.segment_ids) > 0).any(0))[0].max()) + 1
  cut = TrainBatch(**{f.name: getattr(full, f.name) if f.name == "seq_valid" or
                      getattr(full, f.name) is None else np.asarray(getattr(full, f.name))[
                          :, :used_len - 1] for f in dataclasses.fields(full)})
  graphdef, params = nnx.split(small_model(), nnx.Param)
  kw = dict(graphdef=graphdef, spec=get_loss("grpo"),
            loss_cfg=GRPOConfig(aggregation="token_mean"), cfg=LearnerConfig(loss="grpo"))
  params = nnx.to_pure_dict(params)
  (g_full, m_full), (g_cut, m_cut) = grads(params, full, kw), grads(params, cut, kw)
  lost = float(np.asarray(full.loss_mask)[:, used_len - 1].sum())
  assert lost >= 1 and float(m_cut["loss"][1]) == float(m_full["loss"][1]) - lost  # token count
  assert not np.isclose(float(m_cut["loss"][0]), float(m_full["loss"][0]), rtol=1e-5)
  assert not all(np.allclose(b, a, rtol=1e-4, atol=1e-7)
                 for a, b in zip(jax.tree.leaves(g_full), jax.tree.leaves(g_cut)))


def _learner(mesh=None, micro_batches=1, loss_cfg=None):
  cfg = LearnerConfig(loss="grpo", micro_batches=micro_batches,
                      optimizer=OptimizerConfig(learning_rate=1e-2))
  model = small_model() if mesh is None else hf_io.init_model(CFG, 0, mesh)
  return Learner(model, cfg, loss_cfg, mesh=mesh)


def _params(learner):
  return [np.asarray(x) for x in jax.tree.leaves(learner.params)]


def _record_shapes(learner):
  shapes, step = [], learner.step

  def recorded(batch, *a, **k):
    shapes.append(np.shape(batch.input_ids))
    return step(batch, *a, **k)
  learner.step = recorded
  return shapes


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.slow  # > 30 s: CI's slow stage
def test_rl_step_on_a_trimmed_batch_trains_like_the_padded_one(micro_batches):
  mesh = make_mesh(MeshConfig())        # 8 devices, fsdp=8: rows stay multiples of 8 · M
  source = FixedSource(random_trajectories(16, seed=3))
  kw = dict(advantage=AdvantageConfig(), step=0, version=0)
  out, shapes = {}, {}
  for trim in (False, True):
    learner = _learner(mesh, micro_batches)
    assert learner.row_multiple == 8 * micro_batches
    shapes[trim] = _record_shapes(learner)
    cfg = dataclasses.replace(FULL, rows=64, trim=trim)
    out[trim] = (rl_step(learner, source, batch_cfg=cfg, **kw).metrics, _params(learner))
  assert shapes[False] == [(64, 40)]
  assert shapes[True] == [(16, 16)]        # 16 sequences of <= 15 positions, one per row
  for k in ("loss", "pg_loss", "nll", "grad_norm", "tokens"):
    np.testing.assert_allclose(out[True][0][k], out[False][0][k], rtol=1e-5, err_msg=k)
  # Adam turns a ~1e-9 gradient difference into ~1e-6 of one 1e-2 step where a gradient is ~0
  for a, b in zip(out[False][1], out[True][1]):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)


_AGREE_WORKER = r"""
import sys
import jax
from posttrain_jax import sharding
sharding.initialize_distributed()
from posttrain_jax import batching
from posttrain_jax.multihost import max_over_processes
from tests.support.learner import random_trajectories
n = [3, 14][jax.process_index()]           # process 1 holds more, and longer, sequences
trajs = random_trajectories(n, seed=jax.process_index(), max_completion=4 + 12 * jax.process_index())
cfg = batching.BatchConfig(rows=32, seq_len=40, max_seqs=32, pack=False)
batch = batching.build_batch(trajs, [0.0] * n, cfg)
own = batching.fit_shape(batch, 4).input_ids.shape
agreed = batching.fit_shape(batch, 4, agree=max_over_processes).input_ids.shape
print(f"own={own} agreed={agreed}")
"""


def test_every_process_cuts_to_the_same_shape(tmp_path):
  outs = run_processes(_AGREE_WORKER, tmp_path, processes=2, devices=2)
  got = [o.strip().splitlines()[-1] for o in outs]
  own = [ast.literal_eval(line.split("own=")[1].split(" agreed=")[0]) for line in got]
  agreed = [ast.literal_eval(line.split("agreed=")[1]) for line in got]
  assert own[0] != own[1]                 # alone, the two would feed the step different shapes
  want = tuple(max(a[i] for a in own) for i in range(2))
  assert agreed == [want, want], got


def _of_length(n, length, seed=0):
  """n graded trajectories of `length` tokens (one prompt token; groups of 4, mixed rewards)."""
  rng = np.random.default_rng(seed)
  return [Trajectory(id=f"t{i}", task_id=f"task{i // 4}", group_id=f"g{i // 4}",
                     token_ids=rng.integers(0, VOCAB, length).tolist(),
                     loss_mask=[0] + [1] * (length - 1),
                     behaviour_logprobs=[0.0] + (-rng.random(length - 1) - 1).tolist(),
                     policy_version=[-1] + [0] * (length - 1), reward=float(i % 2))
          for i in range(n)]


def _count_step_compiles(learner):
  """A list that gets one entry per XLA compile made while the jitted train step is called
  (jax.monitoring's backend-compile event; a cache hit compiles nothing)."""
  compiles, inside, step = [], [False], learner._step

  def listener(event, duration, **kw):
    if event == "/jax/core/compile/backend_compile_duration" and inside[0]:
      compiles.append(duration)

  def counted(*a, **k):
    inside[0] = True
    try:
      return step(*a, **k)
    finally:
      inside[0] = False
  jax.monitoring.register_event_duration_secs_listener(listener)
  learner._step = counted
  return compiles, lambda: jax.monitoring.unregister_event_duration_listener(listener)


@pytest.mark.slow  # > 30 s: CI's slow stage
def test_bucketing_bounds_the_train_steps_compiles():
  """Eight batches of eight different used shapes compile the train step four times (one per
  bucket); untrimmed, one shape and one compile."""
  mesh = make_mesh(MeshConfig())        # row_multiple 8
  steps = [(5, 10), (8, 14), (7, 17), (12, 11), (16, 16), (10, 20), (14, 25), (6, 22)]
  raw = {(n, length - 1) for n, length in steps}
  assert len(raw) == len(steps)
  for trim in (True, False):
    learner = _learner(mesh)
    shapes = _record_shapes(learner)
    compiles, stop = _count_step_compiles(learner)
    cfg = dataclasses.replace(FULL, rows=32, trim=trim)
    try:
      for v, (n, length) in enumerate(steps):
        assert not rl_step(learner, FixedSource(_of_length(n, length, seed=v)), step=v, version=v,
                           advantage=AdvantageConfig(),
                           batch_cfg=cfg).metrics["skipped_update"]
    finally:
      stop()
    want = {(8, 16), (16, 16), (16, 24), (8, 24)} if trim else {(32, 40)}
    assert set(shapes) == want
    assert len(compiles) == len(want), (trim, shapes)


@pytest.mark.slow  # > 30 s: CI's slow stage
def test_report_only_reference_every_kl_every_versions_changes_only_when_kl_is_logged(tmp_path):
  source = FixedSource(random_trajectories(8, seed=4))
  cfg = dataclasses.replace(FULL, rows=8)
  out = {}
  for every in (1, 2):
    learner = _learner()
    reference = jax.tree.map(lambda x: np.array(x) * 0.9, learner.params)
    calls, logprobs = [], learner.logprobs
    learner.logprobs = lambda b, p=None, logprobs=logprobs: calls.append(1) or logprobs(b, p)
    m = [rl_step(learner, source, step=v, version=v, advantage=AdvantageConfig(),
                 batch_cfg=cfg, reference=reference, kl_every=every).metrics for v in range(4)]
    out[every] = (m, _params(learner), len(calls))
  (m1, p1, n1), (m2, p2, n2) = out[1], out[2]
  assert n1 == 4 and n2 == 2
  assert ["kl" in m for m in m1] == [True] * 4 and ["kl" in m for m in m2] == [True, False] * 2
  assert m2[2]["kl"] == m1[2]["kl"] and m1[2]["kl"] > 0
  for a, b in zip(m1, m2):
    assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
  for a, b in zip(p1, p2):
    np.testing.assert_array_equal(a, b)
  # its consumers: metrics.jsonl has no kl (not 0) on the other rows; the plot draws the
  # measured points only (audit.py reads no kl)
  writer = MetricsWriter(tmp_path, tensorboard=False)
  for v, m in enumerate(m2):
    writer.write(v, m)
  writer.close()
  rows = read_metrics(tmp_path / "metrics.jsonl")
  assert [r.get("kl") for r in rows] == [m2[0]["kl"], None, m2[2]["kl"], None]
  import matplotlib.pyplot as plt
  figs, close = [], plt.close
  plt.close = lambda fig=None: figs.append(fig)
  try:
    plot_run(rows, tmp_path / "plot.png")
  finally:
    plt.close = close
  (kl_axes,) = [ax for ax in figs[0].axes if ax.get_ylabel() == "KL to reference"]
  x, y = kl_axes.lines[0].get_data()
  assert list(x) == [0, 2] and list(y) == [m2[0]["kl"], m2[2]["kl"]]
  close(figs[0])
  # a loss that needs the reference gets it every step, whatever kl_every says
  needy = _learner(loss_cfg=GRPOConfig(kl_coef=0.1))
  for v in range(3):
    m = rl_step(needy, source, step=v, version=v, advantage=AdvantageConfig(), batch_cfg=cfg,
                reference=reference, kl_every=2).metrics
    assert "kl" in m


def test_shape_reuse_picks_the_smallest_compiled_cover_and_rebuys_a_recurring_shape():
  s = batching.ShapeReuse(slack=2.0, rebuy_after=2)
  got = [s.choose(o) for o in [(8, 48), (7, 48), (5, 48), (8, 56), (7, 64), (3, 40), (7, 48),
                                (7, 48)]]
  assert got == [(8, 48), (8, 48), (8, 48),   # fewer rows run in the compiled (8, 48)
                 (8, 56),                     # longer: a new program
                 (8, 64),                     # new length: at the most rows compiled (8)
                 (3, 40),                     # (8, 48) would be 3.2x its positions: its own
                 (8, 48),                     # (7, 48)'s second padded run ...
                 (7, 48)]                     # ... and its third: it came back, so compiled
  assert s.metrics() == {"batch/shapes_compiled": 5.0, "batch/shape_padding_frac": 0.0}
  resumed = batching.ShapeReuse(slack=2.0, rebuy_after=2, state=s.state())
  for o in [(5, 48), (2, 40), (8, 60), (4, 20)]:
    assert resumed.choose(o) == s.choose(o), o
  never = batching.ShapeReuse(slack=1.0)
  assert [never.choose(o) for o in [(8, 48), (7, 48)]] == [(8, 48), (7, 48)]


def test_reused_shapes_train_like_own_buckets_with_fewer_compiles():
  """Six steps whose trimmed shapes are six buckets: with ShapeReuse two programs (the fewer
  rows run padded in a compiled shape), the same losses and weights as their own buckets."""
  steps = [(8, 10), (5, 10), (7, 10), (6, 10), (8, 20), (7, 20)]
  cfg = dataclasses.replace(FULL, rows=8, max_seqs=8, trim=True)
  runs = {}
  for reuse in (False, True):
    learner = _learner()
    shapes = _record_shapes(learner)
    compiles, stop = _count_step_compiles(learner)
    policy = batching.ShapeReuse() if reuse else None
    try:
      m = [rl_step(learner, FixedSource(_of_length(n, length, seed=v)), step=v, version=v,
                   advantage=AdvantageConfig(), batch_cfg=cfg, shapes=policy).metrics
           for v, (n, length) in enumerate(steps)]
    finally:
      stop()
    runs[reuse] = (m, _params(learner), shapes, len(compiles))
  (m0, p0, s0, c0), (m1, p1, s1, c1) = runs[False], runs[True]
  assert s0 == [(8, 16), (5, 16), (7, 16), (6, 16), (8, 24), (7, 24)] and c0 == 6
  assert s1 == [(8, 16)] * 4 + [(8, 24)] * 2 and c1 == 2
  assert m1[-1]["batch/shapes_compiled"] == 2 and m1[1]["batch/shape_padding_frac"] == 3 / 8
  for a, b in zip(m0, m1):
    for k in ("loss", "pg_loss", "grad_norm", "tokens"):
      np.testing.assert_allclose(b[k], a[k], rtol=1e-5, err_msg=k)
  for a, b in zip(p0, p1):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
