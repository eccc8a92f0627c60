"""Fuzzed inputs at every edge that reads the outside world, with >= 10k cases in all.

    python benchmarks/fuzz_inputs.py [--out fuzz.json] [--trace 2000 --request 4000 ...] [--smoke]

The properties are tests/support/fuzz.py's (the ones tests/test_fuzz_inputs.py runs with CI
budgets): trace JSONL import, proxy request bodies (parsed directly, and POSTed to a real
uvicorn proxy), task files, config overrides, HF config.json. Each case is either accepted
(ok), refused with the project's clear error naming the field / line (rejected), or breaks
the contract (a defect: another exception type, a 5xx, a wrong line, a record lost or
half-written). Prints a table, writes per-edge counts and the first defects to `--out`, and
ends with `RESULT cases=<n> defects=<n>`. `--smoke`: a handful of cases per edge (seconds, for CI).
"""
from __future__ import annotations

import argparse
import collections
import os
import pathlib
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402

from benchmarks._meta import run_info, write_result  # noqa: E402
from tests.support import fuzz as fz  # noqa: E402

EDGES = ("trace", "request", "http", "tasks", "overrides", "hf_config")
DEFAULTS = {"trace": 2000, "request": 4000, "http": 300, "tasks": 1500, "overrides": 1500,
            "hf_config": 1500}
SMOKE = {"trace": 10, "request": 10, "http": 5, "tasks": 10, "overrides": 10, "hf_config": 10}


def run_edge(strategy, check, n: int, rng_seed: int) -> dict:
  """Runs `check(*case)` on `n` drawn cases; counts outcomes, keeps the first defects."""
  stats: collections.Counter = collections.Counter()
  defects: list[str] = []

  @seed(rng_seed)
  @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate],
            suppress_health_check=list(HealthCheck))
  @given(strategy)
  def run(case):
    stats["cases"] += 1
    try:
      stats[check(*case)] += 1
    except Exception as e:  # noqa: BLE001  (every failure of the contract is a defect)
      stats["defects"] += 1
      if len(defects) < 5:
        defects.append(f"{type(e).__name__}: {str(e)[:1500]} | case: {repr(case)[:1500]}")

  run()
  return {"cases": stats["cases"], "ok": stats["ok"], "rejected": stats["rejected"],
          "defects": stats["defects"], "first_defects": defects}


def _edges(tmp: pathlib.Path, counts: dict, rng_seed: int):
  """(edge, result) as each edge finishes (the HTTP one starts a proxy of its own)."""
  if counts["trace"]:
    yield "trace", run_edge(fz.trace_file().map(lambda x: (x,)),
                            lambda lines: fz.check_trace_import(tmp, lines),
                            counts["trace"], rng_seed)
  if counts["request"]:
    yield "request", run_edge(fz.request_body(), fz.check_request, counts["request"], rng_seed)
  if counts["http"]:
    import httpx
    from tests.support import byoh as bt
    from tests.support import envs as et
    tok = et.tokenizer("hermes")
    engine = et.ScriptedEngine(tok, lambda _, k: "ok", et.stop_ids(tok, "hermes")[0])
    with bt.running(engine, tmp / "http.db") as (url, proxy), \
        httpx.Client(base_url=url, timeout=30) as client:
      yield "http", run_edge(fz.request_body(),
                             lambda *c: fz.check_request_http(client, proxy, *c),
                             counts["http"], rng_seed)
  if counts["tasks"]:
    yield "tasks", run_edge(fz.task_file(), lambda *c: fz.check_task_file(tmp, *c),
                            counts["tasks"], rng_seed)
  if counts["overrides"]:
    yield "overrides", run_edge(fz.overrides(fz.config_leaves()), fz.check_overrides,
                                counts["overrides"], rng_seed)
  if counts["hf_config"]:
    yield "hf_config", run_edge(fz.hf_config(), lambda *c: fz.check_hf_config(tmp, *c),
                                counts["hf_config"], rng_seed)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default=None, help="write the per-edge counts here (JSON)")
  p.add_argument("--seed", type=int, default=0, help="hypothesis seed (runs are reproducible)")
  for edge in EDGES:
    p.add_argument(f"--{edge}", type=int, default=DEFAULTS[edge], help=f"cases for {edge}")
  p.add_argument("--smoke", action="store_true",
                 help=f"a handful of cases per edge, {SMOKE} (seconds, for CI)")
  args = p.parse_args(argv)
  info = run_info(smoke=args.smoke)
  counts = SMOKE if args.smoke else {e: getattr(args, e) for e in EDGES}
  results = {}
  print(f"{'edge':<10} {'cases':>7} {'ok':>7} {'rejected':>9} {'defects':>8} {'seconds':>8}")
  with tempfile.TemporaryDirectory() as tmp:
    t0 = time.perf_counter()
    for edge, r in _edges(pathlib.Path(tmp), counts, args.seed):
      r["seconds"] = round(time.perf_counter() - t0, 1)
      t0 = time.perf_counter()
      results[edge] = r
      print(f"{edge:<10} {r['cases']:>7} {r['ok']:>7} {r['rejected']:>9} {r['defects']:>8} "
            f"{r['seconds']:>8}", flush=True)
      for d in r["first_defects"]:
        print(f"  defect: {d}")
  cases = sum(r["cases"] for r in results.values())
  defects = sum(r["defects"] for r in results.values())
  if args.out:
    write_result(args.out, info, {"cases": cases, "defects": defects, "seed": args.seed,
                                  "edges": results})
  print(f"RESULT cases={cases} defects={defects}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
