"""Multi-host equivalence: 2 processes × 4 CPU devices train what 1 process × 8 devices trains.

Both runs are the real entry points on the same config (the default tiny model on 1-digit
sums, a short SFT warm-start, then synchronous GRPO with the embedded sampler, checkpoints
every `--every` steps):

  one   `python launch/train.py`, one process, 8 forced host devices (fsdp = 8)
  two   `python launch/local.py --processes=2 --devices_per_process=4 -- python launch/train.py`:
        a 2-process jax.distributed job, fsdp = 8 across both; each process draws its own shard
        of the task bank and feeds its half of every global batch; killed with SIGKILL (the
        whole process group) as soon as checkpoint `--kill_after` is committed, then the same
        command again, which resumes every process from its own side-car and finishes

then compares the exported `final_model/` tensors. They are not bit-equal by construction:
the 2-process global batch holds the same rows in another order (process 0's, then process
1's), so sums are taken in another order (~1e-7 relative in the loss), and training amplifies
that: measured on 2-digit sums (same tasks, same token counts every step), the SFT loss of
the two runs agreed to 1e-7 at step 1, 2e-7 at step 20, 2e-4 at step 40 and 1e-2 at step 60
(AdamW at lr 3e-3 turns a sign flip of a ~0 gradient into a full step). So the horizon is
short: 20 SFT steps on 1-digit sums, where the tiny model already earns rewards (2-8 %), so
every GRPO step moves the weights. `params_equal=1` means
every tensor agrees within `--atol` (2e-5: a fifth of one GRPO step at lr 1e-4), every GRPO
step's loss within rtol 1e-4, every GRPO step's mean reward is the same (the same
completions were sampled: a token flips only if the drift crosses a sampling boundary), and
the held-out accuracies are equal. The table gives the
largest difference per tensor group.

    python benchmarks/multihost_equivalence.py --out runs/multihost.json [--smoke]
ends with `RESULT processes=2 params_equal=<0|1> max_abs_diff=... resumed_from=...`.
`--smoke`: the same three launches (1 process; 2 processes killed and resumed) with the fewest
steps that still cross every boundary: 1 SFT step, 2 GRPO steps, a checkpoint every step, the
kill after checkpoint 2 (the first GRPO step), so the rerun resumes inside GRPO and trains
step 3. Start-up and compiles dominate (minutes on a 2-core CPU); its figures are not headline
figures (at lr warm-up, the weights barely move).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))
from benchmarks._meta import run_info, write_result  # noqa: E402


def run_flags(args, workdir: pathlib.Path) -> list[str]:
  return [f"--workdir={workdir}",
          "--config.tasks.generator_config.min_digits=1",
          "--config.tasks.generator_config.max_digits=1",
          f"--config.sft.steps={args.sft_steps}", "--config.sft.batch_size=32",
          "--config.sft.batch.rows=32", "--config.sft.batch.max_seqs=32",
          "--config.sft.learner.optimizer.warmup_steps=5",
          f"--config.sft.learner.optimizer.decay_steps={args.sft_steps}",
          f"--config.rl.steps={args.rl_steps}", "--config.rl.prompts_per_step=16",
          "--config.rl.batch.rows=128", "--config.rl.batch.max_seqs=128",
          "--config.eval.every_steps=0", "--config.tasks.eval_size=32",
          f"--config.checkpoint.every_steps={args.every}", "--config.checkpoint.max_to_keep=10"]


def _env(devices: int) -> dict:
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
  env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  return env


def one_process(args, workdir) -> tuple[float, str]:
  t0 = time.perf_counter()
  out = subprocess.run([sys.executable, str(ROOT / "launch/train.py"), "--noresume",
                        *run_flags(args, workdir)], cwd=ROOT, env=_env(8), text=True,
                       capture_output=True, timeout=args.timeout)
  if out.returncode:
    raise SystemExit(f"1-process run failed ({out.returncode}):\n{out.stderr[-3000:]}")
  return time.perf_counter() - t0, out.stdout.strip().splitlines()[-1]


def _committed(workdir: pathlib.Path, step: int) -> bool:
  return (workdir / "checkpoints" / str(step) / "_CHECKPOINT_METADATA").exists()


def two_processes(args, workdir) -> tuple[float, int, str]:
  """(seconds, the step the rerun resumed from, its RESULT line)."""
  cmd = [sys.executable, str(ROOT / "launch/local.py"), "--processes=2",
         "--devices_per_process=4", "--", sys.executable, str(ROOT / "launch/train.py")]
  t0 = time.perf_counter()
  log = open(workdir.parent / "two_first.log", "w")
  first = subprocess.Popen([*cmd, "--noresume", *run_flags(args, workdir)], cwd=ROOT,
                           env=_env(4), stdout=log, stderr=subprocess.STDOUT,
                           start_new_session=True)
  deadline = time.monotonic() + args.timeout
  while not _committed(workdir, args.kill_after):
    if first.poll() is not None:
      raise SystemExit(f"the 2-process run ended ({first.returncode}) before checkpoint "
                       f"{args.kill_after}; see {log.name}")
    if time.monotonic() > deadline:
      os.killpg(first.pid, signal.SIGKILL)
      raise SystemExit(f"no checkpoint {args.kill_after} within {args.timeout} s")
    time.sleep(0.05)
  os.killpg(first.pid, signal.SIGKILL)      # the launcher and both training processes
  first.wait()
  log.close()
  second = subprocess.run([*cmd, *run_flags(args, workdir)], cwd=ROOT, env=_env(4), text=True,
                          capture_output=True, timeout=args.timeout)
  (workdir.parent / "two_second.log").write_text(second.stdout + second.stderr)
  if second.returncode:
    raise SystemExit(f"the resumed 2-process run failed ({second.returncode}):\n"
                     f"{second.stdout[-3000:]}")
  resumed = [line for line in second.stdout.splitlines() if "resumed from" in line]
  step = int(resumed[0].split("(step ")[1].rstrip(")")) if resumed else -1
  return time.perf_counter() - t0, step, second.stdout.strip().splitlines()[-1]


def rl_rows(workdir: pathlib.Path) -> list[tuple[int, dict]]:
  """(step, row) of every GRPO step in metrics.jsonl (the resumed run's rows once each)."""
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  return [(r["step"], r) for r in rows if "reward/mean" in r]


def tensors(model_dir: pathlib.Path) -> dict[str, np.ndarray]:
  from safetensors.numpy import load_file
  out = {}
  for f in sorted(model_dir.glob("*.safetensors")):
    out.update(load_file(str(f)))
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", required=True, help="write the figures here (JSON)")
  ap.add_argument("--sft_steps", type=int, default=20,
                  help="enough for rewards > 0 on 1-digit sums, so the GRPO steps move the weights")
  ap.add_argument("--rl_steps", type=int, default=4)
  ap.add_argument("--every", type=int, default=2, help="checkpoint every N steps")
  ap.add_argument("--kill_after", type=int, default=22,
                  help="kill the 2-process run once this step's checkpoint is committed")
  ap.add_argument("--atol", type=float, default=2e-5,
                  help="below one GRPO step of lr 1e-4 (what a wrong batch would move a weight)")
  ap.add_argument("--timeout", type=float, default=1200)
  ap.add_argument("--workdir", default=None, help="default: a temporary directory")
  ap.add_argument("--smoke", action="store_true",
                  help="1 SFT + 2 GRPO steps, a checkpoint every step, killed after step 2 "
                       "(the real 2-process kill and resume, fewest steps; for CI)")
  args = ap.parse_args()
  info = run_info(smoke=args.smoke)
  if args.smoke:
    args.sft_steps, args.rl_steps, args.every, args.kill_after = 1, 2, 1, 2
  base = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="multihost_"))
  shutil.rmtree(base, ignore_errors=True)
  base.mkdir(parents=True)
  one_s, one_result = one_process(args, base / "one")
  two_s, resumed, two_result = two_processes(args, base / "two")
  a, b = tensors(base / "one" / "final_model"), tensors(base / "two" / "final_model")
  if sorted(a) != sorted(b):
    raise SystemExit(f"the exports hold different tensors: {sorted(set(a) ^ set(b))}")
  diffs = {k: float(np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64))))
           for k in a}
  groups: dict[str, list[float]] = {}
  for k, d in diffs.items():
    groups.setdefault(".".join(p for p in k.split(".") if not p.isdigit()), []).append(d)
  print(f"{'tensor group':46s} {'n':>3s} {'max |Δ|':>10s}")
  for g, ds in sorted(groups.items()):
    print(f"{g:46s} {len(ds):3d} {max(ds):10.2e}")
  res = lambda line: dict(kv.split("=") for kv in line.split()[1:])  # noqa: E731
  r1, r2 = res(one_result), res(two_result)
  same_eval = all(r1[k] == r2[k] for k in ("heldout_before", "heldout_after"))
  rl1, rl2 = rl_rows(base / "one"), rl_rows(base / "two")
  print(f"{'RL step':>8s} {'reward (1 proc)':>16s} {'reward (2 proc)':>16s} {'loss (1)':>10s} "
        f"{'loss (2)':>10s}")
  for (s, a), (_, b) in zip(rl1, rl2):
    print(f"{s:8d} {a['reward/mean']:16.4f} {b['reward/mean']:16.4f} {a.get('loss', 0):10.6f} "
          f"{b.get('loss', 0):10.6f}")
  same_rewards = [a["reward/mean"] for _, a in rl1] == [b["reward/mean"] for _, b in rl2]
  same_loss = len(rl1) == len(rl2) and bool(np.allclose(
      [a.get("loss", 0.0) for _, a in rl1], [b.get("loss", 0.0) for _, b in rl2], rtol=1e-4,
      atol=1e-7))
  trained = sum(a.get("loss", 0.0) != 0.0 for _, a in rl1)
  worst = max(diffs.values())
  equal = int(worst <= args.atol and same_eval and same_rewards and same_loss)
  print(f"1 process x 8 devices: {one_s:.1f} s   {one_result}")
  print(f"2 processes x 4 devices (killed after checkpoint {args.kill_after}, resumed from "
        f"{resumed}): {two_s:.1f} s   {two_result}")
  print(f"GRPO steps with a non-zero loss (weights moved by RL): {trained} of {len(rl1)}; "
        f"per-step rewards equal: {same_rewards}; losses within rtol 1e-4: {same_loss}")
  report = {"processes": 2, "params_equal": equal, "max_abs_diff": worst, "atol": args.atol,
            "rl_steps_trained": trained, "rewards_equal": same_rewards, "losses_equal": same_loss,
            "resumed_from": resumed, "kill_after": args.kill_after, "one_s": one_s,
            "two_s": two_s, "one_result": r1, "two_result": r2, "per_tensor": diffs,
            "workdir": str(base)}
  write_result(args.out, info, report)
  print(f"RESULT processes=2 params_equal={equal} max_abs_diff={worst:.2e} "
        f"resumed_from={resumed}")


if __name__ == "__main__":
  main()
