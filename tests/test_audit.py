"""The reward-hacking audit: each rule on a synthetic run that has (or lacks) its signature, the
window means against a plain loop, and launch/audit.py end to end in a subprocess."""
import json
import math
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from posttrain_jax import audit
from posttrain_jax.audit import AuditConfig
from posttrain_jax.errors import PathNotFoundError

ROOT = pathlib.Path(__file__).resolve().parents[1]
N = 40  # RL steps of a synthetic run: windows of 10 steps


def _run(n=N, start=101, eval_every=5, **signals):
  """Rows of a run: each signal (key with "/" spelled "__") goes linearly from a to b, plus a
  small deterministic wiggle; "eval__accuracy" is logged every `eval_every` steps only."""
  rows = []
  for i in range(n):
    row = {"step": start + i}
    for key, (a, b) in signals.items():
      name = key.replace("__", "/")
      if name == "eval/accuracy" and i % eval_every and i != n - 1:
        continue
      row[name] = a + (b - a) * i / (n - 1) + 0.002 * math.sin(i)
    rows.append(row)
  return rows


CLEAN = dict(reward__mean=(0.2, 0.8), eval__accuracy=(0.2, 0.7), response_len__mean=(50, 48),
             truncated_frac=(0.02, 0.02), infra_error_frac=(0.0, 0.01),
             zero_var_group_frac=(0.1, 0.6),  # grows as groups become all-correct: exempt
             status__timeout_frac=(0.05, 0.06), episode__malformed_call_rate=(0.01, 0.01))


def _names(report):
  return [(f.name, f.evidence and next(iter(f.evidence)).rsplit("/", 1)[0]) for f in report.flags]


