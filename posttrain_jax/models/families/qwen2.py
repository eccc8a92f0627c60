"""Qwen2 (2.5): bias on q/k/v always (HF's Qwen2 ignores `attention_bias`), none on the
output projection or the MLP; no q/k norm."""
from posttrain_jax.models.families import ModelFamily, register_family


def _from_hf(hf: dict) -> dict:
  return dict(qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False)


def _to_hf(cfg) -> dict:
  return {"use_sliding_window": False}


QWEN2 = register_family(ModelFamily(
    name="qwen2", architectures=("Qwen2ForCausalLM",), from_hf=_from_hf, to_hf=_to_hf))
