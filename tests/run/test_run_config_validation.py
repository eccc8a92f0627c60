"""Config combinations that used to fail late (or never) are refused up front, naming the field."""
import importlib.util
import json

import pytest

from posttrain_jax.config_io import ConfigTypeError
from posttrain_jax.engines.registry import engine_names, engine_spec
from posttrain_jax.errors import UserError
from posttrain_jax.run_config import run_config_from_dict
from posttrain_jax.run import Trainer
from tests.support.runs import tiny_run


@pytest.mark.parametrize("rl, match", [
    ({"mode": "async", "rollout": {"group_size": 2}, "replay": {"min_scored": 3}},
     r"replay\.min_scored=3 > rollout\.group_size=2"),
    ({"update_epochs": 0}, r"update_epochs must be ≥ 1, got 0"),
    ({"prompts_per_step": 0}, r"prompts_per_step must be ≥ 1"),
    ({"rollout": {"group_size": 0}}, r"group_size must be ≥ 1, got 0"),
    ({"rollout": {"max_tokens": 0}}, r"max_tokens must be ≥ 1, got 0"),
    ({"rollout": {"group_size": 1}}, r"'grpo' is a group baseline: .*group_size ≥ 2"),
    ({"prompts_per_step": 64, "rollout": {"group_size": 8}}, r"512 sequences exceed .*max_seqs"),
    ({"engine": "vlm"}, r"engine is 'vlm'; valid: \[.*'jax'.*'openai'.*'vllm'"),
    ({"engine": "vllm", "engine_config": {"max_model_lenn": 1}}, r"unknown field.*max_model_lenn"),
])
def test_bad_rl_combinations_name_the_field(rl, match):
  with pytest.raises(ConfigTypeError, match=match):
    run_config_from_dict({"rl": rl})


def test_engines_by_name_include_openai():
  assert {"jax", "vllm", "openai"} <= set(engine_names())
  assert engine_spec("vllm").copies_weights and engine_spec("openai").copies_weights
  assert not engine_spec("jax").copies_weights
  cfg = run_config_from_dict({"rl": {"engine": "openai",
                                     "engine_config": {"base_url": "http://h:1"}}})
  assert cfg.engine_config().base_url == "http://h:1"


def test_async_defaults_to_an_off_policy_correction():
  sync = run_config_from_dict({"rl": {"mode": "sync"}})
  assert sync.loss_config().correction == "none"
  auto = run_config_from_dict({"rl": {"mode": "async"}})
  assert auto.loss_config().correction == "tis"
  off = run_config_from_dict({"rl": {"mode": "async", "async_correction": "none"}})
  assert off.loss_config().correction == "none"
  mine = run_config_from_dict({"rl": {"mode": "async", "loss": {"correction": "decoupled"}}})
  assert mine.loss_config().correction == "decoupled"


def test_a_finite_task_bank_too_small_for_the_run_is_refused_up_front(tmp_path):
  data = tmp_path / "tasks.jsonl"
  data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                          for i in range(10)))
  cfg = tiny_run(tmp_path / "run", tasks={"source": "jsonl", "path": str(data), "num_epochs": 1,
                                          "eval_fraction": 0.2})
  with pytest.raises(ConfigTypeError, match=r"tasks\.num_epochs=1: the task bank yields \d+ "
                                            r"tasks but the run draws 24"):
    Trainer(cfg, log=lambda *_: None)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_vllm_engine_is_checked_before_the_run_starts(tmp_path):
  """Without vLLM, rl.engine=vllm fails at once (the old code failed after the SFT phase)."""
  cfg = tiny_run(tmp_path, rl={"engine": "vllm"})
  with pytest.raises(UserError, match=r"needs vLLM: pip install"):
    Trainer(cfg, log=lambda *_: None)
  assert not (tmp_path / "checkpoints").exists()


def test_vllm_model_set_by_the_user_is_refused(tmp_path):
  cfg = tiny_run(tmp_path, rl={"engine": "vllm", "engine_config": {"model": "/some/dir"}})
  with pytest.raises(ConfigTypeError, match=r"engine_config\.model='/some/dir': the run sets it"):
    Trainer(cfg, log=lambda *_: None)


def test_an_episode_context_longer_than_a_batch_row_is_refused():
  from posttrain_jax.run_config import run_config_from_dict
  with pytest.raises(Exception, match="max_context_tokens=1024 > batch.seq_len=512"):
    run_config_from_dict({"rl": {"episode": "env", "prompts_per_step": 2,
                                 "batch": {"seq_len": 512, "max_seqs": 64}}})
