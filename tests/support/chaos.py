"""Real `python launch/train.py` runs, killed and resumed (tests/run/test_chaos.py,
tests/run/test_preemption.py, benchmarks/chaos_resume.py).

A run is the tiny model with small step counts given as `--config.*` flags (SYNC: SFT 4 steps,
then GRPO 6 steps whose gradients are not all zero; ASYNC: the same in `rl.mode="async"`), a
checkpoint every 2 steps. Kills are SIGKILL at a time or at a point of the crash hook
(`POSTTRAIN_JAX_CRASH_AT`, posttrain_jax/checkpoint.py). What a run left behind is read from its
workdir: committed checkpoint steps, orbax temporary directories, metrics rows, final weights,
and for async runs the trajectory accounting (`async_accounting`).
"""
from __future__ import annotations

import collections
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import Optional

import numpy as np

from posttrain_jax.checkpoint import CRASH_ENV, Checkpointer
from posttrain_jax.metrics import read_metrics
from posttrain_jax.models.safetensors_io import Checkpoint

ROOT = pathlib.Path(__file__).resolve().parents[2]
SFT_STEPS, RL_STEPS, P, G = 4, 6, 4, 4
TINY = (
    "--config.seed=3", "--config.model.tiny.vocab_size=320", "--config.model.tiny.hidden_size=32",
    "--config.model.tiny.intermediate_size=64", "--config.model.tiny.num_layers=2",
    "--config.model.tiny.num_heads=4", "--config.model.tiny.num_kv_heads=2",
    "--config.model.tiny.head_dim=8", "--config.model.tiny.corpus_lines=500",
    "--config.tasks.generator_config.min_digits=1", "--config.tasks.generator_config.max_digits=1",
    "--config.tasks.eval_fraction=0.2", "--config.tasks.eval_size=8",
    f"--config.sft.steps={SFT_STEPS}", "--config.sft.batch_size=8", "--config.sft.batch.rows=8",
    "--config.sft.batch.seq_len=32", "--config.sft.batch.max_seqs=8",
    "--config.sft.learner.optimizer.learning_rate=1e-2",
    "--config.sft.learner.optimizer.warmup_steps=0",
    f"--config.rl.steps={RL_STEPS}", f"--config.rl.prompts_per_step={P}",
    f"--config.rl.rollout.group_size={G}", "--config.rl.rollout.max_tokens=4",
    "--config.rl.learner.optimizer.learning_rate=1e-3",
    "--config.rl.learner.optimizer.warmup_steps=0", "--config.rl.batch.rows=16",
    "--config.rl.batch.seq_len=32", "--config.rl.batch.max_seqs=16",
    "--config.eval.every_steps=0", "--config.eval.samples_per_prompt=1",
    "--config.eval.max_tokens=4", "--config.eval.greedy=False",
    "--config.checkpoint.every_steps=2")
SYNC = TINY
ASYNC = TINY + ("--config.rl.mode=async", "--config.rl.replay.max_staleness=1",
                "--config.rl.replay.capacity=8", "--config.rl.pool.concurrency=2")
ASYNC_SAVE = ("--config.checkpoint.async_save=True",)
TOTAL_STEPS = SFT_STEPS + RL_STEPS
_RESUMED = re.compile(r"resumed from \S+ \(step (\d+)\)")
_PREEMPTED = re.compile(r"preempted at step (\d+): checkpoint written, resume with the same "
                        r"command")


def env(crash_at: Optional[str] = None) -> dict:
  """The environment a user runs with (no test-wide XLA device flag), plus the crash hook."""
  out = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", CRASH_ENV)}
  out.setdefault("JAX_PLATFORMS", "cpu")
  out["PYTHONUNBUFFERED"] = "1"   # what a killed run printed is in its .out file
  if crash_at:
    out[CRASH_ENV] = crash_at
  return out


