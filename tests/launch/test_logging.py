"""A run's console: the progress bar, the held-out lines and the RESULT line, nothing else.

Library logs stay at WARNING unless --verbosity asks for more: absl's app.run raises an unset
--verbosity to INFO after parsing the flags, and orbax logs every checkpoint at INFO (a default
run printed ~360 such lines). A save every step makes those lines certain to appear if let.
"""
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SHORT = ("--config.sft.steps=2", "--config.rl.steps=2", "--config.eval.every_steps=0",
         "--config.checkpoint.every_steps=1", "--config.tasks.eval_size=32")
# absl's log prefix, e.g. `I1201 09:11:45.665734 139626740722560 checkpoint_manager.py:2074]`;
# tqdm's carriage returns can put it in the middle of a line.
_ABSL_LOG = re.compile(r"[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\]")


def _train(tmp_path, *flags):
  # As a user runs it: without conftest's 8 fake host devices and CPU pin.
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  out = subprocess.run([sys.executable, str(ROOT / "launch" / "train.py"),
                        f"--workdir={tmp_path / 'run'}", *SHORT, *flags],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
  assert out.returncode == 0, out.stderr[-3000:]
  return out


@pytest.mark.slow  # > 30 s: CI's slow stage
def test_console_shows_progress_heldout_and_result_only(tmp_path):
  out = _train(tmp_path)
  assert not _ABSL_LOG.search(out.stdout + out.stderr), out.stderr[-3000:]
  assert "checkpoint_manager" not in out.stdout + out.stderr
  lines = out.stdout.splitlines()
  assert len(lines) >= 3 and all(line.startswith("held-out ") for line in lines[:-2]), lines
  assert lines[-2].startswith("workdir: ") and lines[-1].startswith("RESULT heldout_before="), lines
  bar = [s for s in re.split(r"[\r\n]", out.stderr) if s.strip()]
  assert bar and all(s.startswith("train: ") for s in bar), bar
  assert len(list((tmp_path / "run" / "checkpoints").iterdir())) >= 2  # saves did happen


@pytest.mark.slow
def test_verbosity_flag_shows_library_logs(tmp_path):
  out = _train(tmp_path, "--verbosity=0")
  assert _ABSL_LOG.search(out.stderr) and "checkpoint_manager.py" in out.stderr, out.stderr[-3000:]
