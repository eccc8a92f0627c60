"""Llama (3.x): optional biases, set together on q/k/v/o by `attention_bias` and on the MLP
by `mlp_bias`; no q/k norm. RoPE: default, linear or llama3 scaling (shared, rope.py)."""
from posttrain_jax.models.families import ModelFamily, register_family


def _from_hf(hf: dict) -> dict:
  bias = bool(hf.get("attention_bias", False))
  return dict(qkv_bias=bias, o_bias=bias, mlp_bias=bool(hf.get("mlp_bias", False)),
              qk_norm=False)


def _to_hf(cfg) -> dict:
  return {"attention_bias": cfg.qkv_bias, "mlp_bias": cfg.mlp_bias}


LLAMA = register_family(ModelFamily(
    name="llama", architectures=("LlamaForCausalLM",), from_hf=_from_hf, to_hf=_to_hf))
