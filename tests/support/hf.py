"""Shared helpers: small random HF torch models saved with save_pretrained."""
import numpy as np
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)

VOCAB = 97
_COMMON = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
               num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256)

FAMILIES = {
    # Llama 3.1-style: llama3 RoPE scaling, biases everywhere, untied head.
    "llama": lambda: LlamaForCausalLM(LlamaConfig(
        **_COMMON, attention_bias=True, mlp_bias=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64})),
    # Qwen2.5-style: qkv bias (always), tied embeddings.
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**_COMMON, tie_word_embeddings=True)),
    # Qwen3: q/k norm, explicit head_dim != hidden/heads.
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**_COMMON, head_dim=16)),
}


def save_random_hf_model(family: str, path, seed: int = 0):
  """A random transformers model (weights perturbed so norms/biases are not trivial)."""
  torch.manual_seed(seed)
  model = FAMILIES[family]().eval()
  with torch.no_grad():
    for p in model.parameters():
      p.add_(torch.randn_like(p) * 0.05)
  model.save_pretrained(path)
  return model


def hf_logits(model, ids: np.ndarray, attention_mask: np.ndarray | None = None,
              position_ids: np.ndarray | None = None) -> np.ndarray:
  kw = {}
  if attention_mask is not None:
    kw["attention_mask"] = torch.tensor(attention_mask)
  if position_ids is not None:
    kw["position_ids"] = torch.tensor(position_ids)
  with torch.no_grad():
    return model(torch.tensor(ids), **kw).logits.float().numpy()
