"""Tiny-model factory: deterministic, cached, loadable by transformers and by us."""
import hashlib

import numpy as np
import jax.numpy as jnp
import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain_jax.models import families, hf_io
from posttrain_jax.models.tiny import TinyModelConfig, build_tiny_model

SMALL = TinyModelConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=8, corpus_lines=500)


def _digest(path):
  return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_deterministic_from_seed(tmp_path):
  a = build_tiny_model(SMALL, out_dir=tmp_path / "a")
  b = build_tiny_model(SMALL, out_dir=tmp_path / "b")
  assert _digest(a) == _digest(b)
  c = build_tiny_model(TinyModelConfig(**{**SMALL.__dict__, "seed": 1}), out_dir=tmp_path / "c")
  assert _digest(c)["model.safetensors"] != _digest(a)["model.safetensors"]


def test_cache_hit_does_not_rebuild(tmp_path):
  first = build_tiny_model(SMALL, cache_root=tmp_path)
  stamp = (first / "model.safetensors").stat().st_mtime_ns
  again = build_tiny_model(SMALL, cache_root=tmp_path)
  assert again == first and (again / "model.safetensors").stat().st_mtime_ns == stamp
  other = build_tiny_model(TinyModelConfig(**{**SMALL.__dict__, "family": "llama"}), cache_root=tmp_path)
  assert other != first


@pytest.mark.parametrize("family", families.names())
def test_loads_in_transformers_and_ours(family, tmp_path):
  path = build_tiny_model(TinyModelConfig(**{**SMALL.__dict__, "family": family}), cache_root=tmp_path)
  tok = hf_io.load_tokenizer(path)
  text = tok.apply_chat_template([{"role": "user", "content": "What is 12+345?"}],
                                 add_generation_prompt=True, tokenize=False)
  assert text == "<|im_start|>user\nWhat is 12+345?<|im_end|>\n<|im_start|>assistant\n"
  ids = tok(text)["input_ids"]
  pieces = tok.convert_ids_to_tokens(ids)
  assert all(p in pieces for p in "12345")  # digits are single tokens
  assert tok.decode(ids) == text
  hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
  ours = hf_io.load_hf_model(path)
  x = np.array([ids])
  with torch.no_grad():
    ref = hf(torch.tensor(x)).logits.numpy()
  h, _ = ours(jnp.asarray(x), jnp.arange(x.shape[1])[None])
  assert np.abs(np.asarray(ours.logits(h)) - ref).max() <= 1e-4
  assert ours.cfg.eos_token_id == (tok.convert_tokens_to_ids("<|im_end|>"),
                                   tok.convert_tokens_to_ids("<|endoftext|>"))


def test_given_weights(tmp_path):
  base = build_tiny_model(SMALL, out_dir=tmp_path / "base")
  model = hf_io.load_hf_model(base)
  model.norm.scale[...] = model.norm.scale[...] * 3.0
  path = build_tiny_model(SMALL, cache_root=tmp_path / "cache", weights=model)
  back = hf_io.load_hf_model(path)
  np.testing.assert_array_equal(np.asarray(back.norm.scale[...]), np.full(32, 3.0, np.float32))
