"""The synchronous run: exact resume, data order, config errors, the CLI."""
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from posttrain_jax.config_io import ConfigTypeError
from posttrain_jax.metrics import read_metrics
from posttrain_jax.models.safetensors_io import Checkpoint
from posttrain_jax.run_config import run_config_from_dict
from posttrain_jax.run import Trainer
from tests.support.runs import tiny_run, final_weights

ROOT = pathlib.Path(__file__).resolve().parents[2]






@pytest.mark.slow  # > 30 s: CI's slow stage
def test_resume_is_exact(tmp_path):
  """6 steps straight == 3 steps, stop, new Trainer resumes to 6: same params, same data."""
  straight = Trainer(tiny_run(tmp_path / "a"), log=lambda *_: None).run()
  assert straight is not None
  assert Trainer(tiny_run(tmp_path / "b", stop_after_step=3), log=lambda *_: None).run() is None
  assert (tmp_path / "b" / "checkpoints" / "3").exists()
  resumed = Trainer(tiny_run(tmp_path / "b"), log=lambda *_: None).run()
  a, b = final_weights(tmp_path / "a" / "final_model"), final_weights(tmp_path / "b" / "final_model")
  assert a.keys() == b.keys()
  for name in a:
    np.testing.assert_array_equal(a[name], b[name], err_msg=name)
  ma = {r["step"]: r for r in read_metrics(tmp_path / "a" / "metrics.jsonl") if "data/hash" in r}
  mb = {r["step"]: r for r in read_metrics(tmp_path / "b" / "metrics.jsonl") if "data/hash" in r}
  assert sorted(ma) == sorted(mb) == list(range(1, 7))  # no step logged twice or lost
  assert [ma[s]["data/hash"] for s in ma] == [mb[s]["data/hash"] for s in ma]
  assert len({ma[s]["data/hash"] for s in ma}) == 6  # steps really see different data
  assert resumed["reward_last10"] == pytest.approx(straight["reward_last10"])
  assert (tmp_path / "b" / "plot.png").stat().st_size > 0


def test_wrong_type_names_the_field():
  with pytest.raises(ConfigTypeError, match=r"config\.rl\.learner\.optimizer\.learning_rate: expected float, got str 'fast'"):
    run_config_from_dict({"rl": {"learner": {"optimizer": {"learning_rate": "fast"}}}})
  with pytest.raises(ConfigTypeError, match=r"config\.rl\.rollout: unknown field\(s\) \['groupsize'\]"):
    run_config_from_dict({"rl": {"rollout": {"groupsize": 4}}})
  with pytest.raises(ConfigTypeError, match=r"config\.sft\.steps: expected int, got float 1\.5"):
    run_config_from_dict({"sft": {"steps": 1.5}})


def test_loss_config_follows_loss_name():
  cfg = run_config_from_dict({"rl": {"learner": {"loss": "cispo"}, "loss": {"eps_high": 4.0}}})
  assert type(cfg.loss_config()).__name__ == "CISPOConfig" and cfg.loss_config().eps_high == 4.0
  with pytest.raises(ConfigTypeError, match=r"unknown loss 'grpoo'; registered losses: .*grpo"):
    run_config_from_dict({"rl": {"learner": {"loss": "grpoo"}, "loss": {}}})


def test_cli_rejects_bad_override(tmp_path):
  out = subprocess.run([sys.executable, str(ROOT / "launch" / "train.py"),
                        f"--workdir={tmp_path}", "--config.rl.rollout.truncation=clip"],
                       capture_output=True, text=True, timeout=120)
  assert out.returncode != 0
  assert "config.rl.rollout" in out.stderr and "truncation='clip'" in out.stderr and "grade" in out.stderr
