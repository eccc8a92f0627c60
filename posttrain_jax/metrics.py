"""Run metrics: one JSONL line per step, TensorBoard scalars, and an end-of-run PNG plot.

Only process 0 writes. The JSONL file is appended and flushed every step, so a killed run
keeps every step it finished; on resume, lines past the restored step are dropped first so
the file never holds a step twice (the kept lines are written beside the file and renamed over
it, so a kill during that rewrite leaves the old file whole). The trainer's checkpoints also
record `rows`, the lines written when each was taken: given back as `resume_rows`, only those
are kept, so a row of the checkpoint's own step written after it (the held-out eval after the
SFT -> RL boundary checkpoint, the final eval) is not kept beside the one the resumed run
writes again. A last line cut by a kill
mid-write (no newline, not JSON) is the step that was being written: it is dropped with a
warning, and any other line that is not a JSON object is an error naming its line.

`time_to_target(rows, metric, target)`: the step and training seconds at which a run's rows
first reach a held-out accuracy.
"""
from __future__ import annotations

import json
import math
import pathlib
from typing import Iterable, Optional

import jax

from posttrain_jax.errors import DiskWriteError, UserError, disk_cause, disk_errno, disk_fix, free_note


class MetricsWriter:
  def __init__(self, workdir: str | pathlib.Path, tensorboard: bool = True,
               resume_step: Optional[int] = None, resume_rows: Optional[int] = None):
    self.workdir = pathlib.Path(workdir)
    self.path = self.workdir / "metrics.jsonl"
    self._enabled = jax.process_index() == 0
    self._tb = None
    self.rows = 0                  # lines in the file (kept on resume + written)
    if not self._enabled:
      return
    try:
      self.workdir.mkdir(parents=True, exist_ok=True)
      if self.path.exists():
        keep = [r for r in read_metrics(self.path)
                if resume_step is not None and r["step"] <= resume_step]
        keep = keep if resume_rows is None else keep[:resume_rows]
        self.rows = len(keep)
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
          tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
        except OSError:
          tmp.unlink(missing_ok=True)
          raise
        tmp.replace(self.path)
      self._file = open(self.path, "a")
    except OSError as e:
      raise self._disk_error("cannot be opened for writing", e) from e
    if tensorboard:
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(str(self.workdir / "tensorboard"))

  def write(self, step: int, metrics: dict[str, float]) -> None:
    if not self._enabled:
      return
    row = {"step": step, **{k: _finite(v) for k, v in metrics.items()}}
    try:
      self._file.write(json.dumps(row) + "\n")
      self._file.flush()
    except OSError as e:
      raise self._disk_error(f"the row of step {step} was not written", e) from e
    self.rows += 1
    if self._tb is not None:
      for k, v in metrics.items():
        if isinstance(v, (int, float)) and math.isfinite(v):
          self._tb.add_scalar(k, v, step)

  def _disk_error(self, what: str, e: OSError) -> DiskWriteError:
    """`e` (a write or open of metrics.jsonl) as an error naming the file and the fix. A row
    cut part-way is a torn last line, which the next resume drops (read_metrics)."""
    code = disk_errno(e)
    return DiskWriteError(
        f"metrics {self.path}: {what}: {disk_cause(code)}{free_note(code, self.workdir)}; the "
        f"complete rows before it are kept; {disk_fix(code, self.workdir, elsewhere=False)}, then "
        "rerun the same command to resume from the last checkpoint", code)

  def close(self) -> None:
    if not self._enabled:
      return
    try:
      self._file.close()
    except OSError:
      pass  # what it could not flush was reported by write()
    if self._tb is not None:
      self._tb.close()


def _finite(v):
  if isinstance(v, float) and not math.isfinite(v):
    return None
  return v


class MetricsFileError(UserError, ValueError):
  """A metrics.jsonl line that is not a step's row, with the file and line named."""


def read_metrics(path: str | pathlib.Path) -> list[dict]:
  """The rows of a metrics.jsonl; a torn last line (a kill mid-write) is dropped with a warning."""
  path = pathlib.Path(path)
  text = path.read_text()
  lines = text.splitlines()
  rows = []
  for lineno, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
    except json.JSONDecodeError as e:
      if lineno == len(lines) and not text.endswith("\n"):
        from absl import logging
        logging.warning("%s:%d: dropped a torn last line (%d bytes; the run was killed while "
                        "writing it)", path, lineno, len(line))
        break
      raise MetricsFileError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(row, dict) or not isinstance(row.get("step"), int):
      raise MetricsFileError(f"{path}:{lineno}: not a metrics row (a JSON object with an "
                             "integer \"step\")")
    rows.append(row)
  return rows


def time_to_target(rows: Iterable[dict], metric: str, target: float,
                   clock: str = "time/train_s_total") -> Optional[tuple[int, float]]:
  """`(step, rows[i][clock])` of the first row whose `metric` is ≥ `target`, or None if none is.

  With the default clock that is the training seconds (evals excluded) a run took to reach a
  held-out accuracy; the trainer writes the clock on every eval row.
  """
  for r in rows:
    value = r.get(metric)
    if value is not None and value >= target:
      if clock not in r:
        raise KeyError(f"row of step {r['step']} reaches {metric}={value} but has no {clock!r}")
      return r["step"], r[clock]
  return None


def plot_run(rows: list[dict], out_png: str | pathlib.Path,
             keys: Iterable[tuple[str, str]] = (("reward/mean", "reward"),
                                                 ("response_len/mean", "response length (tokens)"),
                                                 ("kl", "KL to reference"))) -> pathlib.Path:
  """One panel per metric over steps (held-out accuracy overlaid on the reward panel)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  keys = list(keys)
  fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.6 * len(keys)), sharex=True)
  for ax, (key, label) in zip(axes, keys):
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    if pts:
      ax.plot(*zip(*pts), label=label)
    if key == "reward/mean":
      ev = [(r["step"], r["eval/accuracy"]) for r in rows if r.get("eval/accuracy") is not None]
      if ev:
        ax.plot(*zip(*ev), "o-", label="held-out accuracy")
      ax.legend(loc="lower right")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    if not pts:
      ax.text(0.5, 0.5, f"{key}: not logged in this run", transform=ax.transAxes, ha="center")
  axes[-1].set_xlabel("step")
  fig.tight_layout()
  out_png = pathlib.Path(out_png)
  fig.savefig(out_png, dpi=100)
  plt.close(fig)
  return out_png
