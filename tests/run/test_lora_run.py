"""A whole run with LoRA (SFT then GRPO with a KL to the reference): it resumes from an
adapters-only checkpoint bit for bit, and exports plain (merged) HF weights and the adapters
alone (final_adapter/, PEFT) which peft applies to the RL start to give final_model's logits."""
import json

import numpy as np
import pytest

from posttrain_jax.metrics import read_metrics
from posttrain_jax.models.safetensors_io import SafetensorsFile
from posttrain_jax.models.tiny import build_tiny_model
from posttrain_jax.run import Trainer
from tests.support.runs import QUIET, final_weights, tiny_run

LORA = {"rank": 4, "alpha": 8.0}


def _run(workdir, **over):
  return tiny_run(
      workdir,
      sft={"steps": 2, "batch_size": 8, "batch": {"rows": 8, "seq_len": 32, "max_seqs": 8,
                                                  "pack": False},
           "learner": {"loss": "sft", "optimizer": {"learning_rate": 1e-2}, "lora": LORA}},
      rl={"steps": 4, "prompts_per_step": 2, "rollout": {"group_size": 4, "max_tokens": 4},
          "learner": {"loss": "grpo", "optimizer": {"learning_rate": 1e-2}, "lora": LORA},
          "loss": {"kl_coef": 0.1},
          "batch": {"rows": 8, "seq_len": 32, "max_seqs": 8, "pack": False}}, **over)


def _tensors(path):
  f = SafetensorsFile(path)
  return {n: np.array(f.get(n)) for n in f.names()}


@pytest.mark.slow  # > 30 s: CI's slow stage
def test_lora_run_resumes_bit_for_bit_and_exports_merged_weights(tmp_path):
  assert Trainer(_run(tmp_path / "a"), **QUIET).run() is not None
  assert Trainer(_run(tmp_path / "b", stop_after_step=4), **QUIET).run() is None
  assert Trainer(_run(tmp_path / "b"), **QUIET).run() is not None   # resumes from step 3
  a = final_weights(tmp_path / "a" / "final_model")
  b = final_weights(tmp_path / "b" / "final_model")
  assert sorted(a) == sorted(b) and not any("lora" in name for name in a)   # merged, plain
  for name in a:
    np.testing.assert_array_equal(a[name], b[name], err_msg=name)
  sft = final_weights(tmp_path / "a" / "sft_model")   # the SFT adapters, merged
  base = final_weights(build_tiny_model(_run(tmp_path).model.tiny))
  q = "model.layers.0.self_attn.q_proj.weight"
  assert np.abs(sft[q] - base[q]).max() > 1e-4
  np.testing.assert_array_equal(sft["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
  saved = json.loads((tmp_path / "a" / "checkpoints" / "3" / "state" / "_METADATA").read_text())
  params = [k for k in saved["tree_metadata"] if ".params" in k]
  assert params and all("lora_" in k for k in params)   # the RL checkpoint: adapters only
  first_rl = [r for r in read_metrics(tmp_path / "a" / "metrics.jsonl") if "kl" in r][0]
  assert first_rl["step"] == 3 and abs(first_rl["kl"]) < 1e-6   # reference = the start = base
  # final_adapter/: the RL adapters in PEFT's format, the same from the resumed run
  for d in ("a", "b"):
    config = json.loads((tmp_path / d / "final_adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (LORA["rank"], LORA["alpha"])
    assert config["base_model_name_or_path"] == str((tmp_path / d / "sft_model").resolve())
  ad_a, ad_b = (_tensors(tmp_path / d / "final_adapter" / "adapter_model.safetensors")
                for d in ("a", "b"))
  assert sorted(ad_a) == sorted(ad_b) and all(".lora_" in name for name in ad_a)
  for name in ad_a:
    np.testing.assert_array_equal(ad_a[name], ad_b[name], err_msg=name)
  peft = pytest.importorskip("peft")
  import torch
  from transformers import AutoModelForCausalLM
  from tests.support.hf import hf_logits
  load = lambda d: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()  # noqa: E731
  ids = np.random.default_rng(0).integers(3, 200, (2, 12))
  start, final = load(tmp_path / "a" / "sft_model"), load(tmp_path / "a" / "final_model")
  want = hf_logits(final, ids)
  assert np.abs(hf_logits(start, ids) - want).max() > 1e-3     # RL moved the adapters
  adapted = peft.PeftModel.from_pretrained(start, tmp_path / "a" / "final_adapter").eval()
  assert np.abs(hf_logits(adapted, ids) - want).max() <= 1e-4
