"""README command 1, end to end (slow: ~9 min on 2 cores): the default run learns."""
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_default_run_improves_heldout_accuracy(tmp_path):
  out = subprocess.run([sys.executable, str(ROOT / "launch" / "train.py"), f"--workdir={tmp_path}"],
                       capture_output=True, text=True, timeout=1800, cwd=tmp_path)
  assert out.returncode == 0, out.stderr[-3000:]
  last = out.stdout.strip().splitlines()[-1]
  assert last.startswith("RESULT heldout_before="), last
  result = json.loads((tmp_path / "result.json").read_text())
  assert result["heldout_after"] - result["heldout_before"] >= 0.10, result
  assert result["reward_last10"] > result["reward_first10"], result
  for name in ("plot.png", "metrics.jsonl", "final_model/config.json", "sft_model/config.json"):
    assert (tmp_path / name).exists(), name
