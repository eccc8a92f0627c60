"""benchmarks/default_run.py: the figures it reads from a run's metrics rows (SFT seconds, GRPO
seconds at each held-out eval, the median GRPO step), on hand-written rows."""
import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _bench():
  spec = importlib.util.spec_from_file_location("default_run", ROOT / "benchmarks" / "default_run.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def _rows():
  rows = [{"step": s, "sft/loss": 1.0, "time/train_s_total": 0.5 * s} for s in (1, 2, 3)]
  rows.append({"step": 3, "eval/accuracy": 0.2, "time/train_s_total": 1.5})  # the boundary eval
  total = 1.5
  for s, step_s in zip((4, 5, 6, 7), (4.0, 1.0, 2.0, 1.0)):
    total += step_s
    row = {"step": s, "reward/mean": 0.3, "time/step_s": step_s, "time/train_s_total": total}
    if s in (5, 7):
      row["eval/accuracy"] = {5: 0.35, 7: 0.45}[s]
    rows.append(row)
  return rows


def test_curve_splits_sft_and_grpo_seconds():
  c = _bench().curve(_rows(), "accuracy", sft_steps=3)
  assert c["sft_s"] == 1.5
  # GRPO seconds at each eval: 0 at the boundary, 4 + 1 after step 5, 4 + 1 + 2 + 1 after step 7
  assert c["points"] == [{"rl_step": 0, "rl_train_s": 0.0, "heldout": 0.2},
                         {"rl_step": 2, "rl_train_s": 5.0, "heldout": 0.35},
                         {"rl_step": 4, "rl_train_s": 8.0, "heldout": 0.45}]
  assert c["rl_steps"] == 4 and c["rl_train_s"] == 8.0
  assert c["rl_s_per_step"] == 1.5   # the median of 4, 1, 2, 1


def test_a_run_without_the_boundary_eval_is_an_error():
  rows = [r for r in _rows() if not (r["step"] == 3 and "eval/accuracy" in r)]
  with pytest.raises(SystemExit, match="no held-out eval at the SFT -> GRPO boundary"):
    _bench().curve(rows, "accuracy", sft_steps=3)
