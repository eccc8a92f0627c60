"""GGUF -> HF weights (models/gguf_io.py) on files written here with the gguf package's own
writer and quantiser: llama.cpp's Q/K row permutation undone exactly (F32: bit-equal to the
weights written), Q8_0/Q4_0/Q4_1/F16 within their quantisation step, and one clear error for
what we cannot read. The real SmolLM2 file against transformers: test_gguf_smollm2.py."""
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from posttrain_jax.models import gguf_io  # noqa: E402

T = gguf.GGMLQuantizationType
HIDDEN, HEADS, KV, HEAD_DIM, INTER, VOCAB, LAYERS = 64, 4, 2, 16, 96, 96, 2


def _llama_cpp_permute(w, n_head):
  """llama.cpp's convert_hf_to_gguf.py `LlamaModel.permute` (HF rows -> GGUF rows)."""
  return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


def _hf_weights(seed=0, tied=True):
  rng = np.random.default_rng(seed)
  w = {"model.embed_tokens.weight": rng.normal(size=(VOCAB, HIDDEN)),
       "model.norm.weight": 1 + 0.1 * rng.normal(size=HIDDEN)}
  if not tied:
    w["lm_head.weight"] = rng.normal(size=(VOCAB, HIDDEN))
  for i in range(LAYERS):
    p = f"model.layers.{i}."
    w.update({p + "input_layernorm.weight": 1 + 0.1 * rng.normal(size=HIDDEN),
              p + "post_attention_layernorm.weight": 1 + 0.1 * rng.normal(size=HIDDEN),
              p + "self_attn.q_proj.weight": rng.normal(size=(HEADS * HEAD_DIM, HIDDEN)),
              p + "self_attn.k_proj.weight": rng.normal(size=(KV * HEAD_DIM, HIDDEN)),
              p + "self_attn.v_proj.weight": rng.normal(size=(KV * HEAD_DIM, HIDDEN)),
              p + "self_attn.o_proj.weight": rng.normal(size=(HIDDEN, HEADS * HEAD_DIM)),
              p + "mlp.gate_proj.weight": rng.normal(size=(INTER, HIDDEN)),
              p + "mlp.up_proj.weight": rng.normal(size=(INTER, HIDDEN)),
              p + "mlp.down_proj.weight": rng.normal(size=(HIDDEN, INTER))})
  return {k: v.astype(np.float32) for k, v in w.items()}


_GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _gguf_name(hf):
  top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
         "output_norm.weight", "lm_head.weight": "output.weight"}
  if hf in top:
    return top[hf]
  _, _, i, *rest = hf.split(".")
  return f"blk.{i}.{_GGUF_NAMES['.'.join(rest[:-1])]}.{rest[-1]}"


def _write(path, weights, qtype=T.F32, arch="llama", extra_kv=None):
  w = gguf.GGUFWriter(str(path), arch)
  w.add_block_count(LAYERS)
  w.add_context_length(256)
  w.add_embedding_length(HIDDEN)
  w.add_feed_forward_length(INTER)
  w.add_head_count(HEADS)
  w.add_head_count_kv(KV)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_rope_freq_base(50000.0)
  w.add_rope_dimension_count(HEAD_DIM)
  w.add_tokenizer_model("gpt2")
  w.add_token_list([f"t{i}" for i in range(VOCAB)])
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)
  for k, v in (extra_kv or {}).items():
    w.add_string(k, v)
  for name, arr in weights.items():
    if name.endswith("q_proj.weight"):
      arr = _llama_cpp_permute(arr, HEADS)
    elif name.endswith("k_proj.weight"):
      arr = _llama_cpp_permute(arr, KV)
    if arr.ndim == 1 or qtype == T.F32:
      w.add_tensor(_gguf_name(name), arr)
    elif qtype == T.F16:
      w.add_tensor(_gguf_name(name), arr.astype(np.float16))
    else:
      w.add_tensor(_gguf_name(name), gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


def _read(path):
  reader = gguf_io._reader(path)
  cfg = gguf_io.hf_config(reader, path)
  return cfg, dict(gguf_io.hf_tensors(reader, cfg, path))


@pytest.mark.parametrize("tied", [True, False])
def test_f32_is_the_hf_model_exactly(tmp_path, tied):
  weights = _hf_weights(tied=tied)
  cfg, got = _read(_write(tmp_path / "m.gguf", weights))
  assert cfg["tie_word_embeddings"] is tied
  assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
          cfg["head_dim"], cfg["intermediate_size"], cfg["num_hidden_layers"],
          cfg["vocab_size"]) == (HIDDEN, HEADS, KV, HEAD_DIM, INTER, LAYERS, VOCAB)
  assert cfg["rope_theta"] == 50000.0 and cfg["eos_token_id"] == 2
  assert sorted(got) == sorted(weights)
  for name, w in weights.items():
    np.testing.assert_array_equal(got[name], w, err_msg=name)


