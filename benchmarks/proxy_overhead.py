"""What the recording proxy costs: latency added per call and calls/s under concurrent clients.

Side by side in one run, on the same tiny model and the same embedded sampler:
  direct   `engine.generate` in this process on the chat's prompt ids (what the harness would
           pay with the engine linked in, no HTTP, no recording)
  proxy    the same chat through `launch/serve.py` (its own process, recording on, SQLite
           `--synchronous`) with an HTTP client, the same seed, so both decode the same tokens
Calls alternate direct / proxy so machine noise hits both; the added latency is each pair's
difference, reported at p50 / p99, beside the cost of a bare HTTP round trip to the same server
(GET /health), the part any server in front of an engine costs. Then `--concurrency` client threads call the proxy at once
(each its own session) for sustained calls/s. Ends with
`RESULT p50_overhead_ms=… p99_overhead_ms=… calls_per_s=…`.

    python benchmarks/proxy_overhead.py --out FILE.json [--calls 300] [--concurrency 32] [--smoke]

`--smoke`: 5 paired calls, 2 clients x 2 calls (seconds, for CI).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import pathlib
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

from benchmarks._meta import run_info, write_result  # noqa: E402

SMALL = dict(num_layers=1, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1,
             head_dim=16)   # tests/support/envs.py's tiny model: the engine is not what we time


def _free_port() -> int:
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", required=True, help="the JSON summary")
  p.add_argument("--calls", type=int, default=300, help="paired calls (direct, proxy)")
  p.add_argument("--concurrency", type=int, default=32, help="client threads for calls/s")
  p.add_argument("--calls_per_client", type=int, default=10)
  p.add_argument("--max_tokens", type=int, default=8)
  p.add_argument("--synchronous", default="NORMAL", help="the store's SQLite synchronous mode")
  p.add_argument("--smoke", action="store_true",
                 help="5 paired calls, 2 clients x 2 calls (seconds, for CI)")
  args = p.parse_args()
  info = run_info(smoke=args.smoke)
  if args.smoke:
    args.calls, args.concurrency, args.calls_per_client = 5, 2, 2

  from posttrain_jax.engines.base import SamplingParams
  from posttrain_jax.engines.jax_sampler import JaxSampler, JaxSamplerConfig
  from posttrain_jax.models import hf_io
  from posttrain_jax.models.tiny import TinyModelConfig, build_tiny_model

  tiny = TinyModelConfig(chat_format="hermes", **SMALL)
  model_dir = build_tiny_model(tiny)
  tok = hf_io.load_tokenizer(model_dir)
  engine = JaxSampler(hf_io.load_hf_model(model_dir),
                      JaxSamplerConfig(max_prompt_len=256, pad_id=tok.pad_token_id or 0))
  messages = [{"role": "user", "content": "Compute 12+30."}]
  ids = list(tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                 add_special_tokens=False)["input_ids"])
  sp = SamplingParams(max_tokens=args.max_tokens, temperature=1.0,
                      stop_token_ids=(tok.eos_token_id,))

  db = pathlib.Path(tempfile.mkdtemp()) / "traces.db"
  port = _free_port()
  proc = subprocess.Popen(
      [sys.executable, str(ROOT / "launch" / "serve.py"), f"--config.port={port}",
       f"--config.store.path={db}", f"--config.store.synchronous={args.synchronous}",
       "--config.max_prompt_tokens=256", "--config.proxy.workers=8",
       *[f"--config.tiny.{k}={v}" for k, v in SMALL.items()]],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    line = proc.stdout.readline()
    if not line.startswith("serving"):
      raise SystemExit(f"the proxy did not start: {line}{proc.stdout.read()}")
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    body = {"model": "posttrain_jax", "messages": messages, "max_tokens": args.max_tokens,
            "temperature": 1.0}
    client = httpx.Client(timeout=60)
    for i in range(5):  # compile both sides' shapes
      engine.generate([ids], sp, seed=i)
      client.post(url, json={**body, "seed": i}, headers={"X-Session-Id": f"warm{i}"})
    direct, proxied, tokens = [], [], []
    for i in range(args.calls):
      t0 = time.perf_counter()
      out = engine.generate([ids], sp, seed=1000 + i)
      direct.append(time.perf_counter() - t0)
      t0 = time.perf_counter()
      r = client.post(url, json={**body, "seed": 1000 + i}, headers={"X-Session-Id": f"p{i}"})
      proxied.append(time.perf_counter() - t0)
      r.raise_for_status()
      tokens.append((len(out[0][0].token_ids), r.json()["usage"]["completion_tokens"]))
    same_tokens = float(np.mean([a == b for a, b in tokens]))
    floor = []  # an HTTP round trip to the same server doing no work: the client's + server's
    for i in range(args.calls):  # share of the added latency, which any server would cost
      t0 = time.perf_counter()
      client.get(url.replace("/v1/chat/completions", "/health")).raise_for_status()
      floor.append(time.perf_counter() - t0)
    d, q = np.array(direct) * 1e3, np.array(proxied) * 1e3
    over, floor_ms = q - d, np.array(floor) * 1e3

    def burst(k):
      with httpx.Client(timeout=120) as c:
        for j in range(args.calls_per_client):
          c.post(url, json={**body, "seed": k * 1000 + j},
                 headers={"X-Session-Id": f"c{k}"}).raise_for_status()
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
      list(pool.map(burst, range(args.concurrency)))
    wall = time.perf_counter() - t0
    calls_per_s = args.concurrency * args.calls_per_client / wall
    detail = httpx.get(f"http://127.0.0.1:{port}/v1/sessions/c0").json()
    recorded = sum(c["status"] == "complete" for c in detail["calls"])
  finally:
    proc.terminate()
    proc.wait(timeout=30)

  rows = [("direct engine.generate", np.percentile(d, 50), np.percentile(d, 99)),
          ("through the proxy (HTTP + recording)", np.percentile(q, 50), np.percentile(q, 99)),
          ("added per call (pairwise)", np.percentile(over, 50), np.percentile(over, 99)),
          ("  of it an HTTP round trip (GET /health)", np.percentile(floor_ms, 50),
           np.percentile(floor_ms, 99))]
  print(f"{'':40s} {'p50 ms':>8s} {'p99 ms':>8s}")
  for name, a, b in rows:
    print(f"{name:40s} {a:8.2f} {b:8.2f}")
  print(f"same token count both sides: {same_tokens:.2f} of {args.calls} pairs")
  print(f"{args.concurrency} concurrent clients: {calls_per_s:.1f} calls/s "
        f"({args.concurrency * args.calls_per_client} calls in {wall:.1f} s; session c0 "
        f"recorded {recorded}/{args.calls_per_client} complete)")
  summary = {"args": vars(args), "direct_ms": {"p50": rows[0][1], "p99": rows[0][2]},
             "proxy_ms": {"p50": rows[1][1], "p99": rows[1][2]},
             "overhead_ms": {"p50": rows[2][1], "p99": rows[2][2]},
             "http_round_trip_ms": {"p50": rows[3][1], "p99": rows[3][2]},
             "calls_per_s": calls_per_s, "same_tokens": same_tokens}
  write_result(args.out, info, summary)
  print(f"RESULT p50_overhead_ms={rows[2][1]:.2f} p99_overhead_ms={rows[2][2]:.2f} "
        f"calls_per_s={calls_per_s:.1f}")


if __name__ == "__main__":
  main()
