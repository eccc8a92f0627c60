"""kill -9 a real training run at random moments and at the worst ones, resume it, check it.

    python benchmarks/chaos_resume.py [--trials 20] [--seed 0] [--out chaos.json] [--workdir DIR]

Each trial starts `python launch/train.py` (tests/support/chaos.py: the tiny model, SFT 4 steps
then GRPO 6 steps, a checkpoint every 2 steps), SIGKILLs it, and reruns the same command to the
end. The kill points cycle through: a random time (seeded: a random 0-1.5 s after metrics.jsonl
shows a random step 0..9 -- 0: the start; in a rerun, once it rewrote the file -- so it lands
anywhere in start-up, compilation, a step, a metrics write or a save; killed again so in the
first rerun), inside a checkpoint save after every file but before orbax's commit rename (the
crash hook `POSTTRAIN_JAX_CRASH_AT=save:<step>`, posttrain_jax/checkpoint.py), the SFT -> GRPO
boundary (its save, or `export:<step>`: sft_model/ written, the boundary checkpoint not yet),
with `checkpoint.async_save=True` (the save in flight in orbax's thread), and in
`rl.mode="async"`.
A trial passes when every rerun resumed from the last checkpoint that was complete at the kill
(no orbax temporary directory read, none left), finished with every step logged once in
metrics.jsonl, and: sync, its final params equal an uninterrupted run's bit for bit; async, no
trajectory was lost or trained twice
(chaos_testing.async_accounting: the final checkpoint's replay counters, queue and unfinished
work, and metrics.jsonl's per-step `replay/trained`).

A kill that lands after the run already finished (exit 0) tests no resume: such a trial is
counted in `finished_before_kill`, never in `resumed` (which counts the trials killed mid-run
whose reruns passed every check above).

Prints a table (trial, kill point, kill time, resumed from step, outcome), writes the trials to
`--out`, and ends with `RESULT trials=… killed_mid_run=… resumed=… finished_before_kill=…
failed=… lost=… duplicated=… sync_params_bitwise_equal=<equal>/<sync trials killed mid-run>`.
`--smoke`: 2 trials (a random kill and a kill inside a save), for CI.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import random
import shutil
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks._meta import run_info, write_result  # noqa: E402
from tests.support import chaos as ct  # noqa: E402

B, T = ct.SFT_STEPS, ct.TOTAL_STEPS   # the boundary step, the last step
# (name, flags, crash point or None for a random time); save:<step> steps are checkpoint steps
KINDS = [
    ("sync", ct.SYNC, None), ("sync", ct.SYNC, "save:rl"), ("sync", ct.SYNC, f"save:{B}"),
    ("sync", ct.SYNC, f"export:{B}"),
    ("sync+async_save", ct.SYNC + ct.ASYNC_SAVE, None),
    ("sync+async_save", ct.SYNC + ct.ASYNC_SAVE, "save:rl"),
    ("async", ct.ASYNC, None), ("async", ct.ASYNC, "save:rl"),
]
RL_SAVES = [s for s in range(B + 2, T + 1, 2)]


def kill_once(workdir: pathlib.Path, flags, crash_at, at: tuple[int, float]) -> dict:
  """Starts the run; SIGKILLs it `at` = (step, s): `s` seconds after metrics.jsonl first shows
  `step` (crash_at None), or lets the hook kill it. Returns what the kill left: the time since
  the start, the last complete checkpoint, the last metrics step."""
  metrics, out = workdir / "metrics.jsonl", pathlib.Path(f"{workdir}.out")
  stale = metrics.stat().st_ino if metrics.exists() else None   # a killed run's rows
  before = out.stat().st_size if out.exists() else 0
  t0 = time.monotonic()
  p = ct.start(workdir, flags, crash_at=crash_at)
  if crash_at is None:   # this run's rows: the file was rewritten (a new inode) when it started
    ct.wait_for(p, lambda: ct.last_step(workdir) >= at[0] and (
        stale is None or (metrics.exists() and metrics.stat().st_ino != stale)))
    ct.wait_for(p, lambda: False, timeout=at[1])
    rc = ct.kill(p)
  else:
    rc = p.wait(900)
  kept = ct.committed(workdir)
  return {"rc": rc, "kill_s": time.monotonic() - t0, "complete": kept[-1] if kept else None,
          "temp": ct.temp_dirs(workdir), "logged": ct.last_step(workdir),
          "resumed_from": ct.resumed_from(ct.since(out, before))}


def trial(i: int, rng: random.Random, root: pathlib.Path, ref) -> dict:
  mode, flags, point = KINDS[i % len(KINDS)]
  if point == "save:rl":
    point = f"save:{rng.choice(RL_SAVES)}"
  workdir = root / f"trial{i:02d}"
  moments = [_random_moment(rng), _random_moment(rng)] if point is None else [None]
  kills = [kill_once(workdir, flags, point, at) for at in moments]  # random: twice
  rc, out = ct.run(workdir, flags)
  # every start after a kill resumed from the checkpoint complete at that kill (a start killed
  # before it said so: unknown, None); the last one must have said so
  got = [k["resumed_from"] for k in kills[1:]] + [ct.resumed_from(out)]
  want = [k["complete"] for k in kills]
  bad = [(g, w) for g, w in zip(got[:-1], want[:-1]) if g is not None and g != w]
  label = point or "random " + ",".join(f"{k}+{d:.1f}s" for k, d in moments)
  row = {"trial": i, "mode": mode, "point": label, "kills": kills,
         "resumed_from": got, "rc": rc}
  problems = []
  if rc != 0:
    problems.append(f"rerun exited {rc}")
  if bad or got[-1] != want[-1]:
    problems.append(f"resumed from {got}, complete at the kills {want}")
  if point and point.startswith("save:") and \
      kills[0]["temp"] != [f"{point[5:]}.orbax-checkpoint-tmp"]:   # killed mid-save, and only
    problems.append(f"the kill left {kills[0]['temp']}")
  if rc == 0 and ct.temp_dirs(workdir):
    problems.append(f"left {ct.temp_dirs(workdir)}")
  if rc == 0:
    problems += ct.metrics_problems(workdir)
  if rc == 0 and mode == "async":
    acc = ct.async_accounting(workdir)
    row.update(lost=acc["lost"], duplicated=acc["duplicated"], accounting=acc)
    if acc["lost"] or acc["duplicated"]:
      problems.append(f"lost {acc['lost']}, trained twice {acc['duplicated']}")
  elif rc == 0:
    row["params_equal"] = ct.same_weights(ct.weights(workdir), ref)
    if not row["params_equal"]:
      problems.append("final params differ from the uninterrupted run")
  # a kill that came after the run had finished (rc 0) tested no resume: counted apart
  row["finished_before_kill"] = any(k["rc"] == 0 for k in kills)
  row["ok"] = not problems
  row["resumed"] = row["ok"] and not row["finished_before_kill"]
  row["outcome"] = "; ".join(problems) or ("ok, but it had finished before the kill: no resume "
                                           "tested" if row["finished_before_kill"] else "ok")
  shutil.rmtree(workdir, ignore_errors=True)
  return row


def _random_moment(rng: random.Random) -> tuple[int, float]:
  return rng.randrange(T), rng.uniform(0.0, 1.5)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--trials", type=int, default=20)
  ap.add_argument("--smoke", action="store_true", help="2 trials (seconds, for CI)")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--out", default=None, help="write the trials as JSON here")
  ap.add_argument("--workdir", default=None, help="where runs go (default: a temp dir)")
  args = ap.parse_args()
  if args.smoke:
    args.trials = 2
  record = run_info(smoke=args.smoke)
  root = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="chaos_"))
  root.mkdir(parents=True, exist_ok=True)
  rng = random.Random(args.seed)

  t0 = time.monotonic()
  rc, _ = ct.run(root / "straight")
  span_s = time.monotonic() - t0
  if rc != 0:
    sys.exit(f"the uninterrupted run failed (exit {rc}); see {root}/straight.err")
  ref = ct.weights(root / "straight")
  print(f"uninterrupted run: {span_s:.1f} s", flush=True)
  print("kill point 'random k+d s': d seconds after metrics.jsonl shows step k; kill time: "
        "seconds after each start; resumed from: each rerun's step ('-': none logged: killed "
        "before it said, or started afresh)", flush=True)
  print(f"{'trial':>5}  {'mode':<16} {'kill point':<22} {'kill time':>12}  {'resumed from':<12} "
        "outcome", flush=True)
  rows = []
  for i in range(args.trials):
    r = trial(i, rng, root, ref)
    rows.append(r)
    times = ",".join(f"{k['kill_s']:.1f}" for k in r["kills"]) + " s"
    print(f"{i:>5}  {r['mode']:<16} {r['point']:<22} {times:>12}  "
          f"{','.join('-' if s is None else str(s) for s in r['resumed_from']):<12} "
          f"{r['outcome']}", flush=True)
  killed = [r for r in rows if not r["finished_before_kill"]]
  sync = [r for r in killed if r["mode"] != "async"]
  summary = {"trials": len(rows), "killed_mid_run": len(killed),
             "resumed": sum(r["resumed"] for r in rows),
             "finished_before_kill": len(rows) - len(killed),
             "failed": sum(not r["ok"] for r in rows),
             "lost": sum(r.get("lost", 0) for r in rows),
             "duplicated": sum(r.get("duplicated", 0) for r in rows),
             # of the sync trials killed mid-run: final params bit-identical to the straight run
             "sync_params_bitwise_equal": f"{sum(r.get('params_equal', False) for r in sync)}"
                                          f"/{len(sync)}"}
  write_result(args.out, record, {"summary": summary, "trials": rows})
  if not args.workdir:
    shutil.rmtree(root, ignore_errors=True)
  print("RESULT " + " ".join(f"{k}={v}" for k, v in summary.items()))


if __name__ == "__main__":
  main()
