"""A LoRA learner's exports: merged into a plain HF directory, and the adapters alone in PEFT's
format; transformers (+ peft) load each and give our merged model's logits."""
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain_jax import batching
from posttrain_jax import learner as L
from posttrain_jax.models import hf_io, lora, peft_io
from posttrain_jax.models.safetensors_io import SafetensorsFile
from tests.support.hf import VOCAB, hf_logits, save_random_hf_model
from tests.support.learner import random_trajectories, small_model

peft = pytest.importorskip("peft")
LORA = lora.LoRAConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "o_proj", "up_proj",
                                                         "down_proj"))


def test_merged_and_peft_exports_load_in_transformers(tmp_path):
  """Llama-style (biases, untied head): train the adapters a few steps, export both ways."""
  save_random_hf_model("llama", tmp_path / "base")
  learner = L.Learner(hf_io.load_hf_model(tmp_path / "base"), L.LearnerConfig(
      loss="sft", lora=LORA, optimizer=L.OptimizerConfig(learning_rate=3e-2)))
  batch = batching.build_batch(random_trajectories(8), [0.0] * 8,
                               batching.BatchConfig(rows=4, seq_len=40, max_seqs=8))
  for _ in range(3):
    learner.step(batch)
  adapted = learner.model()
  hf_io.save_hf_model(adapted, tmp_path / "merged")
  peft_io.save_peft_adapter(adapted, tmp_path / "adapter", alpha=LORA.alpha,
                            base_model_name_or_path=str(tmp_path / "base"))

  ids = np.random.default_rng(0).integers(0, VOCAB, (2, 11))
  merged = lora.merged(adapted)
  assert not lora.has_adapters(merged) and lora.has_adapters(adapted)
  ours = np.asarray(merged.logits(merged(jnp.asarray(ids), jnp.broadcast_to(jnp.arange(11),
                                                                             ids.shape))[0]))
  base_hf = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
  assert np.abs(hf_logits(base_hf, ids) - ours).max() > 1e-2     # the adapters changed the model

  merged_hf = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
  assert np.abs(hf_logits(merged_hf, ids) - ours).max() <= 1e-4

  config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
  assert {k: config[k] for k in ("peft_type", "task_type", "r", "lora_alpha")} == {
      "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8.0}
  assert config["target_modules"] == sorted(LORA.target_modules)
  assert config["base_model_name_or_path"] == str(tmp_path / "base")
  f = SafetensorsFile(tmp_path / "adapter" / "adapter_model.safetensors")
  assert len(f.names()) == 2 * 2 * 5
  assert f.shape("base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight") == (4, 48)
  assert f.shape("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight") == (48, 4)
  np.testing.assert_array_equal(   # B^T, as stored
      f.get("base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"),
      np.asarray(learner.state.params["layers"][0]["self_attn"]["v_proj"]["lora_b"]).T)

  with_adapter = peft.PeftModel.from_pretrained(base_hf, tmp_path / "adapter").eval()
  assert np.abs(hf_logits(with_adapter, ids) - ours).max() <= 1e-4


def test_peft_target_modules_name_paths_when_layers_differ():
  model = small_model()
  cfg = lora.LoRAConfig(rank=2, target_modules=("layers.1.self_attn.q_proj",))
  learner = L.Learner(model, L.LearnerConfig(loss="sft", lora=cfg))
  config = peft_io.adapter_config(learner.model(), alpha=cfg.alpha)
  assert config["target_modules"] == ["model.layers.1.self_attn.q_proj"]
  with pytest.raises(ValueError, match="carries no LoRA adapters"):
    peft_io.adapter_config(model, alpha=1.0)
