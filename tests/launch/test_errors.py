"""A user's mistake ends launch/train.py with one `error: ...` line and status 1, no traceback.

Each case is the command a new user would type; every run fails before training starts.
"""
import pathlib
import subprocess
import sys

import pytest

from posttrain_jax.config_io import ConfigTypeError
from posttrain_jax.tasks.bank import TaskBankError
from posttrain_jax.tasks.synthetic import GeneratorError
from posttrain_jax.errors import PathNotFoundError, UserError
from posttrain_jax.models.config import ConfigError
from posttrain_jax.models.hf_io import CheckpointError
from posttrain_jax.models.safetensors_io import SafetensorsError

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _train(tmp_path, *flags):
  return subprocess.run([sys.executable, str(ROOT / "launch" / "train.py"),
                         f"--workdir={tmp_path / 'run'}", *flags],
                        capture_output=True, text=True, timeout=120, cwd=tmp_path)


def _last_error_line(out) -> str:
  assert out.returncode == 1, (out.returncode, out.stderr[-3000:])
  assert "Traceback" not in out.stdout + out.stderr, out.stderr[-3000:]
  assert out.stderr.count("error: ") == 1, out.stderr[-3000:]
  return out.stderr.strip().splitlines()[-1]


def test_user_errors_keep_their_builtin_bases():
  for cls, builtin in ((ConfigTypeError, TypeError), (TaskBankError, ValueError),
                       (PathNotFoundError, FileNotFoundError), (ConfigError, ValueError),
                       (CheckpointError, ValueError), (SafetensorsError, ValueError),
                       (GeneratorError, ValueError)):
    assert issubclass(cls, UserError) and issubclass(cls, builtin), cls


def test_missing_model_directory(tmp_path):
  missing = tmp_path / "no_such_model"
  last = _last_error_line(_train(tmp_path, f"--config.model.path={missing}"))
  assert last == f"error: model directory {missing} does not exist"


def test_malformed_task_file_names_the_line(tmp_path):
  tasks = tmp_path / "tasks.jsonl"
  tasks.write_text('{"id": "a", "prompt": "1+1=", "answer": "2"}\n'
                   '{"id": "b", "prompt": "2+2=" "answer": "4"}\n'
                   '{"id": "c", "prompt": "3+3=", "answer": "6"}\n')
  out = _train(tmp_path, "--config.tasks.source=jsonl", f"--config.tasks.path={tasks}")
  last = _last_error_line(out)
  assert last.strip().startswith(f"{tasks}:2: not valid JSON"), last
  assert f"error: {tasks}: 1 malformed line(s)" in out.stderr


@pytest.mark.parametrize("flag, message", [
    ("--config.rl.lossx=1",
     "error: --config.rl.lossx: config.rl has no field 'lossx'; did you mean 'loss'?"),
    ("--config.rl.steps.x=1",
     "error: --config.rl.steps.x: config.rl.steps = 400 has no fields"),
    ("--config=no_such_config.py", "error: --config=no_such_config.py: no such file"),
    ("--config.rl.steps=many",
     "error: flag --config.rl.steps=many: invalid literal for int() with base 10: 'many' "
     "(--helpfull lists the flags)"),
    ("config.rl.steps=2",
     "error: unexpected argument(s) ['config.rl.steps=2']; flags look like --config.sft.steps=20"),
])
def test_bad_flags(tmp_path, flag, message):
  assert _last_error_line(_train(tmp_path, flag)) == message


def test_bad_config_value(tmp_path):  # a ConfigTypeError from the RunConfig
  last = _last_error_line(_train(tmp_path, "--config.rl.rollout.truncation=clip"))
  assert last.startswith("error: config.rl.rollout") and "'clip'" in last, last


def test_unsupported_model_config_is_one_line(tmp_path):
  """A model directory whose config.json uses a feature we refuse (sliding windows)."""
  import json
  from posttrain_jax.models.tiny import TinyModelConfig, build_tiny_model
  src = build_tiny_model(TinyModelConfig(num_layers=1, hidden_size=32, intermediate_size=64,
                                         num_heads=2, num_kv_heads=1, head_dim=16))
  bad = tmp_path / "model"
  import shutil
  shutil.copytree(src, bad)
  conf = json.loads((bad / "config.json").read_text())
  conf.update(sliding_window=16, use_sliding_window=True)
  (bad / "config.json").write_text(json.dumps(conf))
  last = _last_error_line(_train(tmp_path, f"--config.model.path={bad}"))
  assert last.startswith("error: ") and "sliding" in last, last


def test_bad_generator_config_is_one_line(tmp_path):
  last = _last_error_line(_train(tmp_path, "--config.tasks.generator_config.max_digits=0"))
  assert last.startswith("error: ") and "digits" in last, last