def start(workdir: pathlib.Path, flags=SYNC, crash_at: Optional[str] = None) -> subprocess.Popen:
  """`python launch/train.py --workdir=workdir <flags>`; stdout / stderr go to workdir.out /
  workdir.err (appended: a resume adds to the killed run's)."""
  workdir = pathlib.Path(workdir)
  out = open(f"{workdir}.out", "a")
  err = open(f"{workdir}.err", "a")
  return subprocess.Popen([sys.executable, str(ROOT / "launch" / "train.py"),
                           f"--workdir={workdir}", *flags], stdout=out, stderr=err,
                          env=env(crash_at), cwd=str(workdir.parent))


def run(workdir: pathlib.Path, flags=SYNC, crash_at: Optional[str] = None,
        timeout: float = 900) -> tuple[int, str]:
  """Runs to the end (or the crash); (exit status, this run's stdout)."""
  before = _size(f"{workdir}.out")
  p = start(workdir, flags, crash_at)
  rc = p.wait(timeout)
  return rc, since(f"{workdir}.out", before)


def since(path, offset: int) -> str:
  """The text of `path` after its first `offset` BYTES (a size from `_size`): slicing the decoded
  text by a byte count would start late after any non-ASCII character (a log line's "≥")."""
  return pathlib.Path(path).read_bytes()[offset:].decode("utf-8", "replace")


def _size(path) -> int:
  return pathlib.Path(path).stat().st_size if pathlib.Path(path).exists() else 0


def last_step(workdir: pathlib.Path) -> int:
  """The highest step in metrics.jsonl (0 if none yet; a torn last line is skipped)."""
  path = pathlib.Path(workdir) / "metrics.jsonl"
  try:
    rows = read_metrics(path) if path.exists() else []
  except Exception:  # noqa: BLE001 -- a line half-written right now: read again later
    return 0
  return max((r["step"] for r in rows), default=0)


def has_row(workdir: pathlib.Path, step: int, key: str) -> bool:
  """Whether metrics.jsonl has a row of `step` with `key` (a torn last line is skipped)."""
  path = pathlib.Path(workdir) / "metrics.jsonl"
  try:
    return path.exists() and any(r["step"] == step and key in r for r in read_metrics(path))
  except Exception:  # noqa: BLE001 -- a line half-written right now: read again later
    return False


