"""configs/*.py: each training config loads as launch/train.py loads it (ml_collections' config
file parser, `path[:argument]`) and validates into a RunConfig; the SDPO config's two commands
(warm start, then RL from its sft_model) run end to end at tiny sizes."""
import pathlib

import pytest
from ml_collections.config_flags.config_flags import ConfigFileFlagParser

from posttrain_jax.metrics import read_metrics
from posttrain_jax.run_config import RunConfig, run_config_from_dict
from posttrain_jax.run import Trainer
from tests.support.runs import load_config

ROOT = pathlib.Path(__file__).resolve().parents[2]
# the distillation modes, and the older training configs beside them
CONFIGS = ["sdpo.py", "sdpo.py:warmstart", "opsd.py", "distill_mix.py", "byoh_feedback.py",
           "default.py", "byoh.py", "byoh.py:online", "tool_math.py", "smollm2.py",
           "smollm2.py:vllm"]




@pytest.mark.parametrize("name", CONFIGS)
def test_config_loads_and_validates(name):
  assert isinstance(load_config(name), RunConfig)


def test_the_modes_are_what_their_docstrings_say():
  sdpo, warm = load_config("sdpo.py"), load_config("sdpo.py:warmstart")
  assert (sdpo.rl.learner.loss, sdpo.rl.teacher.context, sdpo.rl.teacher.weights) == (
      "full_distill", "feedback", "ema")
  assert sdpo.rl.rollout.group_size == 1 and sdpo.rl.advantage.estimator == "running"
  assert sdpo.grader == "hidden_rule" and sdpo.tasks.generator == "string_rule"
  assert sdpo.tasks.generator_config.stated_frac == 0.0 and sdpo.sft.steps == 0
  assert sdpo.model.path == f"{warm.workdir}/sft_model"
  assert warm.tasks.generator_config.stated_frac == 0.75
  assert warm.stop_after_step == warm.sft.steps == 800
  opsd = load_config("opsd.py")
  assert opsd.rl.teacher.context == "reference" and opsd.tasks.generator == "arithmetic"
  mix = load_config("distill_mix.py")
  assert mix.rl.learner.loss == "sampled_distill" and mix.loss_config().rl_coef > 0
  assert mix.rl.rollout.group_size > 1 and mix.rl.teacher.context == "sdpo"
  byoh, online = load_config("byoh.py"), load_config("byoh.py:online")
  assert byoh.rl.mode == "traces" and byoh.rl.traces.max_staleness == -1
  assert online.rl.mode == "online" and online.rl.traces.max_staleness == 4
  fb = load_config("byoh_feedback.py")
  assert fb.rl.mode == "traces" and fb.rl.traces.require == "either"
  assert fb.rl.learner.loss == "sampled_distill"
  with pytest.raises(ValueError, match="warmstart"):
    load_config("sdpo.py:sft")


TINY = {"model.tiny.vocab_size": 320, "model.tiny.hidden_size": 32,
        "model.tiny.intermediate_size": 64, "model.tiny.num_layers": 2,
        "model.tiny.num_heads": 4, "model.tiny.num_kv_heads": 2, "model.tiny.head_dim": 8,
        "model.tiny.corpus_lines": 500, "tasks.eval_size": 8, "eval.every_steps": 0,
        "eval.samples_per_prompt": 1, "eval.greedy": False, "checkpoint.every_steps": 0}


def test_sdpo_warm_start_then_rl_runs_end_to_end(tmp_path):
  warm = tmp_path / "warm"
  Trainer(load_config("sdpo.py:warmstart", workdir=str(warm), **TINY, **{
      "sft.steps": 3, "stop_after_step": 3, "sft.batch_size": 8, "sft.batch.rows": 8,
      "sft.batch.max_seqs": 8, "sft.learner.optimizer.decay_steps": 3,
      "sft.learner.optimizer.warmup_steps": 1}), log=lambda *_: None).run()
  start = warm / "sft_model"
  assert (start / "config.json").exists()
  rl = tmp_path / "rl"
  over = {k: v for k, v in TINY.items() if not k.startswith("model.")}
  result = Trainer(load_config("sdpo.py", workdir=str(rl), **over, **{
      "model.path": str(start), "rl.steps": 2, "rl.prompts_per_step": 8, "rl.batch.rows": 8,
      "rl.batch.max_seqs": 8, "rl.loss.topk": 8}), log=lambda *_: None).run()
  assert result is not None
  rows = [r for r in read_metrics(rl / "metrics.jsonl") if "distill/no_context_frac" in r]
  assert [r["step"] for r in rows] == [1, 2]
  for r in rows:   # the hidden_rule grader comments on every attempt: every token is scored
    assert r["distill/no_context_frac"] == 0.0 and r["distill/teacher_token_frac"] == 1.0
    assert r["distill/divergence"] > 0 and r["skipped_update"] == 0.0


def test_serve_config_names_an_engine_whose_settings_are_flags():
  """`--config=configs/serve.py:vllm` makes every VLLMEngineConfig field a command-line flag
  (None-valued ones included), parsed as launch/serve.py parses them; without the argument the
  engine's defaults are used."""
  from absl import flags

  from posttrain_jax.byoh.serve_config import serve_config_from_dict
  from posttrain_jax.engines.vllm_engine import VLLMEngineConfig
  from posttrain_jax.launch.cli import _parse_flags

  serve = str(ROOT / "configs" / "serve.py")
  fv = flags.FlagValues()
  _parse_flags(["serve", f"--config={serve}:vllm", "--config.engine_config.dtype=float32",
                "--config.engine_config.max_model_len=1024",
                "--config.engine_config.enforce_eager=True",
                "--config.proxy.max_tokens_limit=256"], serve, fv)
  cfg = serve_config_from_dict(fv.config.to_dict())
  assert cfg.engine == "vllm" and cfg.proxy.max_tokens_limit == 256
  assert cfg.engine_config == VLLMEngineConfig(dtype="float32", max_model_len=1024,
                                               enforce_eager=True)
  plain = flags.FlagValues()
  _parse_flags(["serve", f"--config={serve}", "--config.engine=vllm"], serve, plain)
  cfg = serve_config_from_dict(plain.config.to_dict())
  assert cfg.engine == "vllm" and cfg.engine_config is None


def test_default_config_names_an_engine_whose_settings_are_flags():
  """`--config=configs/default.py:fleet` (README "With a vLLM fleet"): the fleet's URL tuple,
  its nested per-server and Ray settings are flags, parsed as launch/train.py parses them."""
  from absl import flags

  from posttrain_jax.engines.fleet import FleetConfig
  from posttrain_jax.engines.fleet_ray import RayFleetConfig
  from posttrain_jax.engines.openai_engine import OpenAIEngineConfig
  from posttrain_jax.launch.cli import _parse_flags
  from posttrain_jax.run_config import run_config_from_dict

  default = str(ROOT / "configs" / "default.py")
  fv = flags.FlagValues()
  _parse_flags(["train", f"--config={default}:fleet",
                "--config.rl.engine_config.urls=('http://a:8000', 'http://b:8000')",
                "--config.rl.engine_config.server.weights_dir=/shared/weights",
                "--config.rl.engine_config.ray.num_gpus=1"], default, fv)
  cfg = run_config_from_dict(fv.config.to_dict())
  assert cfg.rl.engine == "fleet"
  assert cfg.rl.engine_config == FleetConfig(
      urls=("http://a:8000", "http://b:8000"),
      server=OpenAIEngineConfig(weights_dir="/shared/weights"), ray=RayFleetConfig(num_gpus=1.0))
