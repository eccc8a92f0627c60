"""benchmarks/lora.py with its vLLM side (--smoke --smoke_sync; test_smoke.py runs the plain
--smoke, which skips vLLM): one RESULT line whose figures are the JSON's, an adapter sync that
moves a fraction of the whole model's bytes, and a LoRA learner that trains a fraction of the
parameters."""
import json
import math
import pathlib
import sys

import pytest

from tests.benchmarks.test_smoke import _run
from tests.support import vllm as vt

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.bench
@vt.needs_vllm
def test_lora_benchmark_syncs_the_adapters_alone(tmp_path):
  out = tmp_path / "lora.json"
  last = _run([sys.executable, str(ROOT / "benchmarks" / "lora.py"), "--smoke", "--smoke_sync",
               "--out", str(out)], tmp_path)
  got = dict(kv.split("=") for kv in last.split()[1:])
  assert list(got) == ["lora_step_s", "full_step_s", "lora_peak_mb", "full_peak_mb",
                       "lora_sync_mb", "full_sync_mb", "lora_sync_s", "full_sync_s"]
  doc = json.loads(out.read_text())
  fig, sides = doc["figures"], doc["sides"]
  for k, v in got.items():
    assert math.isfinite(fig[k]) and float(v) == pytest.approx(fig[k], rel=1e-3), k
  assert fig["lora_sync_mb"] * 5 < fig["full_sync_mb"]
  assert sides["sync_vllm"]["lora"]["bytes"] == round(fig["lora_sync_mb"] * 1e6)
  lora, full = sides["learner_lora"], sides["learner_full"]
  assert lora["trained_params"] * 10 < full["trained_params"] == lora["params"] - lora[
      "trained_params"]