def wait_for(proc: subprocess.Popen, predicate, timeout: float = 600, poll: float = 0.02) -> bool:
  """Polls `predicate()` until true (True) or the process ended / timed out (False)."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if predicate():
      return True
    if proc.poll() is not None:
      return bool(predicate())
    time.sleep(poll)
  return False


def kill(proc: subprocess.Popen, sig=signal.SIGKILL) -> int:
  if proc.poll() is None:
    proc.send_signal(sig)
  return proc.wait(120)


def committed(workdir: pathlib.Path) -> list[int]:
  """Steps of the committed checkpoints (orbax's renamed step directories)."""
  d = pathlib.Path(workdir) / "checkpoints"
  return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


def temp_dirs(workdir: pathlib.Path) -> list[str]:
  """Orbax temporary directories (an uncommitted save) left in checkpoints/."""
  d = pathlib.Path(workdir) / "checkpoints"
  return sorted(p.name for p in d.iterdir() if "tmp" in p.name) if d.is_dir() else []


def resumed_from(stdout: str) -> Optional[int]:
  """The step the (one) run whose stdout this is resumed from; None if it started afresh."""
  m = _RESUMED.search(stdout)
  return int(m.group(1)) if m else None



def preempted_at(stdout: str) -> Optional[int]:
  m = _PREEMPTED.search(stdout)
  return int(m.group(1)) if m else None


def metrics_problems(workdir: pathlib.Path, sft_steps: int = SFT_STEPS,
                     total: int = TOTAL_STEPS) -> list[str]:
  """What is wrong with a finished run's metrics.jsonl: a training step missing or logged twice,
  the held-out eval before RL (at step sft_steps) not logged exactly once."""
  rows = read_metrics(pathlib.Path(workdir) / "metrics.jsonl")
  steps = [r["step"] for r in rows if "data/hash" in r]
  before = [r for r in rows if r["step"] == sft_steps and "eval/accuracy" in r]
  out = [] if steps == list(range(1, total + 1)) else [f"training rows at steps {steps}"]
  return out + ([] if len(before) == 1 else [f"{len(before)} held-out-before rows"])


def straight_run(tmp_path_factory) -> pathlib.Path:
  """The workdir of one uninterrupted SYNC run, made once per pytest session, however many
  xdist workers ask (test_chaos.py and test_preemption.py both compare against it): the first
  to take the lock makes it in the directory the workers share, the others wait and read it.
  A failed run is not cached: its error is raised to every asker."""
  from filelock import FileLock
  root = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    root = root.parent                 # pytest-N/, above each worker's popen-gwK/
  workdir = root / "chaos-straight-run"
  with FileLock(f"{workdir}.lock"):
    if not (workdir / "final_model").exists():
      # an earlier asker's failed run left these: start straight, never resume it
      shutil.rmtree(workdir, ignore_errors=True)
      for log in (f"{workdir}.out", f"{workdir}.err"):
        pathlib.Path(log).unlink(missing_ok=True)
      rc, _ = run(workdir)
      if rc != 0:
        raise RuntimeError(f"the straight run exited {rc}: "
                           f"{pathlib.Path(f'{workdir}.err').read_text()[-3000:]}")
  return workdir


def weights(workdir: pathlib.Path) -> dict[str, np.ndarray]:
  ck = Checkpoint(pathlib.Path(workdir) / "final_model")
  return {n: np.array(a) for n, a in ck.items()}


def same_weights(a: dict, b: dict) -> bool:
  return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def async_accounting(workdir: pathlib.Path, rl_steps: int = RL_STEPS, p: int = P,
                     g: int = G) -> dict[str, int]:
  """Trajectories lost and trained twice across an async run's resumes, counted from what it
  recorded: the final checkpoint's replay state (cumulative counters restored at every resume,
  queued groups, unfinished work, tasks drawn) and metrics.jsonl's per-step `replay/trained`.

  - trajectories: generated = trained + dropped (by reason) + queued, else the difference is
    lost (> 0) or counted twice (< 0);
  - tasks: each drawn task is one completed group (trained, dropped or queued) or unfinished
    work, never both and never neither;
  - steps: every RL step 1..rl_steps logged once, each trained p·g trajectories, and their sum
    is the checkpoint's trained total.
  """
  workdir = pathlib.Path(workdir)
  last = committed(workdir)[-1]
  state = Checkpointer(workdir / "checkpoints").read_extra(last)["rollouts"]
  q, total = state["queue"], state["queue"]["total"]
  queued = (sum(len(gr["trajectories"]) for gr in q["ready"])
            + sum(len(gr["trajectories"]) for gr in q["incomplete"]))
  dropped = sum(v for k, v in total.items() if k.startswith("dropped_") and "groups" not in k)
  traj = total["generated"] - total["trained"] - dropped - queued
  backlog = {int(k) for k, _ in q["backlog"]}
  ready = [int(gr["group_id"].split("/")[0]) for gr in q["ready"]] if q["ready"] else []
  both = len(backlog & set(ready)) + (len(ready) - len(set(ready)))
  tasks = state["next_draw"] - (total["generated_groups"] + len(backlog) + len(q["incomplete"]))
  rows = [r for r in read_metrics(workdir / "metrics.jsonl") if "replay/trained" in r]
  per_step = collections.Counter(r["step"] for r in rows)
  trained_rows = sum(int(r["replay/trained"]) for r in rows)
  want = rl_steps * p * g
  lost = (max(traj, 0) + max(tasks, 0) + max(want - trained_rows, 0)
          + sum(1 for r in rows if r["replay/trained"] < p * g))
  twice = (max(-traj, 0) + max(-tasks, 0) + both + max(trained_rows - want, 0)
           + sum(n - 1 for n in per_step.values()) + abs(total["trained"] - trained_rows))
  return {"lost": lost, "duplicated": twice, "trained": total["trained"],
          "generated": total["generated"], "dropped": dropped, "queued": queued,
          "unfinished": len(backlog), "draws": state["next_draw"]}
