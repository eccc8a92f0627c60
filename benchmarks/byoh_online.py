"""End to end: a harness calls the proxy, grades its answers, the online run learns from them.

One process, two sides, on the default run's model (configs/default.py: the tiny model, SFT on
2-digit addition):
  harness   `--clients` threads, each: draw a training task, POST /v1/chat/completions (its own
            session), grade the answer with the task bank's grader, POST the grade to
            /v1/sessions/{id}/feedback; again, until the run's last weights are served
  trainer   launch/train.py's Trainer with rl.mode="traces" and online serving: SFT, then each
            step takes `--sessions_per_step` graded sessions (one trajectory each, running
            baseline, TIS against the recorded log-probs), trains, and swaps the new weights
            into the serving engine while the harness keeps calling
Reported: held-out accuracy of the served weights before and after (the trainer's eval on tasks
the harness never sees), the harness's own success per policy version, calls made / failed
(a failure is any non-200 or connection error before the proxy began to stop; calls refused
once it was stopping are counted apart), swaps, the staleness
of what was trained. Ends with
`RESULT heldout_before=… heldout_after=… calls=… failed=… swaps=… success_first=… success_last=…`.

    python benchmarks/byoh_online.py --out FILE.json [--workdir DIR] [--steps 120] [--smoke]

`--smoke`: 2 SFT and 2 online steps of 2 sessions, 1 client, 16 held-out tasks, in a fresh
temporary --workdir unless one is given (seconds, for CI).
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import pathlib
import shutil
import socket
import sys
import tempfile
import threading
import time

import httpx
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

from benchmarks._meta import run_info, write_result  # noqa: E402


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def fresh_workdir(args, name: str) -> pathlib.Path:
  """`args.workdir` emptied, or runs/<name> (--smoke: a new temporary directory)."""
  if args.workdir is None:
    args.workdir = (pathlib.Path(tempfile.mkdtemp(prefix=f"{name}_smoke_")) if args.smoke
                    else pathlib.Path("runs") / name)
  if args.workdir.exists():
    shutil.rmtree(args.workdir)
  return args.workdir


def wait_serving(url: str, stop: threading.Event | None = None) -> bool:
  """Polls `url`/health until the online proxy answers (False: `stop` was set first)."""
  while stop is None or not stop.is_set():
    try:
      httpx.get(url + "/health", timeout=1)
      return True
    except httpx.HTTPError:
      time.sleep(0.2)
  return False


def _config(args, port: int):
  spec = importlib.util.spec_from_file_location("default_config", ROOT / "configs" / "default.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  c = mod.get_config()
  c.workdir = str(args.workdir / "run")
  c.sft.steps = args.sft_steps
  c.rl.update(mode="online", steps=args.steps, prompts_per_step=args.sessions_per_step,
              reference_kl=False)
  c.rl.traces.update(wait_s=300.0, settle_s=0.0, max_staleness=args.max_staleness)
  c.rl.traces.store.update(path=str(args.workdir / "traces.db"), synchronous="NORMAL")
  c.rl.traces.online.update(port=port)
  c.rl.advantage.estimator = "running"
  c.rl.learner.optimizer.update(learning_rate=args.lr, warmup_steps=5)
  c.rl.batch.update(rows=args.sessions_per_step, max_seqs=args.sessions_per_step)
  c.eval.update(every_steps=max(args.steps // 4, 1))
  c.checkpoint.update(every_steps=10_000)
  if getattr(args, "smoke", False):
    c.tasks.update(eval_size=16)
    c.eval.update(samples_per_prompt=1)
  from posttrain_jax.run_config import run_config_from_dict
  return run_config_from_dict(c.to_dict())


class Harness:
  """The user's agent: calls, grades, posts the grade (module docstring)."""

  def __init__(self, url: str, cfg, clients: int):
    from posttrain_jax.tasks import TaskBank
    from posttrain_jax.graders import make_grader
    import dataclasses
    self.url, self.clients = url, clients
    self.tasks = TaskBank(dataclasses.replace(cfg.tasks, seed=cfg.tasks.seed + 1)).iterator()
    self.grader = make_grader(cfg.grader)
    self.max_tokens = cfg.rl.rollout.max_tokens
    self.lock, self.stop = threading.Lock(), threading.Event()
    self.calls: list[dict] = []       # t, version, reward, latency_s, ok, error
    self._n = 0

  def _one(self, client: httpx.Client) -> None:
    with self.lock:
      task, k = next(self.tasks), self._n
      self._n += 1
    session = f"h{k}"
    t0 = time.time()
    try:
      r = client.post(self.url + "/v1/chat/completions", headers={"X-Session-Id": session},
                      json={"model": "posttrain_jax", "messages": task.messages,
                            "max_tokens": self.max_tokens, "temperature": 1.0})
    except httpx.HTTPError as e:
      self.calls.append({"t": t0, "ok": False, "error": repr(e), "version": -1})
      time.sleep(0.2)
      return
    rec = {"t": t0, "latency_s": time.time() - t0, "ok": r.status_code == 200}
    if not rec["ok"]:
      rec.update(error=f"{r.status_code} {r.text[:200]}", version=-1)
      self.calls.append(rec)
      return
    body = r.json()
    text = body["choices"][0]["message"]["content"] or ""
    reward = float(self.grader(text, task).reward)
    rec.update(version=int(r.headers["X-Policy-Version"]), reward=reward)
    try:
      fb = client.post(f"{self.url}/v1/sessions/{session}/feedback", json={"grade": reward})
      rec["graded"] = fb.status_code == 200
    except httpx.HTTPError as e:   # the grade is lost, not the call: counted apart
      rec.update(graded=False, error=repr(e))
    self.calls.append(rec)

  def run(self) -> None:
    def loop():
      with httpx.Client(timeout=120) as client:
        while not self.stop.is_set():
          self._one(client)
    threads = [threading.Thread(target=loop, daemon=True) for _ in range(self.clients)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", required=True, help="the JSON summary")
  p.add_argument("--workdir", type=pathlib.Path, default=None,
                 help="emptied first (default: runs/byoh_online; --smoke: a fresh temporary one)")
  p.add_argument("--sft_steps", type=int, default=350)
  p.add_argument("--steps", type=int, default=120, help="online RL steps")
  p.add_argument("--sessions_per_step", type=int, default=64)
  p.add_argument("--clients", type=int, default=8, help="concurrent harness threads")
  p.add_argument("--lr", type=float, default=1e-4)
  p.add_argument("--max_staleness", type=int, default=4,
                 help="sessions sampled more versions ago are not trained (counted); -1 = all")
  p.add_argument("--smoke", action="store_true",
                 help="2 SFT + 2 online steps of 2 sessions, 1 client (seconds, for CI)")
  args = p.parse_args()
  info = run_info(smoke=args.smoke)
  if args.smoke:
    args.sft_steps, args.steps, args.sessions_per_step, args.clients = 2, 2, 2, 1
  fresh_workdir(args, "byoh_online")
  port = _free_port()
  cfg = _config(args, port)
  from posttrain_jax.run import Trainer
  trainer = Trainer(cfg, log=print)
  harness = Harness(f"http://127.0.0.1:{port}", cfg, args.clients)

  def start_when_serving():
    if wait_serving(f"http://127.0.0.1:{port}", harness.stop):
      harness.run()
  side = threading.Thread(target=start_when_serving, daemon=True)
  side.start()
  t0 = time.time()
  result = trainer.run()
  harness.stop.set()
  side.join(timeout=60)
  closed_at = trainer.source.closed_at or time.time()
  minutes = (time.time() - t0) / 60
  during = [c for c in harness.calls if c["t"] < closed_at]
  failed = [c for c in during if not c["ok"]]
  after = len(harness.calls) - len(during)
  by_version = collections.defaultdict(list)
  for c in during:
    if c["ok"]:
      by_version[c["version"]].append(c["reward"])
  versions = sorted(by_version)
  from posttrain_jax.metrics import read_metrics
  rows = [r for r in read_metrics(pathlib.Path(cfg.workdir) / "metrics.jsonl")
          if "traces/sessions" in r]
  stale = [r["traces/staleness/p50"] for r in rows if r.get("traces/staleness/p50") == r.get(
      "traces/staleness/p50")]
  trained = sum(r.get("traces/sessions", 0) for r in rows)
  dropped = sum(r.get("traces/dropped_stale", 0) for r in rows)
  quarter = max(len(versions) // 4, 1)
  first = float(np.mean([x for v in versions[:quarter] for x in by_version[v]]))
  last = float(np.mean([x for v in versions[-quarter:] for x in by_version[v]]))
  lat = np.array([c["latency_s"] for c in during if c["ok"]]) * 1e3

  print(f"\n{'version':>8s} {'calls':>6s} {'success':>8s}")
  for v in versions[:3] + (["..."] if len(versions) > 6 else []) + versions[-3:]:
    if v == "...":
      print(f"{'...':>8s}")
      continue
    print(f"{v:8d} {len(by_version[v]):6d} {np.mean(by_version[v]):8.3f}")
  hb, ha = result["heldout_before"], result["heldout_after"]
  print(f"held-out accuracy of the served weights: {hb:.3f} -> {ha:.3f}")
  print(f"harness success, first / last quarter of versions: {first:.3f} -> {last:.3f}")
  ungraded = sum(1 for c in during if c["ok"] and not c.get("graded"))
  print(f"calls while serving: {len(during)}, failed: {len(failed)}, after shutdown: {after}, "
        f"grades not stored: {ungraded}; "
        f"latency p50 {np.percentile(lat, 50):.1f} ms, p99 {np.percentile(lat, 99):.1f} ms")
  print(f"swaps: {len(rows)}; trained staleness p50 (median over steps): "
        f"{float(np.median(stale)) if stale else float('nan'):.1f} versions; {minutes:.1f} min")
  print(f"sessions trained: {trained:.0f}; not trained as older than {args.max_staleness} "
        f"versions: {dropped:.0f} ({dropped / max(trained + dropped, 1):.3f})")
  summary = {"args": {k: str(v) for k, v in vars(args).items()}, "result": result,
             "calls": len(during), "failed": len(failed), "failures": failed[:10],
             "after_shutdown": after, "ungraded": ungraded, "swaps": len(rows),
             "success_by_version": {v: float(np.mean(by_version[v])) for v in versions},
             "success_first": first, "success_last": last,
             "latency_ms": {"p50": float(np.percentile(lat, 50)),
                            "p99": float(np.percentile(lat, 99))},
             "staleness_p50": stale, "sessions_trained": trained,
             "sessions_dropped_stale": dropped, "minutes": minutes}
  write_result(args.out, info, summary)
  print(f"RESULT heldout_before={hb:.3f} heldout_after={ha:.3f} calls={len(during)} "
        f"failed={len(failed)} swaps={len(rows)} success_first={first:.3f} "
        f"success_last={last:.3f}")


if __name__ == "__main__":
  main()
