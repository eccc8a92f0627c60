"""Helpers for learner tests: a small model, random trajectories, a rollout source that replays
fixed trajectories, and a check that two layouts of the same sequences train alike."""
import copy
import dataclasses

import jax
import numpy as np

from posttrain_jax.learner import LearnerConfig, gradients
from posttrain_jax.losses import get_loss
from posttrain_jax.models import hf_io
from posttrain_jax.models.config import ModelConfig
from posttrain_jax.types import Trajectory

VOCAB = 61
CFG = ModelConfig(family="qwen3", vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True,
                  tie_word_embeddings=True)


def small_model(seed=0, **overrides):
  return hf_io.init_model(CFG.replace(**overrides), seed)


class FixedSource:
  """A rollout source (rl_step's) that returns the same graded trajectories every step."""

  def __init__(self, trajs):
    self.trajs = trajs

  def update_weights(self, params, version):
    pass

  def collect(self, step):
    return [], copy.deepcopy(self.trajs)

  def metrics(self):
    return {}


def random_trajectories(n, seed=0, max_prompt=6, max_completion=9, group=4):
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    p, c = rng.integers(1, max_prompt + 1), rng.integers(1, max_completion + 1)
    ids = rng.integers(0, VOCAB, p + c).tolist()
    out.append(Trajectory(
        id=f"t{i}", task_id=f"task{i // group}", group_id=f"g{i // group}", token_ids=ids,
        loss_mask=[0] * p + [1] * c,
        behaviour_logprobs=[0.0] * p + (-rng.random(c) * 4 - 1).tolist(),
        policy_version=[-1] * p + [0] * c, reward=float(rng.integers(0, 2))))
  return out


def with_scored_fields(batch, seed=0, hidden=CFG.hidden_size):
  """`batch` with every optional field filled as the learner / teacher fill them: values on
  the sampled targets, 0 elsewhere; teacher_hidden is [B, T, D]."""
  rng = np.random.default_rng(seed)
  m = np.asarray(batch.loss_mask)
  logp = lambda: (-rng.random(m.shape) * 3 - 0.1).astype(np.float32) * m
  return dataclasses.replace(
      batch, old_logp=logp(), ref_logp=logp(), teacher_logp=logp(), teacher_mask=m.copy(),
      teacher_hidden=(rng.normal(size=(*m.shape, hidden)) * m[..., None]).astype(np.float32))


def grads(params, batch, kw):
  return jax.jit(lambda p, b: gradients(p, b, **kw))(params, batch)


def assert_same_training(full, small, name, loss_cfg, logprob_impl="auto"):
  """Loss, metrics and gradients of `small` equal `full`'s; returns full's loss."""
  from flax import nnx
  graphdef, params = nnx.split(small_model(), nnx.Param)
  params = nnx.to_pure_dict(params)
  kw = dict(graphdef=graphdef, spec=get_loss(name), loss_cfg=loss_cfg,
            cfg=LearnerConfig(loss=name, logprob_impl=logprob_impl))
  (g_full, m_full), (g_small, m_small) = grads(params, full, kw), grads(params, small, kw)
  assert set(m_small) == set(m_full)
  for k in m_full:
    np.testing.assert_allclose(np.asarray(m_small[k]), np.asarray(m_full[k]), rtol=1e-5,
                               atol=1e-7, err_msg=k)
  for a, b in zip(jax.tree.leaves(g_full), jax.tree.leaves(g_small)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-7)
  return float(m_full["loss"][0])
