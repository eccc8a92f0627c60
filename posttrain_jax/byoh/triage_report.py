"""The triage report: markdown + plots over triaged sessions, and scoring against planted labels.

`render_markdown` writes the summary (sessions, calls by status, grades, feedback), one row per
failure mode (sessions, share, what it means, example sessions), how often modes co-occur, the
commonest words of the feedback text (what reviewers keep saying), and, when `labels` (planted
modes per session) are given, each mode's precision and recall:

    precision(m) = |flagged(m) ∩ planted(m)| / |flagged(m)|
    recall(m)    = |flagged(m) ∩ planted(m)| / |planted(m)|

(NaN where the denominator is 0: nothing flagged / nothing planted). `write_report` adds
triage.png (sessions per mode; sampled tokens per session; grades) and the curated sets.
"""
from __future__ import annotations

import collections
import math
import os
import pathlib
import re
from typing import Mapping, Optional, Sequence

import numpy as np

from posttrain_jax.byoh.triage import (MODE_HELP, MODES, SessionFeatures, TriageConfig,
                                       curated_sets, write_sets)

_STOP = frozenset("""a an and are as at be but by for from had has have he her his i in is it its
me my not of on or our she should so that the their them then there they this to too was we were
what when which who will with would you your than been did does just only also into about""".split())


def evaluate(features: Sequence[SessionFeatures], labels: Mapping[tuple[str, str], set[str]]
             ) -> dict[str, dict[str, float]]:
  """Per mode planted anywhere or flagged anywhere: tp, fp, fn, precision, recall (NaN for 0/0).
  `labels`: the planted modes of each (tenant, session); sessions absent from it count as
  planted with nothing."""
  modes = sorted({m for f in features for m in f.modes} | {m for s in labels.values() for m in s})
  out = {}
  for m in modes:
    tp = sum(m in f.modes and m in labels.get(f.key, ()) for f in features)
    fp = sum(m in f.modes and m not in labels.get(f.key, ()) for f in features)
    fn = sum(m not in f.modes and m in labels.get(f.key, ()) for f in features)
    out[m] = {"tp": tp, "fp": fp, "fn": fn,
              "precision": tp / (tp + fp) if tp + fp else math.nan,
              "recall": tp / (tp + fn) if tp + fn else math.nan}
  return out


def feedback_terms(features: Sequence[SessionFeatures], top: int = 10) -> list[tuple[str, int]]:
  """The words (≥ 3 letters, not stop words) in the most sessions' feedback, with their count."""
  df: collections.Counter = collections.Counter()
  for f in features:
    if f.feedback:
      df.update({w for w in re.findall(r"[a-z]{3,}", f.feedback.lower()) if w not in _STOP})
  return df.most_common(top)


def _f(x: float) -> str:
  return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}"


def render_markdown(features: Sequence[SessionFeatures], cfg: TriageConfig = TriageConfig(),
                    labels: Optional[Mapping] = None, plot_name: Optional[str] = None) -> str:
  n = len(features)
  statuses = collections.Counter()
  for f in features:
    statuses.update(f.statuses)
  graded = [f.grade for f in features if f.grade is not None]
  out = ["# Trace triage", "",
         f"{n} session(s), {sum(f.calls for f in features)} call(s): "
         + (", ".join(f"{k} {v}" for k, v in sorted(statuses.items())) or "none") + ".",
         f"Graded: {len(graded)}" + (f" (mean grade {np.mean(graded):.3f})" if graded else "")
         + f"; with free-text feedback: {sum(bool(f.feedback) for f in features)}; "
         f"no failure mode: {sum(not f.modes for f in features)}.", "",
         "## Failure modes", "",
         "| mode | sessions | share | means | examples |", "|---|---:|---:|---|---|"]
  by_mode = collections.defaultdict(list)
  for f in features:
    for m in f.modes:
      by_mode[m].append(f)
  for m in MODES.names():
    hits = by_mode.get(m, [])
    ex = ", ".join(f"`{f.tenant}/{f.session}`" for f in hits[:cfg.examples])
    out.append(f"| `{m}` | {len(hits)} | {len(hits) / n if n else 0:.1%} | "
               f"{MODE_HELP.get(m, '')} | {ex} |")
  pairs = collections.Counter((a, b) for f in features for i, a in enumerate(f.modes)
                              for b in f.modes[i + 1:])
  out += ["", "Modes seen together: " + (", ".join(f"`{a}` + `{b}` {k}" for (a, b), k
                                                    in pairs.most_common(8)) or "none") + "."]
  terms = feedback_terms(features)
  out += ["", "## Feedback", "", "Words in the most sessions' feedback: "
          + (", ".join(f"{w} ({k})" for w, k in terms) or "no feedback") + "."]
  if labels is not None:
    out += ["", "## Against the planted labels", "",
            "| mode | planted | flagged | precision | recall |", "|---|---:|---:|---:|---:|"]
    for m, r in evaluate(features, labels).items():
      out.append(f"| `{m}` | {r['tp'] + r['fn']} | {r['tp'] + r['fp']} | {_f(r['precision'])} | "
                 f"{_f(r['recall'])} |")
  if plot_name:
    out += ["", f"![triage]({plot_name})"]
  return "\n".join(out) + "\n"


def _plot(features: Sequence[SessionFeatures], out_png: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
  names = MODES.names()
  axes[0].barh(names, [sum(m in f.modes for f in features) for m in names])
  axes[0].set_xlabel("sessions")
  axes[0].set_title("failure modes")
  axes[1].hist([f.sampled_tokens for f in features], bins=30)
  axes[1].set_xlabel("sampled tokens per session")
  grades = [f.grade for f in features if f.grade is not None]
  axes[2].hist(grades or [0.0], bins=20, range=(min(grades + [0.0]), max(grades + [1.0])))
  axes[2].set_xlabel(f"session grade ({len(grades)} graded)")
  fig.tight_layout()
  fig.savefig(out_png, dpi=100, format="png")
  plt.close(fig)


def write_report(features: Sequence[SessionFeatures], out_dir: str | pathlib.Path,
                 cfg: TriageConfig = TriageConfig(), labels: Optional[Mapping] = None
                 ) -> list[pathlib.Path]:
  """out_dir/triage.md, out_dir/triage.png and out_dir/sets/*.jsonl; their paths. Each file is
  written under a temporary name and renamed."""
  out_dir = pathlib.Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  png, md = out_dir / "triage.png", out_dir / "triage.md"
  _plot(features, out_dir / "triage.png.tmp")
  os.replace(out_dir / "triage.png.tmp", png)
  (out_dir / "triage.md.tmp").write_text(render_markdown(features, cfg, labels, png.name))
  os.replace(out_dir / "triage.md.tmp", md)
  sets = write_sets(curated_sets(features), out_dir / "sets")
  return [md, png, *sets.values()]
