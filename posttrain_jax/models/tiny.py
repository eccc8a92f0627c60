"""Tiny HF-format model directories built locally (tests and the default run; no downloads).

`build_tiny_model(TinyModelConfig(...))` writes, deterministically from the config's seed:
- a byte-level BPE tokenizer trained with `tokenizers` on generated text (digits are split
  one per token, which small models need for arithmetic), ChatML special tokens and a chat
  template, saved through transformers so `AutoTokenizer` loads it;
- `config.json` of any supported family and random (or given) weights in safetensors,
  written by our own exporter so the real loading code reads them back.
The directory is cached under a key of everything that determines it, and appears atomically.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import random
import shutil
import tempfile
from typing import Iterable, Optional

from posttrain_jax.models import families
from posttrain_jax.models.chat_templates import CHAT_FORMATS
from posttrain_jax.models.config import ModelConfig

FACTORY_VERSION = 1
@dataclasses.dataclass(frozen=True)
class TinyModelConfig:
  """What a tiny model directory is built from (all of it enters the cache key)."""
  family: str = "qwen3"           # a registered family name (models/families/)
  vocab_size: int = 512           # BPE vocabulary incl. 256 bytes and special tokens
  hidden_size: int = 128          # model width
  intermediate_size: int = 384    # SwiGLU width
  num_layers: int = 4             # decoder blocks
  num_heads: int = 4              # query heads
  num_kv_heads: int = 2           # key/value heads
  head_dim: int = 32              # per-head width
  tie_word_embeddings: bool = True  # LM head shares the embedding
  max_position_embeddings: int = 1024  # RoPE table length written to config.json
  rope_theta: float = 10000.0     # RoPE base
  param_dtype: str = "float32"    # dtype of the stored weights
  seed: int = 0                   # weights and tokenizer corpus
  corpus_lines: int = 4000        # generated lines the tokenizer is trained on
  chat_format: str = "chatml"     # chat template + special tokens (models/chat_templates.py)


def default_cache_root() -> pathlib.Path:
  return pathlib.Path(os.environ.get("POSTTRAIN_JAX_CACHE",
                                     pathlib.Path.home() / ".cache" / "posttrain_jax")) / "tiny"


def default_corpus(n_lines: int, seed: int) -> list[str]:
  """Arithmetic, short English and chat-formatted lines: what the built-in tasks look like."""
  rng = random.Random(seed)
  words = ("the answer is what compute add subtract multiply number result solve question "
           "use each of to make equals sum product difference total step first then so "
           "user assistant system tool call think final reach target numbers expression").split()
  ops = ("+", "-", "*")
  lines = []
  for _ in range(n_lines):
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    op = rng.choice(ops)
    kind = rng.random()
    if kind < 0.4:
      lines.append(f"{a}{op}{b}={eval(f'{a}{op}{b}')}")
    elif kind < 0.7:
      lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 10))).capitalize() + ".")
    else:
      lines.append(f"<|im_start|>user\nWhat is {a} {op} {b}?<|im_end|>\n<|im_start|>assistant\n"
                   f"The answer is \\boxed{{{eval(f'{a}{op}{b}')}}}<|im_end|>")
  return lines


def tool_corpus(chat_format: str, n_lines: int, seed: int) -> list[str]:
  """Chats in a tool format (the python tool, calls, results), so BPE merges its fixed text: a
  tool system prompt of ~450 byte-level tokens shrinks to a few dozen."""
  import jinja2

  fmt = CHAT_FORMATS.get(chat_format)
  env = jinja2.Environment()
  env.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)
  template = env.from_string(fmt.template)
  tools = [{"type": "function", "function": {
      "name": "python", "description": "Runs a Python program in a sandbox and returns what it "
      "printed.", "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                                 "required": ["code"]}}}]
  rng = random.Random(seed)
  lines = []
  for _ in range(n_lines):
    a, b = rng.randint(10, 999999), rng.randint(10, 999999)
    expr, value = f"{a}*{b}", a * b
    call = (f'<tool_call>\n{{"name": "python", "arguments": {{"code": "print({expr})"}}}}\n'
            "</tool_call>" if fmt.tool_format == "hermes"
            else f'{{"name": "python", "parameters": {{"code": "print({expr})"}}}}')
    chat = [{"role": "user", "content": f"Compute {expr}."},
            {"role": "assistant", "content": call},
            {"role": "tool", "content": str(value)},
            {"role": "assistant", "content": f"The answer is {value}."}]
    lines.append(template.render(messages=chat, tools=tools, add_generation_prompt=False))
  return lines


def model_config(t: TinyModelConfig, eos_ids: list[int], pad_id: int) -> ModelConfig:
  """The tiny model's ModelConfig; the family's switches are its defaults (`from_hf({})`)."""
  return ModelConfig(
      family=t.family, vocab_size=t.vocab_size, hidden_size=t.hidden_size,
      intermediate_size=t.intermediate_size, num_layers=t.num_layers, num_heads=t.num_heads,
      num_kv_heads=t.num_kv_heads, head_dim=t.head_dim, rope_theta=t.rope_theta,
      **families.get(t.family).from_hf({}),
      tie_word_embeddings=t.tie_word_embeddings, max_position_embeddings=t.max_position_embeddings,
      eos_token_id=eos_ids, pad_token_id=pad_id, bos_token_id=None, param_dtype=t.param_dtype)


def train_tokenizer(lines: Iterable[str], vocab_size: int, chat_format: str = "chatml"):
  """Byte-level BPE, one token per digit, the chat format's special tokens and template;
  returns a transformers tokenizer."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  from transformers import PreTrainedTokenizerFast

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Digits(individual_digits=True),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
  tok.decoder = decoders.ByteLevel()
  fmt = CHAT_FORMATS.get(chat_format)
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(fmt.special_tokens),
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(lines, trainer=trainer)
  fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=fmt.eos[0], pad_token=fmt.pad,
                                 unk_token=None)
  fast.chat_template = fmt.template
  return fast


