"""Every headline benchmark in one go, one table (markdown + JSON).

Each benchmark runs as its own process (`python benchmarks/<name>.py ... --out <dir>/<name>.json`)
with settings sized so the whole suite fits in about 20 minutes on a 2-core CPU; its last
`RESULT key=value ...` line is parsed and the keys that matter go into the table. A benchmark
that fails, times out or needs something absent (vLLM, TRL) is a row saying so, and the rest
still run. The sizes here are smaller than each script's defaults: the table says what this
machine does and where the trade-offs lie (e.g. from which batch size vLLM outruns the embedded
sampler); the scripts' own defaults give the figures quoted in the issues.

    python benchmarks/run_all.py --out runs/bench/all.json [--md benchmarks/README.md]
                                 [--only name,name] [--full]

`--smoke` runs every script at its own `--smoke` size instead (seconds each: a check that the
suite runs, not figures). `--md` rewrites the block between the markers in that file (benchmarks/README.md keeps the
latest table with the machine and the command). `--full`: each script's own default sizes
(hours on a CPU; for an accelerator machine). Ends with one line
`RESULT benchmarks=<n> ok=<n> failed=<n> skipped=<n> seconds=<s>`.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import os
import pathlib
import platform
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from benchmarks._meta import run_info, write_result  # noqa: E402
BEGIN, END = "<!-- run_all:begin -->", "<!-- run_all:end -->"


@dataclasses.dataclass(frozen=True)
class Bench:
  """One row: which script, with which (quick) arguments, and the RESULT keys worth a column."""
  name: str                        # benchmarks/<name>.py
  what: str                        # what the row measures, for the table
  args: tuple[str, ...]            # quick settings (--out is added)
  keys: tuple[str, ...]            # RESULT keys shown in the table
  timeout_s: int                   # killed after this (a row "timeout")
  needs: tuple[str, ...] = ()      # importable modules it cannot run without
  full_only: str = ""              # why it runs only with --full (a "skipped" row otherwise)


SUITE = (
    Bench("learner_throughput", "learner train_step tokens/s and fraction of measured matmul peak",
          ("--hidden", "512", "--layers", "4", "--vocab", "8192", "--batch", "4",
           "--seq-len", "256", "--repeats", "3"),
          ("tokens_per_s", "peak_fraction"), 300),
    Bench("loss_kernel", "fused LM-head loss vs materialised logits: temp memory, time",
          ("--sizes", "small", "--repeats", "2"),
          ("memory_ratio", "time_ratio"), 300),
    Bench("rollout_throughput", "rollout tokens/s, embedded JAX sampler vs vLLM, same model and batch",
          (), ("jax_tokens_per_s", "vllm_tokens_per_s", "vllm_over_jax"), 300),
    Bench("async_vs_sync", "async actor pool vs generate-then-train, steps/s",
          ("--steps", "4", "--warmup", "2", "--rounds", "1", "--max_tokens", "96"),
          ("async_over_sync", "staleness", "engine_idle_fraction"), 300),
    Bench("weight_sync", "learner -> in-process vLLM weight sync, s per GB",
          ("--repeats", "2", "--hidden", "512", "--layers", "6", "--intermediate", "1024",
           "--vocab", "8192", "--heads", "8", "--kv-heads", "4"),
          ("weight_sync_s_per_gb",), 300, needs=("vllm",)),
    Bench("proxy_overhead", "recording proxy latency over the bare engine, calls/s",
          ("--calls", "100", "--concurrency", "16", "--calls_per_client", "5"),
          ("p50_overhead_ms", "p99_overhead_ms", "calls_per_s"), 300),
    # The target is relative to the run's own start (which moves with library versions), fixed
    # before the run: +0.10 held-out accuracy.
    Bench("default_run", "the default run (README command 1): GRPO seconds to +0.10 held-out "
          "accuracy over its own start",
          ("--gain", "0.1", "--every", "25", "--budget_s", "300"),
          ("target", "rl_s_to_target", "sft_s", "rl_s_per_step", "heldout_before",
           "heldout_reached"), 600),
    Bench("time_to_accuracy", "ours vs TRL GRPOTrainer from one warm start: seconds to targets",
          ("--seeds", "0", "--targets", "0.5", "--budget_s", "120", "--skip_trl",
           "--recipes", "same", "--work", "runs/bench/time_to_accuracy"),
          ("ours_s_to_target", "ours_s_per_step"), 900,
          full_only="its warm start searches SFT rounds for a 0.28 start (over 7 min here)"),
    Bench("trace_triage", "trace triage: failure-mode recall/precision on labelled sessions",
          ("--sessions", "150"), ("macro_precision", "macro_recall"), 120),
    Bench("lora", "LoRA vs full fine-tuning: learner step s and peak MB, vLLM sync MB and s",
          ("--model", "tiny", "--rank", "8", "--rows", "4", "--seq_len", "128", "--repeats", "2",
           "--syncs", "2"),
          ("lora_step_s", "full_step_s", "lora_peak_mb", "full_peak_mb", "lora_sync_mb",
           "full_sync_mb", "lora_sync_s", "full_sync_s"), 300),
)


def _parse_result(text: str) -> dict[str, str]:
  lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
  if not lines:
    return {}
  return dict(kv.split("=", 1) for kv in lines[-1].split()[1:] if "=" in kv)


def _missing(needs) -> list[str]:
  return [m for m in needs if importlib.util.find_spec(m) is None]


def run_one(b: Bench, outdir: pathlib.Path, full: bool, smoke: bool = False) -> dict:
  """Runs one benchmark (at its --smoke size with `smoke`); a row for the table."""
  row = {"name": b.name, "what": b.what, "keys": list(b.keys)}
  if b.full_only and not full and not smoke:
    return {**row, "status": "skipped", "why": f"--full only: {b.full_only}", "seconds": 0.0,
            "result": {}}
  missing = _missing(b.needs)
  if missing:
    return {**row, "status": "skipped", "why": f"{', '.join(missing)} not installed",
            "seconds": 0.0, "result": {}}
  out = outdir / f"{b.name}.json"
  args = ("--smoke",) if smoke else (() if full else b.args)
  cmd = [sys.executable, str(HERE / f"{b.name}.py"), *args, "--out", str(out)]
  log = outdir / f"{b.name}.log"
  t0 = time.monotonic()
  try:
    with open(log, "w") as f:
      proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=b.timeout_s,
                            cwd=HERE.parent, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
  except subprocess.TimeoutExpired:
    status = f"timeout ({b.timeout_s} s)"
  seconds = time.monotonic() - t0
  text = log.read_text(errors="replace")
  result = _parse_result(text)
  if status == "ok" and not result:
    status = "failed (no RESULT line)"
  row.update(status=status, seconds=round(seconds, 1), result=result, command=" ".join(cmd),
             log=str(log))
  if status != "ok":
    row["why"] = "\n".join(text.splitlines()[-5:])
  return row


def markdown(rows: list[dict], meta: dict) -> str:
  lines = [f"Machine: {meta['machine']}; {meta['date']}; `{meta['command']}` "
           f"({meta['seconds']:.0f} s in all).", "",
           "| benchmark | measures | figures | s | status |", "|---|---|---|---:|---|"]
  for r in rows:
    figs = ", ".join(f"{k}={r['result'][k]}" for k in r["keys"] if k in r["result"]) or "-"
    status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r.get('why', '')}"
    status = status.replace("\n", " ").replace("|", "/")[:160]
    lines.append(f"| {r['name']} | {r['what']} | {figs} | {r['seconds']:.0f} | {status} |")
  return "\n".join(lines)


def _write_md(path: pathlib.Path, table: str) -> None:
  """Replaces the block between the markers (or appends one)."""
  text = path.read_text() if path.exists() else ""
  block = f"{BEGIN}\n{table}\n{END}"
  if BEGIN in text and END in text:
    text = text[:text.index(BEGIN)] + block + text[text.index(END) + len(END):]
  else:
    text = text.rstrip() + ("\n\n" if text else "") + block + "\n"
  path.write_text(text)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", required=True, help="the table and every row's details (JSON)")
  ap.add_argument("--md", default=None, help="write the markdown table into this file")
  ap.add_argument("--only", default="", help="comma-separated subset of: "
                  + ",".join(b.name for b in SUITE))
  ap.add_argument("--full", action="store_true", help="each script's own default sizes")
  ap.add_argument("--smoke", action="store_true",
                  help="each script at its --smoke size (seconds; checks the suite runs)")
  a = ap.parse_args()
  info = run_info(smoke=a.smoke)
  names = [n for n in a.only.split(",") if n]
  unknown = sorted(set(names) - {b.name for b in SUITE})
  if unknown:
    ap.error(f"--only: unknown benchmark(s) {unknown}; valid: {[b.name for b in SUITE]}")
  suite = [b for b in SUITE if not names or b.name in names]
  out = pathlib.Path(a.out)
  outdir = out.with_suffix("")
  outdir.mkdir(parents=True, exist_ok=True)
  t0 = time.monotonic()
  rows = []
  for b in suite:
    print(f"[{time.monotonic() - t0:6.0f} s] {b.name} ...", flush=True)
    rows.append(run_one(b, outdir, a.full, a.smoke))
    r = rows[-1]
    print(f"         {r['status']} in {r['seconds']:.0f} s: "
          + " ".join(f"{k}={v}" for k, v in r["result"].items()), flush=True)
  meta = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
          "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
          "command": "python benchmarks/run_all.py " + " ".join(sys.argv[1:]),
          "seconds": time.monotonic() - t0, "python": platform.python_version()}
  table = markdown(rows, meta)
  print("\n" + table + "\n")
  write_result(str(out), info, {"meta": meta, "rows": rows})
  if a.md:
    _write_md(pathlib.Path(a.md), table)
  n_ok = sum(r["status"] == "ok" for r in rows)
  n_skip = sum(r["status"] == "skipped" for r in rows)
  print(f"RESULT benchmarks={len(rows)} ok={n_ok} failed={len(rows) - n_ok - n_skip} "
        f"skipped={n_skip} seconds={meta['seconds']:.0f}")
  return 0 if n_ok + n_skip == len(rows) else 1


if __name__ == "__main__":
  sys.exit(main())
