"""What the benchmarks that measure each side in a process of its own share (real_model.py,
lora.py): running one side as `script --worker NAME` and reading its `WORKER {json}` line, and
resolving `--model` (smollm2 | tiny | a HF directory | a .gguf) to a HF directory once, in the
driver, so no worker converts a GGUF itself."""
from __future__ import annotations

import json
import subprocess
import sys


def run_worker(script: str, name: str, model: str, argv: list[str]) -> dict:
  """`script --worker name --model model *argv` in a fresh process; its last `WORKER` JSON
  line, or {"skipped": why} when it failed or printed none."""
  cmd = [sys.executable, script, "--worker", name, "--model", model, *argv]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
  lines = [line for line in proc.stdout.splitlines() if line.startswith("WORKER ")]
  if proc.returncode != 0 or not lines:
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    return {"skipped": f"{name} failed (exit {proc.returncode}): {tail[0][:300]}"}
  return json.loads(lines[-1][len("WORKER "):])


def model_dir(model: str, smoke: bool) -> str:
  """The HF directory `--model` names (the tiny model under --smoke); exits naming the flag
  when SmolLM2's package is missing."""
  from posttrain_jax.models.gguf_io import resolve_model_path
  if smoke or model == "tiny":
    from posttrain_jax.models.tiny import build_tiny_model
    return str(build_tiny_model())
  if model == "smollm2":
    from configs.smollm2 import smollm2_gguf
    try:
      return str(resolve_model_path(smollm2_gguf()))
    except ValueError as e:
      sys.exit(f"error: --model=smollm2: {e}")
  return str(resolve_model_path(model))


def random_sft_batch(rows: int, seq_len: int, vocab: int, seed: int = 0):
  """`rows` unpacked rows of `seq_len` random token ids in [3, vocab), every position after the
  first a target: the learner benchmarks' step input (real_model.py, lora.py)."""
  import numpy as np

  from posttrain_jax import batching
  from posttrain_jax.types import Trajectory
  ids = np.random.default_rng(seed).integers(3, vocab, size=(rows, seq_len))
  trajs = [Trajectory(id=str(i), task_id=str(i), token_ids=row.tolist(),
                      loss_mask=[0] + [1] * (seq_len - 1),
                      behaviour_logprobs=[0.0] * seq_len, policy_version=[0] * seq_len)
           for i, row in enumerate(ids)]
  return batching.build_batch(trajs, [0.0] * rows, batching.BatchConfig(
      rows=rows, seq_len=seq_len, max_seqs=rows, pack=False, trim=False))
