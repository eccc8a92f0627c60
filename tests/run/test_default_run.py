"""README command 1, end to end: the default run learns.

CI's stage 0 runs the command as written in a fresh venv (.ci/run) and stage 1 hands its output
to this test through PTJ_DEFAULT_RUN_DONE (a directory holding the run's `run/` workdir and its
`stdout`), so the ~2-minute run is not made twice; anywhere else the test makes the run itself."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _the_default_run(tmp_path) -> tuple[pathlib.Path, str]:
  """The default run's workdir and stdout: CI's stage 0 run where there is one, else a new one."""
  done = os.environ.get("PTJ_DEFAULT_RUN_DONE")
  if done:
    return pathlib.Path(done) / "run", (pathlib.Path(done) / "stdout").read_text()
  out = subprocess.run([sys.executable, str(ROOT / "launch" / "train.py"), f"--workdir={tmp_path}"],
                       capture_output=True, text=True, timeout=1800, cwd=tmp_path)
  assert out.returncode == 0, out.stderr[-3000:]
  return tmp_path, out.stdout


@pytest.mark.slow
def test_default_run_improves_heldout_accuracy(tmp_path):
  workdir, stdout = _the_default_run(tmp_path)
  last = stdout.strip().splitlines()[-1]
  assert last.startswith("RESULT heldout_before="), last
  result = json.loads((workdir / "result.json").read_text())
  assert result["heldout_after"] - result["heldout_before"] >= 0.10, result
  assert result["reward_last10"] > result["reward_first10"], result
  for name in ("plot.png", "metrics.jsonl", "final_model/config.json", "sft_model/config.json"):
    assert (workdir / name).exists(), name
