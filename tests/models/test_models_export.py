"""Export -> transformers loads it -> same logits; sharded-index checkpoints; KV cache decoding."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain_jax.models import decoder, hf_io
from tests.support.hf import FAMILIES, VOCAB, hf_logits, save_random_hf_model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_export_roundtrip_through_transformers(family, tmp_path):
  save_random_hf_model(family, tmp_path / "src")
  ours = hf_io.load_hf_model(tmp_path / "src")
  hf_io.save_hf_model(ours, tmp_path / "out", max_shard_bytes=40_000)  # forces several shards
  index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
  assert len(set(index["weight_map"].values())) > 1
  reloaded_hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
  ids = np.random.default_rng(0).integers(0, VOCAB, (2, 10))
  hidden, _ = ours(jnp.asarray(ids), jnp.broadcast_to(jnp.arange(10), ids.shape))
  assert np.abs(np.asarray(ours.logits(hidden)) - hf_logits(reloaded_hf, ids)).max() <= 1e-4
  again = hf_io.load_hf_model(tmp_path / "out")  # our loader reads the sharded index too
  for (n1, a1), (n2, a2) in zip(hf_io.hf_tensors(ours), hf_io.hf_tensors(again)):
    assert n1 == n2
    np.testing.assert_array_equal(a1, a2)


def test_bf16_export_and_load(tmp_path):
  save_random_hf_model("qwen3", tmp_path / "src")
  ours = hf_io.load_hf_model(tmp_path / "src")
  hf_io.save_hf_model(ours, tmp_path / "bf16", dtype="bfloat16")
  assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
  hf = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
  assert next(hf.parameters()).dtype == torch.bfloat16
  back = hf_io.load_hf_model(tmp_path / "bf16", param_dtype="bfloat16")
  assert back.layers[0].mlp.up_proj.kernel[...].dtype == jnp.bfloat16
  a = np.asarray(ours.layers[0].mlp.up_proj.kernel[...])
  b = np.asarray(back.layers[0].mlp.up_proj.kernel[...]).astype(np.float32)
  assert np.abs(a - b).max() <= np.abs(a).max() * 2 ** -8
  # Default: float32 master weights, the bf16 values upcast exactly.
  master = hf_io.load_hf_model(tmp_path / "bf16")
  np.testing.assert_array_equal(np.asarray(master.layers[0].mlp.up_proj.kernel[...]), b)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_kv_cache_decoding_equals_full_forward(family, tmp_path):
  """Left-padded prompts, prefill + one token at a time == one full forward."""
  save_random_hf_model(family, tmp_path)
  model = hf_io.load_hf_model(tmp_path)
  rng = np.random.default_rng(0)
  b, prompt, steps = 3, 6, 5
  ids = rng.integers(0, VOCAB, (b, prompt + steps))
  seg = np.ones_like(ids)
  seg[1, :2] = 0  # row 1 has a 4-token prompt, left-padded
  seg[2, :5] = 0
  pos = np.maximum(np.cumsum(seg, axis=1) - 1, 0)
  full_h, _ = model(jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(seg))
  full = np.asarray(model.logits(full_h))

  step = jax.jit(lambda c, i, p, s: model(i, p, s, c))
  cache = decoder.init_cache(model.cfg, b, prompt + steps + 3)
  h, cache = step(cache, jnp.asarray(ids[:, :prompt]), jnp.asarray(pos[:, :prompt]),
                  jnp.asarray(seg[:, :prompt]))
  got = [np.asarray(model.logits(h))]
  for t in range(prompt, prompt + steps):
    h, cache = step(cache, jnp.asarray(ids[:, t:t + 1]), jnp.asarray(pos[:, t:t + 1]),
                    jnp.asarray(seg[:, t:t + 1]))
    got.append(np.asarray(model.logits(h)))
  got = np.concatenate(got, axis=1)
  m = seg.astype(bool)
  assert np.abs(got[m] - full[m]).max() <= 1e-4
  assert int(cache.index) == prompt + steps


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_files_are_filled_greedily_up_to_max_shard_bytes(dtype, tmp_path):
  """The file plan is made from shapes before any tensor is gathered: it must be the greedy
  split of the tensors as written (in the export dtype), each file within the limit unless a
  lone tensor exceeds it."""
  from tests.support.learner import small_model
  model, limit = small_model(), 9_000
  hf_io.save_hf_model(model, tmp_path / "m", dtype=dtype, max_shard_bytes=limit)
  index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
  want, size = [[]], 0
  for name, arr in hf_io.hf_tensors(model, dtype):
    if want[-1] and size + arr.nbytes > limit:
      want.append([])
      size = 0
    want[-1].append(name)
    size += arr.nbytes
  files = sorted(set(index["weight_map"].values()))
  assert [sorted(n for n, f in index["weight_map"].items() if f == fname) for fname in files] \
      == [sorted(names) for names in want]
  assert index["metadata"]["total_size"] == sum(a.nbytes for _, a in hf_io.hf_tensors(model, dtype))