def _key(t: TinyModelConfig, extra: str) -> str:
  cfg = dataclasses.asdict(t)
  if cfg["chat_format"] == "chatml":  # keys from before the field existed stay valid
    del cfg["chat_format"]
  else:
    cfg["tool_corpus"] = 1            # the tokenizer also learns tool_corpus()
  blob = json.dumps({"v": FACTORY_VERSION, "cfg": cfg, "extra": extra}, sort_keys=True)
  return hashlib.sha256(blob.encode()).hexdigest()[:16]


def build_tiny_model(t: TinyModelConfig = TinyModelConfig(), *,
                     out_dir: Optional[os.PathLike] = None,
                     cache_root: Optional[os.PathLike] = None,
                     corpus: Optional[list[str]] = None,
                     weights=None) -> pathlib.Path:
  """Builds (or finds in the cache) a tiny HF model directory and returns its path.

  `corpus` replaces the generated tokenizer text; `weights` (a Decoder) replaces random
  weights. Both enter the cache key. With `out_dir`, the model is written exactly there.
  """
  from posttrain_jax.models import hf_io

  extra = ""
  if corpus is not None:
    extra += hashlib.sha256("\n".join(corpus).encode()).hexdigest()
  if weights is not None:
    h = hashlib.sha256()
    for name, arr in hf_io.hf_tensors(weights):
      h.update(name.encode())
      h.update(arr.tobytes())
    extra += h.hexdigest()
  if out_dir is None:
    out_dir = pathlib.Path(cache_root or default_cache_root()) / f"{t.family}-{_key(t, extra)}"
  out_dir = pathlib.Path(out_dir)
  ready = (out_dir / "config.json").exists() and (out_dir / "tokenizer.json").exists()
  import jax
  from posttrain_jax.multihost import all_gather_json
  if jax.process_count() > 1:  # one decision for the job: save_hf_model below is a collective
    ready = all(all_gather_json(ready))
  if ready:
    return out_dir

  lines = corpus if corpus is not None else default_corpus(t.corpus_lines, t.seed)
  if corpus is None and CHAT_FORMATS.get(t.chat_format).tool_format is not None:
    lines = lines + tool_corpus(t.chat_format, t.corpus_lines // 4, t.seed)
  tokenizer = train_tokenizer(lines, t.vocab_size, t.chat_format)
  if len(tokenizer) > t.vocab_size:
    raise ValueError(f"tokenizer has {len(tokenizer)} tokens > vocab_size={t.vocab_size}")
  eos_ids = [tokenizer.convert_tokens_to_ids(e) for e in CHAT_FORMATS.get(t.chat_format).eos]
  cfg = model_config(t, eos_ids, tokenizer.pad_token_id)
  # Several processes: laid out over the job's devices, as the collective export expects
  mesh = None
  if jax.process_count() > 1 and weights is None:
    from posttrain_jax.sharding import MeshConfig, make_mesh
    mesh = make_mesh(MeshConfig())
  model = weights if weights is not None else hf_io.init_model(cfg, seed=t.seed, mesh=mesh)
  if model.cfg.vocab_size != cfg.vocab_size:
    raise ValueError(f"weights have vocab_size {model.cfg.vocab_size}, tokenizer needs {cfg.vocab_size}")

  out_dir.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=out_dir.parent) as tok_dir:
    tokenizer.save_pretrained(tok_dir)
    (pathlib.Path(tok_dir) / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": eos_ids, "pad_token_id": tokenizer.pad_token_id}))
    hf_io.save_hf_model(model, out_dir, tokenizer_dir=tok_dir)
  if weights is not None:  # the given weights keep their own architecture; record our tokens
    conf = json.loads((out_dir / "config.json").read_text())
    conf.update(eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id)
    (out_dir / "config.json").write_text(json.dumps(conf, indent=2))
  return out_dir