def test_window_means_match_a_plain_loop():
  rng = np.random.default_rng(0)
  for n in (2, 3, 7, 40, 41):
    values = rng.uniform(0.5, 2.0, n).tolist()
    rows = [{"step": 10 + 3 * i, "response_len/mean": v} for i, v in enumerate(values)]
    s = audit.audit(rows, AuditConfig(min_steps=2)).signals["response_len/mean"]
    k = max(1, -(-n // 4))
    first, last = sum(values[:k]) / k, sum(values[n - k:]) / k
    assert (s.points, s.first_steps, s.last_steps) == (n, (10, 10 + 3 * (k - 1)),
                                                       (10 + 3 * (n - k), 10 + 3 * (n - 1)))
    assert s.first == pytest.approx(first, rel=1e-12) and s.last == pytest.approx(last, rel=1e-12)
    assert s.change == pytest.approx(last / first, rel=1e-12)


def test_change_from_a_zero_first_window():
  assert audit.change_ratio(0.0, 0.0) == 1.0
  assert audit.change_ratio(0.0, 0.3) == math.inf
  assert audit.change_ratio(0.0, -0.3) == -math.inf
  assert audit.change_ratio(0.2, 0.3) == pytest.approx(1.5)
  rows = _run(**CLEAN)
  for i, row in enumerate(rows):
    row["status/timeout_frac"] = 0.25 if i >= N - 10 else 0.0
  report = audit.audit(rows)
  s = report.signals["status/timeout_frac"]
  assert (s.first, s.last, s.change) == (0.0, 0.25, math.inf)
  assert _names(report) == [("timeout_rising", "status/timeout_frac")]


def test_clean_run_has_no_flag():
  report = audit.audit(_run(**CLEAN))
  assert report.enough_data and report.steps == N
  assert report.flags == () and report.notes == ()
  assert report.signals["filter/zero_var_group_frac"].delta > 0.3  # exempt, yet in the table
  md = audit.render_markdown(report)
  assert "No reward-hacking signature found." in md


def test_length_collapse_while_reward_stalls():
  report = audit.audit(_run(**{**CLEAN, "response_len__mean": (60, 20), "reward__mean": (0.3, 0.31),
                               "eval__accuracy": (0.3, 0.3)}))
  assert _names(report) == [("length_collapse", "response_len/mean")]
  (flag,) = report.flags
  length = report.signals["response_len/mean"]
  assert length.change < 0.7
  assert flag.evidence["response_len/mean/change"] == length.change
  assert flag.evidence["reward/mean/first"] == report.signals["reward/mean"].first
  assert f"{length.change:.2f}×" in flag.message and "stall" in flag.message


def test_length_collapse_with_rising_reward_is_judged_by_the_held_out_eval():
  """Reward and held-out accuracy both rising: shorter answers that generalise, a note, no flag.
  Reward rising but held-out flat: the grader is being gamed, a flag. No eval: a note."""
  base = {**CLEAN, "response_len__mean": (60, 20), "reward__mean": (0.2, 0.8)}
  legit = audit.audit(_run(**{**base, "eval__accuracy": (0.2, 0.7)}))
  assert legit.flags == ()
  (note,) = legit.notes
  assert "likely legitimate" in note
  gamed = audit.audit(_run(**{**base, "eval__accuracy": (0.4, 0.39)}))
  assert _names(gamed) == [("length_collapse", "response_len/mean")]
  assert "held-out eval/accuracy changed by only" in gamed.flags[0].message
  assert "eval/accuracy/last" in gamed.flags[0].evidence
  blind = audit.audit(_run(**{k: v for k, v in base.items() if k != "eval__accuracy"}))
  assert blind.flags == () and "no held-out eval/accuracy" in blind.notes[0]
  # held-out rises, but far less than the reward: most of the gain is the reward's own channel
  dodged = audit.audit(_run(**{**base, "eval__accuracy": (0.5, 0.6)}))
  assert _names(dodged) == [("length_collapse", "response_len/mean")]
  assert "does not carry over" in dodged.flags[0].message


def test_timeout_rising_on_hard_tasks():
  report = audit.audit(_run(**CLEAN, status__timeout_frac__hard=(0.05, 0.45),
                            status__timeout_frac__easy=(0.05, 0.05)))
  assert _names(report) == [("timeout_rising", "status/timeout_frac/hard")]
  hard = report.signals["status/timeout_frac/hard"]
  assert f"rose from {hard.first:.4g} to {hard.last:.4g}" in report.flags[0].message
  assert report.flags[0].evidence["status/timeout_frac/hard/change"] == hard.change > 1.5


@pytest.mark.parametrize("a, b, flagged", [
    (0.05, 0.25, True),    # +0.2, ×5
    (0.05, 0.13, False),   # +0.08: under the 0.1 rise
    (0.40, 0.55, False),   # +0.15 but ×1.375: under the 1.5 ratio
])
def test_timeout_rule_needs_both_the_rise_and_the_ratio(a, b, flagged):
  report = audit.audit(_run(**{**CLEAN, "status__timeout_frac": (a, b)}))
  assert bool(report.flags) == flagged, report.flags


def test_malformed_call_rate_rising():
  report = audit.audit(_run(**{**CLEAN, "episode__malformed_call_rate": (0.02, 0.2)}))
  assert _names(report) == [("malformed_rising", "episode/malformed_call_rate")]


def test_a_growing_filter_is_flagged_and_the_alias_is_read():
  report = audit.audit(_run(**CLEAN, filter__truncated_mask_frac=(0.0, 0.3)))
  assert _names(report) == [("filter_growing", "filter/truncated_mask_frac")]
  aliased = audit.audit(_run(**{**CLEAN, "infra_error_frac": (0.0, 0.4)}))
  assert _names(aliased) == [("filter_growing", "filter/infra_error_frac")]
  assert "infra_error_frac" not in aliased.signals  # read under its new name only
  exempt_off = audit.audit(_run(**CLEAN), AuditConfig(filter_exempt=()))
  assert _names(exempt_off) == [("filter_growing", "filter/zero_var_group_frac")]


def test_the_new_name_wins_over_its_alias_in_one_row():
  for row in ({"truncated_frac": 0.9, "status/truncated_frac": 0.1},
              {"status/truncated_frac": 0.1, "truncated_frac": 0.9}):  # either key order
    rows = [{"step": i, **row} for i in range(4)]
    assert audit.audit(rows).signals["status/truncated_frac"].first == 0.1


def test_too_few_steps_raise_no_flag():
  signature = {**CLEAN, "response_len__mean": (60, 10), "reward__mean": (0.3, 0.3),
               "episode__malformed_call_rate": (0.0, 0.5)}
  assert len(audit.audit(_run(n=16, **signature)).flags) == 2  # the same data, long enough
  report = audit.audit(_run(n=15, **signature))
  assert not report.enough_data and report.steps == 15 and report.flags == ()
  assert "Not enough data: 15 logged step(s)" in audit.render_markdown(report)


def test_absent_signals_are_listed_not_zero():
  rows = _run(reward__mean=(0.2, 0.8), response_len__mean=(30, 31))
  for row in rows[:20]:
    row["status/timeout_frac"] = None  # a NaN written as null: skipped, not 0
  for row in rows[20:]:
    row["status/timeout_frac"] = 0.3
  report = audit.audit(rows)
  assert "status/timeout_frac" in report.signals
  assert report.signals["status/timeout_frac"].points == 20
  assert report.signals["status/timeout_frac"].first == pytest.approx(0.3)
  assert report.absent == ("eval/accuracy", "episode/turns", "episode/tool_calls",
                           "episode/tool_call_rate", "episode/malformed_call_rate",
                           "episode/tool_errors/<cause>", "status/timeout_frac/<difficulty>",
                           "status/truncated_frac", "status/infra_error_frac",
                           "filter/<reason>_frac")
  assert report.flags == ()
  assert "`episode/turns`" in audit.render_markdown(report)


def test_families_are_audited_key_by_key():
  rows = _run(**CLEAN, episode__tool_errors__tool_timeout=(0.1, 0.5),
              episode__tool_errors__malformed=(0.2, 0.2))
  report = audit.audit(rows)
  names = list(report.signals)
  assert names.index("episode/tool_errors/malformed") < \
      names.index("episode/tool_errors/tool_timeout")
  assert "episode/tool_errors/<cause>" not in report.absent
  assert report.signals["episode/tool_errors/tool_timeout"].last > 0.4


def test_a_bad_config_value_names_the_field():
  with pytest.raises(ValueError, match="AuditConfig.window_frac"):
    AuditConfig(window_frac=0.75)
  with pytest.raises(ValueError, match="AuditConfig.min_steps"):
    AuditConfig(min_steps=1)


def test_load_metrics_names_the_bad_line(tmp_path):
  path = tmp_path / "metrics.jsonl"
  with pytest.raises(PathNotFoundError, match="metrics.jsonl does not exist"):
    audit.load_metrics(path)
  path.write_text('{"step": 1, "reward/mean": 0.1}\n\n{"step": 2, "reward/mean": "high"}\n')
  with pytest.raises(audit.AuditError, match=r"metrics.jsonl:3: step 2: 'reward/mean' is 'high'"):
    audit.load_metrics(path)
  path.write_text('{"step": 1}\n["step", 2]\n')
  with pytest.raises(audit.AuditError, match=r"metrics.jsonl:2: not a metrics row"):
    audit.load_metrics(path)


def test_write_report(tmp_path):
  rows = _run(**{**CLEAN, "episode__malformed_call_rate": (0.02, 0.2)})
  report = audit.audit(rows)
  md_path, png_path = audit.write_report(report, rows, tmp_path / "out")
  assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  md = md_path.read_text()
  s = report.signals["episode/malformed_call_rate"]
  assert (f"| `episode/malformed_call_rate` | {N} | {s.first:.4g} | {s.last:.4g} | "
          f"{s.change:.4g} | 101–110 | 131–140 |") in md
  assert md.count("| `") == len(report.signals)
  assert "**malformed_rising**" in md and audit.WHY["malformed_rising"] in md
  assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["audit.md", "audit.png"]


def _cli(tmp_path, *flags):
  return subprocess.run([sys.executable, str(ROOT / "launch" / "audit.py"), *flags],
                        capture_output=True, text=True, timeout=120, cwd=tmp_path)


def _write(workdir, rows, extra=""):
  workdir.mkdir()
  (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + extra)


def test_cli_end_to_end(tmp_path):
  run = tmp_path / "run"
  _write(run, _run(**CLEAN, filter__stale_frac=(0.0, 0.3)))
  out = _cli(tmp_path, f"--workdir={run}")
  assert out.returncode == 0, out.stderr[-3000:]
  lines = out.stdout.strip().splitlines()
  assert lines[-1] == f"RESULT flags=1 signals={len(CLEAN) + 1}"
  assert "| `filter/stale_frac` |" in out.stdout and "**filter_growing**" in out.stdout
  assert (run / "audit" / "audit.md").read_text().count("**filter_growing**") == 1
  assert (run / "audit" / "audit.png").stat().st_size > 0
  gated = _cli(tmp_path, f"--workdir={run}", f"--out={tmp_path / 'ci'}", "--fail_on_flags")
  assert gated.returncode == 2 and (tmp_path / "ci" / "audit.md").exists()
  short = _cli(tmp_path, f"--workdir={run}", "--min_steps=41", "--fail_on_flags")
  assert short.returncode == 0 and short.stdout.strip().endswith("RESULT flags=0 signals=9")


def _error_line(out) -> str:
  assert out.returncode == 1, (out.returncode, out.stdout[-2000:], out.stderr[-2000:])
  assert "Traceback" not in out.stdout + out.stderr, out.stderr[-3000:]
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
  return lines[0]


def test_cli_errors(tmp_path):
  missing = tmp_path / "no_such_run"
  assert _error_line(_cli(tmp_path, f"--workdir={missing}")) == \
      f"error: --workdir={missing}: no such directory"
  assert "--workdir is required" in _error_line(_cli(tmp_path))
  empty = tmp_path / "empty"
  empty.mkdir()
  assert _error_line(_cli(tmp_path, f"--workdir={empty}")) == (
      f"error: {empty / 'metrics.jsonl'} does not exist (a run's workdir holds metrics.jsonl)")
  bad = tmp_path / "bad"
  _write(bad, _run(n=3, **CLEAN), extra='{"step": 104, "reward/mean": 0.5\n')
  assert _error_line(_cli(tmp_path, f"--workdir={bad}")).startswith(
      f"error: {bad / 'metrics.jsonl'}:4: not valid JSON")
  assert not (bad / "audit").exists()