@pytest.mark.parametrize("qtype,step", [(T.Q8_0, 1 / 127), (T.Q4_0, 1 / 8), (T.Q4_1, 1 / 8),
                                        (T.F16, 1e-3)])
def test_quantised_within_one_step(tmp_path, qtype, step):
  """Each block's error is at most half its quantisation step: <= max|block| * step."""
  weights = _hf_weights(seed=1)
  _, got = _read(_write(tmp_path / "m.gguf", weights, qtype))
  for name, w in weights.items():
    err = np.abs(got[name] - w).max()
    assert err <= np.abs(w).max() * step, (name, err)
    if w.ndim == 2 and qtype != T.F16:
      assert err > 0, name  # it really was quantised (the test could fail)


def test_unreadable_files_are_one_clear_error(tmp_path):
  weights = _hf_weights()
  with pytest.raises(gguf_io.GGUFError, match="does not exist"):
    gguf_io.gguf_to_hf(tmp_path / "none.gguf", tmp_path / "out")
  bad = tmp_path / "bad.gguf"
  bad.write_bytes(b"GGUF" + b"\0" * 7)
  with pytest.raises(gguf_io.GGUFError, match="bad.gguf: not a GGUF file we can read"):
    gguf_io.gguf_to_hf(bad, tmp_path / "out")
  with pytest.raises(gguf_io.GGUFError, match="general.architecture='gpt2'; supported: llama"):
    _read(_write(tmp_path / "gpt2.gguf", weights, arch="gpt2"))
  with pytest.raises(gguf_io.GGUFError, match="rope scaling"):
    _read(_write(tmp_path / "scaled.gguf", weights, extra_kv={"llama.rope.scaling.type": "yarn"}))
  assert not (tmp_path / "out").exists()


def test_a_quantisation_the_package_cannot_read_is_named(tmp_path):
  weights = _hf_weights()
  path = tmp_path / "q81.gguf"
  w = gguf.GGUFWriter(str(path), "llama")
  for k, v in [("block_count", LAYERS), ("embedding_length", HIDDEN), ("feed_forward_length",
               INTER), ("attention.head_count", HEADS)]:
    w.add_uint32(f"llama.{k}", v)
  w.add_token_list([f"t{i}" for i in range(VOCAB)])
  block, size = gguf.GGML_QUANT_SIZES[T.Q8_1]
  emb = np.zeros((VOCAB, HIDDEN // block * size), np.uint8)
  w.add_tensor("token_embd.weight", emb, raw_dtype=T.Q8_1)
  w.add_tensor("output_norm.weight", weights["model.norm.weight"])
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  with pytest.raises(gguf_io.GGUFError, match="'token_embd.weight' is quantised as Q8_1"):
    _read(path)


def test_a_directory_path_is_returned_as_it_is(tmp_path):
  assert gguf_io.resolve_model_path(tmp_path) == tmp_path
  assert gguf_io.resolve_model_path(str(tmp_path / "x")) == tmp_path / "x"
