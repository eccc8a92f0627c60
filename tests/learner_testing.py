"""Helpers for learner tests: a small model and random trajectories."""
import numpy as np

from posttrain_jax.models import hf_io
from posttrain_jax.models.config import ModelConfig
from posttrain_jax.types import Trajectory

VOCAB = 61
CFG = ModelConfig(family="qwen3", vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True,
                  tie_word_embeddings=True)


def small_model(seed=0, **overrides):
  return hf_io.init_model(CFG.replace(**overrides), seed)


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
