"""Published architectures: the `config.json` fields of released checkpoints, by name.

What a check that needs no weights (the AOT memory check, `launch/aot_check.py`) reads instead of
a model directory: each entry is the architecture part of the checkpoint's HF `config.json`,
read through the same `from_hf_dict` as a real directory (so it is validated like one). Token
ids and dtypes are left out: they do not change shapes. Parameter counts follow from the
numbers (`ModelConfig.num_params`):

    N = V·D·(2 − tied) + L·(2·D·H·hd + 2·D·KV·hd + 3·D·F + 2·D [+ 2·hd q/k norms]) + D

Sources (each value below was checked against it, not written from memory):
  qwen3-0.6b   huggingface.co/TensorStack/TextEncoder/blob/main/Qwen-3-06B/config.json (a copy of
               Qwen/Qwen3-0.6B's config.json, transformers 4.51.0); the same numbers are quoted
               from huggingface.co/Qwen/Qwen3-0.6B/raw/main/config.json in public code
  qwen3-1.7b   github.com/zyzshishui/slime scripts/models/qwen3-1.7B.sh (Megatron arguments:
               28 layers, hidden 2048, ffn 6144, 16 heads, 8 query groups, kv-channels 128,
               rotary base 1e6, vocab 151936, qk-layernorm) and a public test fixture of
               Qwen/Qwen3-1.7B's config.json (tie_word_embeddings true); levanter's qwen3_1_7b
  qwen3-4b     huggingface.co/MultiRL/qwen3_4b_instruct_sft/blob/main/config.json (Qwen3-4B's
               architecture, transformers 4.51.0: rope_theta 1e6, 40960 positions, tied). Not
               Qwen3-4B-Instruct-2507, whose rope_theta is 5e6 and context 262144
  qwen3-8b     huggingface.co/thejaminator/qwen-hook-layer-9/commit/478fb720 ("Copy config.json
               from Qwen/Qwen3-8B")
  llama3.2-1b  huggingface.co/Emm9625/Llama-3.2-1B-chatml/blob/main/config.json (duplicated from
               unsloth/Llama-3.2-1B, _name_or_path meta-llama/Llama-3.2-1B); the Instruct
               model has the same architecture
  llama3.2-3b  github.com/citsjtu2020/LLM-Prof sglang/Model_Config.md ("Llama-3.2-3B")
"""
from __future__ import annotations

from posttrain_jax.models.config import ConfigError, ModelConfig, from_hf_dict

_QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_act="silu",
              head_dim=128, vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1000000,
              rope_scaling=None, attention_bias=False, max_position_embeddings=40960,
              sliding_window=None, use_sliding_window=False)
_LLAMA32 = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
                vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
                attention_bias=False, mlp_bias=False, max_position_embeddings=131072,
                tie_word_embeddings=True,
                rope_scaling=dict(factor=32.0, high_freq_factor=4.0, low_freq_factor=1.0,
                                  original_max_position_embeddings=8192, rope_type="llama3"))

ARCHITECTURES: dict[str, dict] = {
    "qwen3-0.6b": dict(_QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-1.7b": dict(_QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-4b": dict(_QWEN3, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-8b": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    "llama3.2-1b": dict(_LLAMA32, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=64),
    "llama3.2-3b": dict(_LLAMA32, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                        num_attention_heads=24, num_key_value_heads=8, head_dim=128),
}


def names() -> list[str]:
  return sorted(ARCHITECTURES)


def hf_config(name: str) -> dict:
  """The `config.json` dict of architecture `name` (a copy)."""
  if name not in ARCHITECTURES:
    raise ConfigError(f"model.arch={name!r} is not a published architecture we know; known: "
                      f"{', '.join(names())}")
  return dict(ARCHITECTURES[name])


def model_config(name: str, **overrides) -> ModelConfig:
  """The ModelConfig of architecture `name` (overrides: param_dtype, compute_dtype, remat)."""
  return from_hf_dict(hf_config(name), f"architecture {name!r}", **overrides)


__all__ = ["ARCHITECTURES", "names", "hf_config", "model_config"]
