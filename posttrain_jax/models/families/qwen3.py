"""Qwen3 (dense): RMSNorm over head_dim on q and k before RoPE; `attention_bias` on
q/k/v/o; no MLP bias."""
from posttrain_jax.models.families import ModelFamily, register_family


def _from_hf(hf: dict) -> dict:
  bias = bool(hf.get("attention_bias", False))
  return dict(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=True)


def _to_hf(cfg) -> dict:
  return {"attention_bias": cfg.qkv_bias, "use_sliding_window": False}


QWEN3 = register_family(ModelFamily(
    name="qwen3", architectures=("Qwen3ForCausalLM",), from_hf=_from_hf, to_hf=_to_hf))
