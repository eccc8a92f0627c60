"""An EMA teacher on a LoRA learner averages the adapters alone: its state (and its checkpoint
item) are the adapters' shapes, it scores with the learner's own frozen base (no copy), its
average follows a float64 numpy EMA of the adapters, and a save/restore continues it bit for bit."""
import jax
import numpy as np

from posttrain_jax import batching
from posttrain_jax import learner as L
from posttrain_jax.checkpoint import Checkpointer
from posttrain_jax.models import lora
from posttrain_jax.teacher import SelfTeacher, TeacherConfig, TeacherStart
from tests.support.learner import random_trajectories, small_model
from tests.support.teacher import encode

RATE = 0.5


def _learner():
  return L.Learner(small_model(), L.LearnerConfig(
      loss="sft", lora=lora.LoRAConfig(rank=4, alpha=8.0),
      optimizer=L.OptimizerConfig(learning_rate=3e-2)))


def _ema(learner, restored=None):
  ctx = TeacherStart(learner, learner.adapters_off, lambda name: restored, None)
  return SelfTeacher.start(TeacherConfig(weights="ema", ema_rate=RATE), encode,
                           batching.BatchConfig(), ctx)


def _host(tree):
  return [np.asarray(x, np.float64) for x in jax.tree.leaves(jax.device_get(tree))]


def test_a_lora_ema_teacher_averages_the_adapters_only_and_resumes_bit_for_bit(tmp_path):
  learner = _learner()
  batch = batching.build_batch(random_trajectories(8), [0.0] * 8,
                               batching.BatchConfig(rows=4, seq_len=40, max_seqs=8))
  teacher = _ema(learner)
  saved = teacher.saved()["teacher"]
  shapes = lambda t: [(jax.tree_util.keystr(p), x.shape)   # noqa: E731
                      for p, x in jax.tree.leaves_with_path(t)]
  assert shapes(saved) == shapes(learner.state.params)      # the adapters' shapes, nothing else
  assert all(p.endswith(("['lora_a']", "['lora_b']")) for p, _ in shapes(saved))
  nbytes = lambda t: sum(x.nbytes for x in jax.tree.leaves(t))   # noqa: E731
  assert nbytes(saved) < nbytes(learner.frozen) / 4
  joined = teacher.params(learner)
  base_leaves = {id(x) for x in jax.tree.leaves(learner.frozen)}
  assert base_leaves <= {id(x) for x in jax.tree.leaves(joined)}   # the base itself, no copy
  # the start: the learner's fresh adapters (a copy), which score as the base does
  np.testing.assert_array_equal(np.concatenate([x.ravel() for x in _host(saved)]),
                                np.concatenate([x.ravel() for x in _host(learner.state.params)]))
  np.testing.assert_allclose(learner.logprobs(batch, joined), learner.logprobs(batch), atol=2e-6)

  want = _host(saved)                                       # float64 numpy EMA of the adapters
  for _ in range(2):
    learner.step(batch)
    teacher.after_update(learner)
    want = [t + RATE * (p - t) for t, p in zip(want, _host(learner.state.params))]
  for got, w in zip(_host(teacher.saved()["teacher"]), want):
    np.testing.assert_allclose(got, w, rtol=1e-6, atol=1e-7)
  assert max(np.abs(w).max() for w in want[1::2]) > 1e-3   # the B's moved off zero
  # it scores with the averaged adapters: neither the base nor the student
  t_logp = learner.logprobs(batch, teacher.params(learner))
  assert np.abs(t_logp - learner.logprobs(batch)).max() > 1e-4
  assert np.abs(t_logp - learner.logprobs(batch, learner.adapters_off())).max() > 1e-4

  ckpt = Checkpointer(tmp_path / "ckpt")
  ckpt.save(2, learner.state, {}, arrays=teacher.saved())
  ckpt.wait()
  restored = ckpt.restore_arrays("teacher", learner.state.params, 2)  # as run/parts.py does
  resumed = _ema(learner, restored=restored)
  for t in (teacher, resumed):
    t.after_update(learner)
  for a, b in zip(_host(teacher.saved()["teacher"]), _host(resumed.saved()["teacher"])):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(learner.logprobs(batch, resumed.params(learner)),
                                learner.logprobs(batch, teacher.params(learner)))
  ckpt.close()

