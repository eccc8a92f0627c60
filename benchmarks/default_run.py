"""Time to accuracy of the default run: README command 1, as a user runs it, to a held-out target.

    python benchmarks/default_run.py --out FILE.json [--gain 0.1 | --target A] [--every 25]
                                     [--budget_s 300] [--smoke]

Runs `launch/train.py` in its own process with configs/default.py (a tiny model built locally,
SFT warm-start on 2-digit addition, GRPO with the embedded JAX sampler), changed only in how
often it evaluates (every `--every` GRPO steps) and when it stops (after `--budget_s` s of
training). The target is fixed before the run: by default `--gain` above the run's own held-out
start (the warm start moves with library versions: 0.42 sampled, then 0.56 after a fresh
install; a fixed absolute target was once met at step 0 and then moved, which this rules out),
or an absolute `--target`. The metric is `--metric` (default: the default run's own, sampled
accuracy at the policy temperature). Every figure comes from the run's metrics.jsonl: seconds of
training (sampling + update, evals excluded: `time/train_s_total`), split into the SFT warm
start and GRPO, the median GRPO step, and the held-out curve. Not reached within the budget:
rl_s_to_target=inf. `--smoke`: 20 SFT and 4 GRPO steps, an eval every 2 (seconds, for CI).

This is the row "time-to-accuracy of the default run" of benchmarks/run_all.py; the race against
TRL's GRPOTrainer from a common warm start is benchmarks/time_to_accuracy.py. Ends with
`RESULT rl_s_to_target=… sft_s=… rl_s_per_step=… heldout_before=… heldout_reached=… rl_steps=…`.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

from benchmarks._meta import run_info, write_result  # noqa: E402


def curve(rows: list[dict], metric: str, sft_steps: int) -> dict:
  """The figures of one finished run's metrics rows (see the module docstring)."""
  key = f"eval/{metric}"
  evals = [r for r in rows if key in r]
  if not evals or evals[0]["step"] != sft_steps:
    raise SystemExit(f"metrics.jsonl has no held-out eval at the SFT -> GRPO boundary "
                     f"(step {sft_steps}, {key})")
  sft = [r for r in rows if r["step"] <= sft_steps and "time/train_s_total" in r]
  sft_s = max(r["time/train_s_total"] for r in sft)
  rl = [r for r in rows if "reward/mean" in r]
  points = [{"rl_step": r["step"] - sft_steps, "rl_train_s": r["time/train_s_total"] - sft_s,
             "heldout": r[key]} for r in evals]
  return {"sft_s": sft_s, "points": points,
          "rl_s_per_step": statistics.median(r["time/step_s"] for r in rl) if rl else float("nan"),
          "rl_steps": len(rl), "rl_train_s": rl[-1]["time/train_s_total"] - sft_s if rl else 0.0}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", required=True, help="the JSON summary")
  p.add_argument("--gain", type=float, default=0.1,
                 help="held-out accuracy to gain over the run's own start (the target)")
  p.add_argument("--target", type=float, default=None,
                 help="an absolute held-out accuracy to reach instead of --gain")
  p.add_argument("--metric", default="accuracy", choices=("accuracy", "accuracy_greedy"),
                 help="sampled (the default run's) or greedy held-out accuracy")
  p.add_argument("--every", type=int, default=25, help="GRPO steps between held-out evals")
  p.add_argument("--budget_s", type=float, default=300.0, help="training seconds at most")
  p.add_argument("--workdir", default=None, help="the run's workdir (default: a fresh temp dir)")
  p.add_argument("--smoke", action="store_true", help="a few steps of each phase (CI)")
  args = p.parse_args(argv)
  record = run_info(smoke=args.smoke)

  from configs.default import get_config
  sft_steps = 20 if args.smoke else get_config().sft.steps
  every = 2 if args.smoke else args.every
  workdir = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="default_run_"))
  cmd = [sys.executable, str(ROOT / "launch" / "train.py"), f"--workdir={workdir}", "--noresume",
         f"--config.eval.every_steps={every}",
         f"--config.eval.sampled={args.metric == 'accuracy'}",
         f"--config.train_budget_s={args.budget_s}"]
  if args.smoke:
    cmd += [f"--config.sft.steps={sft_steps}", "--config.rl.steps=4"]
  print(" ".join(cmd), flush=True)
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
  last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
  if proc.returncode != 0 or not last.startswith("RESULT "):
    raise SystemExit(f"launch/train.py failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
  print(last)

  from posttrain_jax.metrics import read_metrics
  result = json.loads((workdir / "result.json").read_text())
  c = curve(read_metrics(workdir / "metrics.jsonl"), args.metric, sft_steps)
  start = c["points"][0]["heldout"]
  target = args.target if args.target is not None else start + args.gain
  hit = next((pt for pt in c["points"] if pt["heldout"] >= target), None)
  print(f"\n{'GRPO step':>9} {'GRPO train s':>12} {'held-out ' + args.metric:>24}")
  for pt in c["points"]:
    print(f"{pt['rl_step']:>9} {pt['rl_train_s']:>12.1f} {pt['heldout']:>24.3f}")
  print(f"SFT warm start: {sft_steps} steps in {c['sft_s']:.1f} s; GRPO: {c['rl_steps']} steps, "
        f"median {c['rl_s_per_step']:.3f} s/step; stopped: {result.get('stopped', 'no')}")
  summary = {"args": vars(args), "workdir": str(workdir), "command": cmd, **c,
             "target": target, "rl_s_to_target": hit["rl_train_s"] if hit else float("inf"),
             "heldout_before": start,
             "heldout_reached": max(pt["heldout"] for pt in c["points"]),
             "stopped": result.get("stopped")}
  write_result(args.out, record, summary)
  print(f"RESULT target={target:.3f} rl_s_to_target={summary['rl_s_to_target']:.1f} "
        f"sft_s={c['sft_s']:.1f} "
        f"rl_s_per_step={c['rl_s_per_step']:.3f} heldout_before={summary['heldout_before']:.3f} "
        f"heldout_reached={summary['heldout_reached']:.3f} rl_steps={c['rl_steps']}")


if __name__ == "__main__":
  main()
