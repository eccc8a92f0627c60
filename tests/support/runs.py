"""Run configs the tests share: `tiny_run(workdir, **overrides)` (a tiny model, SFT then GRPO on
1-digit addition, seconds on a CPU) and its variants, the final weights of a run, configs/*.py
loaded as launch/train.py loads them."""
import pathlib

import numpy as np
from ml_collections.config_flags.config_flags import ConfigFileFlagParser

from posttrain_jax.models.safetensors_io import Checkpoint
from posttrain_jax.run_config import RunConfig, run_config_from_dict

ROOT = pathlib.Path(__file__).resolve().parents[2]


def tiny_run(workdir, **over):
  d = {
      "workdir": str(workdir), "seed": 3,
      "model": {"tiny": {"vocab_size": 320, "hidden_size": 32, "intermediate_size": 64,
                         "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8,
                         "corpus_lines": 500}},
      "tasks": {"generator_config": {"max_digits": 1, "ops": "+", "allow_negative": False},
                "eval_fraction": 0.2, "eval_size": 8},
      "sft": {"steps": 2, "batch_size": 8, "batch": {"rows": 8, "seq_len": 32, "max_seqs": 8, "pack": False},
              "learner": {"loss": "sft", "optimizer": {"learning_rate": 1e-3}}},
      "rl": {"steps": 4, "prompts_per_step": 2, "rollout": {"group_size": 4, "max_tokens": 4},
             "learner": {"loss": "grpo", "optimizer": {"learning_rate": 1e-3}},
             "batch": {"rows": 8, "seq_len": 32, "max_seqs": 8, "pack": False}},
      # eval shares the rollout's sampler shape (8 rows, same SamplingParams): no extra compile
      "eval": {"every_steps": 2, "samples_per_prompt": 1, "max_tokens": 4, "greedy": False},
      "checkpoint": {"every_steps": 3},
  }
  for k, v in over.items():
    d[k] = v
  return run_config_from_dict(d)


def final_weights(path):
  ck = Checkpoint(path)
  return {n: np.array(a) for n, a in ck.items()}


G, P = 4, 2


def async_run(workdir, **over):
  return tiny_run(
      workdir, sft={"steps": 0},
      rl={"mode": "async", "steps": 5, "prompts_per_step": P,
          "replay": {"max_staleness": 1, "capacity": 8},
          "pool": {"concurrency": 2, "tasks_per_episode": 1},
          "retry": {"max_retries": 0, "max_requeues": 0},
          "rollout": {"group_size": G, "max_tokens": 4},
          "learner": {"loss": "grpo", "optimizer": {"learning_rate": 1e-3}},
          "loss": {"correction": "tis"},
          "batch": {"rows": 8, "seq_len": 32, "max_seqs": 8, "pack": False}},
      eval={"every_steps": 0, "samples_per_prompt": 1, "max_tokens": 4, "greedy": False},
      checkpoint={"every_steps": 2}, **over)


QUIET = dict(log=lambda *_: None)


def running_run(workdir, **over):
  """One sample per prompt, a running per-task baseline, a tiny task space (tasks repeat)."""
  return tiny_run(
      workdir, sft={"steps": 0},
      tasks={"generator_config": {"max_digits": 1, "ops": "+", "allow_negative": False},
             "eval_fraction": 0.2, "eval_size": 8},
      rl={"steps": 6, "prompts_per_step": 8, "reference_kl": False,
          "rollout": {"group_size": 1, "max_tokens": 4},
          "advantage": {"estimator": "running", "baseline_rate": 0.5},
          "learner": {"loss": "grpo", "optimizer": {"learning_rate": 1e-3}},
          "batch": {"rows": 8, "seq_len": 32, "max_seqs": 8, "pack": False}},
      checkpoint={"every_steps": 3}, **over)


def distill_run(workdir, grader="hidden_rule", **rl):
  return run_config_from_dict({
      "workdir": str(workdir), "seed": 0, "grader": grader,
      "model": {"tiny": {"vocab_size": 320, "hidden_size": 32, "intermediate_size": 64,
                         "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8,
                         "corpus_lines": 500}},
      "tasks": {"source": "synthetic", "generator": "string_rule", "eval_fraction": 0.2,
                "eval_size": 4, "generator_config": {"stated_frac": 0.0}},
      "rl": {"steps": 2, "prompts_per_step": 4, "rollout": {"group_size": 1, "max_tokens": 4},
             "advantage": {"estimator": "running"},
             "learner": {"loss": "sampled_distill", "optimizer": {"learning_rate": 1e-3}},
             "teacher": {"template": "{context} | {prompt}", "feedback_template": "{text}",
                         "seq_len": 48},
             "batch": {"rows": 8, "seq_len": 32, "max_seqs": 8, "pack": False}, **rl},
      "eval": {"every_steps": 0, "samples_per_prompt": 1, "max_tokens": 4, "greedy": False},
      "checkpoint": {"every_steps": 1},
  })


def load_config(name: str, **over) -> RunConfig:
  raw = ConfigFileFlagParser(name="config").parse(str(ROOT / "configs" / name)).to_dict()
  for path, value in over.items():
    node = raw
    *parents, leaf = path.split(".")
    for key in parents:
      node = node[key]
    node[leaf] = value
  return run_config_from_dict(raw)

