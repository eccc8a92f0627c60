"""Run metrics: one JSONL line per step, TensorBoard scalars, and an end-of-run PNG plot.

Only process 0 writes. The JSONL file is appended and flushed every step, so a killed run
keeps every step it finished; on resume, lines past the restored step are dropped first so
the file never holds a step twice.
"""
from __future__ import annotations

import json
import math
import pathlib
from typing import Iterable, Optional

import jax


class MetricsWriter:
  def __init__(self, workdir: str | pathlib.Path, tensorboard: bool = True,
               resume_step: Optional[int] = None):
    self.workdir = pathlib.Path(workdir)
    self.path = self.workdir / "metrics.jsonl"
    self._enabled = jax.process_index() == 0
    self._tb = None
    if not self._enabled:
      return
    self.workdir.mkdir(parents=True, exist_ok=True)
    if self.path.exists():
      keep = [r for r in read_metrics(self.path) if resume_step is not None and r["step"] <= resume_step]
      self.path.write_text("".join(json.dumps(r) + "\n" for r in keep))
    self._file = open(self.path, "a")
    if tensorboard:
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(str(self.workdir / "tensorboard"))

  def write(self, step: int, metrics: dict[str, float]) -> None:
    if not self._enabled:
      return
    row = {"step": step, **{k: _finite(v) for k, v in metrics.items()}}
    self._file.write(json.dumps(row) + "\n")
    self._file.flush()
    if self._tb is not None:
      for k, v in metrics.items():
        if isinstance(v, (int, float)) and math.isfinite(v):
          self._tb.add_scalar(k, v, step)

  def close(self) -> None:
    if not self._enabled:
      return
    self._file.close()
    if self._tb is not None:
      self._tb.close()


def _finite(v):
  if isinstance(v, float) and not math.isfinite(v):
    return None
  return v


def read_metrics(path: str | pathlib.Path) -> list[dict]:
  rows = []
  for line in pathlib.Path(path).read_text().splitlines():
    if line.strip():
      rows.append(json.loads(line))
  return rows


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
