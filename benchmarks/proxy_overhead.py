"""What the recording proxy costs: latency added per call and calls/s under concurrent clients.

Side by side in one run, on the same tiny model and the same embedded sampler:
  direct   `engine.generate` in this process on the chat's prompt ids (what the harness would
           pay with the engine linked in, no HTTP, no recording)
  proxy    the same chat through `launch/serve.py` (its own process, recording on, SQLite
           `--synchronous`) with an HTTP client, the same seed, so both decode the same tokens,
           in each dialect: Chat Completions, the Responses API (`input` the same user text),
           Anthropic's Messages API (the same messages); each renders the same prompt ids
Calls alternate direct / chat / responses / messages so machine noise hits all; the added
latency is each proxied call's difference from the direct call beside it, reported at p50 /
p99 per dialect, beside the cost of a bare HTTP round trip to the same server (GET /health),
the part any server in front of an engine costs. Then `--concurrency` client threads call the
proxy at once (each its own session) for sustained calls/s. Ends with
`RESULT p50_overhead_ms=… p99_overhead_ms=… p50_overhead_responses_ms=…
p99_overhead_responses_ms=… p50_overhead_messages_ms=… p99_overhead_messages_ms=…
calls_per_s=…` (the first two: Chat Completions).

`--vary`: a harness that varies its options (issue 31 item 3). `--clients` (16) client threads
through the proxy, after a warm-up that compiles each length bucket once (engines/sampling.py):
first every call with the same options (temperature 1, top_p 1, max_tokens 32), then every
call drawing its own temperature (0 for one in five), top_p, top_k and max_tokens (1..64), but
one client's one call asks for `--long_tokens` (4096; the tiny model is built with an 8192-token
context so that it fits; greedy, so EOS rarely ends it early). Latencies are of the short calls;
the long call is reported beside them (and the varied calls once more without it, first), with
the sampler's compiles after the warm-up (GET /health `engine_compiles`). Ends with
`RESULT p50_fixed_ms=… p50_varied_ms=… p99_varied_ms=… recompiles=…`. `--vary_only` varies one
part: which one costs (2026-12-07: max_tokens nothing, top-p's sort of the vocabulary all of
it; benchmarks/README.md).

    python benchmarks/proxy_overhead.py --out FILE.json [--calls 300] [--concurrency 32] [--smoke]
    python benchmarks/proxy_overhead.py --out FILE.json --vary [--clients 16] [--smoke]

`--smoke`: 5 paired calls, 2 clients x 2 calls (seconds, for CI); with `--vary`, 2 clients x 2
calls and a long call of 256 tokens.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
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


def _serve(port: int, synchronous: str, *flags: str) -> subprocess.Popen:
  """`launch/serve.py` on the tiny model in its own process, once it accepts calls."""
  db = pathlib.Path(tempfile.mkdtemp()) / "traces.db"
  proc = subprocess.Popen(
      [sys.executable, str(ROOT / "launch" / "serve.py"), f"--config.port={port}",
       f"--config.store.path={db}", f"--config.store.synchronous={synchronous}",
       "--config.max_prompt_tokens=256", "--config.proxy.workers=8",
       *[f"--config.tiny.{k}={v}" for k, v in SMALL.items()], *flags],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  line = proc.stdout.readline()
  if not line.startswith("serving"):
    proc.kill()
    raise SystemExit(f"the proxy did not start: {line}{proc.stdout.read()}")
  return proc


VARY_ONLY = ("all", "max_tokens", "sampling", "top_p", "top_k", "greedy")


def _options(rng: np.random.Generator, only: str = "all") -> dict:
  """One varied call's sampling options (module docstring); `only` (--vary_only) keeps the
  fixed calls' values for all but one part: max_tokens alone, the sampling values alone
  (temperature, top_p, top_k), or every call with top_p 0.9, top_k 20 or greedy."""
  out = {"temperature": 0.0 if rng.random() < 0.2 else round(float(rng.uniform(0.1, 1.5)), 3),
         "max_tokens": int(rng.integers(1, 65))}
  if rng.random() < 0.7:
    out["top_p"] = round(float(rng.uniform(0.5, 1.0)), 3)
  if rng.random() < 0.3:
    out["top_k"] = int(rng.integers(1, 50))
  fixed = {"temperature": 1.0, "max_tokens": 32}
  return {"all": out, "max_tokens": {**fixed, "max_tokens": out["max_tokens"]},
          "sampling": {**out, "max_tokens": 32}, "top_p": {**fixed, "top_p": 0.9},
          "top_k": {**fixed, "top_k": 20}, "greedy": {**fixed, "temperature": 0.0}}[only]


def vary(args, info) -> None:
  """--vary (module docstring)."""
  messages = [{"role": "user", "content": "Compute 12+30."}]
  body = {"model": "posttrain_jax", "messages": messages}
  port = _free_port()
  proc = _serve(port, args.synchronous, "--config.tiny.max_position_embeddings=8192",
                *args.serve_flag)
  base = f"http://127.0.0.1:{port}"
  url = base + "/v1/chat/completions"
  calls = iter(range(1 << 30))   # a session per call: every prompt is the same few tokens

  def post(client: httpx.Client, **options) -> tuple[float, int]:
    t0 = time.perf_counter()
    r = client.post(url, json={**body, **options}, headers={"X-Session-Id": f"s{next(calls)}"})
    r.raise_for_status()
    return time.perf_counter() - t0, r.json()["usage"]["completion_tokens"]

  def compiles() -> int:   # -1: the engine does not count them
    return int(httpx.get(base + "/health").json().get("engine_compiles", -1))

  def clients(work) -> list:
    with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
      return [x for out in pool.map(work, range(args.clients)) for x in out]
  try:
    with httpx.Client(timeout=600) as c:
      for max_tokens in (16, 32, 64, args.long_tokens // 2 + 1):   # each length bucket once
        post(c, max_tokens=max_tokens, temperature=1.0, seed=0)
    warm = compiles()

    def fixed(k):
      with httpx.Client(timeout=600) as c:
        return [post(c, max_tokens=32, temperature=1.0, seed=k * 1000 + j)[0]
                for j in range(args.calls_per_client)]
    fixed_ms = np.array(clients(fixed)) * 1e3
    long_out = {}

    def varied(k, long=True):
      rng = np.random.default_rng([k, int(long)])   # each phase draws values of its own
      with httpx.Client(timeout=600) as c:
        if k == 0 and long:    # the long call, greedy
          long_out["s"], long_out["tokens"] = post(c, max_tokens=args.long_tokens,
                                                   temperature=0.0)
          return []
        return [post(c, seed=k * 1000 + j, **_options(rng, args.vary_only))[0]
                for j in range(args.calls_per_client)]
    alone_ms = np.array(clients(lambda k: varied(k, long=False))) * 1e3   # no long call
    t0 = time.perf_counter()
    varied_ms = np.array(clients(varied)) * 1e3    # client 0: the long call
    wall = time.perf_counter() - t0
    recompiles = compiles() - warm if warm >= 0 else -1
  finally:
    proc.terminate()
    proc.wait(timeout=30)
  load = os.getloadavg()
  rows = [("fixed options", fixed_ms), ("varied options, no long call", alone_ms),
          ("varied options + the long call", varied_ms)]
  print(f"{'':32s} {'calls':>6s} {'p50 ms':>8s} {'p99 ms':>8s}")
  for name, x in rows:
    print(f"{name:32s} {len(x):6d} {np.percentile(x, 50):8.2f} {np.percentile(x, 99):8.2f}")
  print(f"the long call: max_tokens={args.long_tokens}, {long_out['tokens']} tokens in "
        f"{long_out['s']:.1f} s (the varied phase: {wall:.1f} s)")
  counted = (f"{warm} in the warm-up, {recompiles} after it" if warm >= 0 else
             "not counted by this engine (recompiles=-1)")
  print(f"sampler compiles: {counted}; load average {load[0]:.2f} on {os.cpu_count()} CPUs")
  summary = {"args": vars(args), "fixed_ms": {"p50": np.percentile(fixed_ms, 50),
                                               "p99": np.percentile(fixed_ms, 99)},
             "varied_ms": {"p50": np.percentile(varied_ms, 50),
                           "p99": np.percentile(varied_ms, 99)},
             "varied_no_long_ms": {"p50": np.percentile(alone_ms, 50),
                                   "p99": np.percentile(alone_ms, 99)},
             "long": {"max_tokens": args.long_tokens, "tokens": long_out["tokens"],
                      "s": long_out["s"]},
             "compiles_warmup": warm, "recompiles": recompiles, "load_avg": load[0]}
  write_result(args.out, info, summary)
  print(f"RESULT p50_fixed_ms={np.percentile(fixed_ms, 50):.2f} "
        f"p50_varied_ms={np.percentile(varied_ms, 50):.2f} "
        f"p99_varied_ms={np.percentile(varied_ms, 99):.2f} recompiles={recompiles}")


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
  p.add_argument("--vary", action="store_true",
                 help="clients that vary temperature / top_p / max_tokens, one long call")
  p.add_argument("--clients", type=int, default=16, help="--vary: client threads")
  p.add_argument("--vary_only", default="all", choices=VARY_ONLY,
                 help="--vary: vary one part of the options only (which one costs)")
  p.add_argument("--long_tokens", type=int, default=4096, help="--vary: the long call's max_tokens")
  p.add_argument("--serve_flag", action="append", default=[],
                 help="--vary: a further launch/serve.py flag (repeatable), e.g. "
                 "--serve_flag=--config.proxy.long_request_tokens=0")
  args = p.parse_args()
  info = run_info(smoke=args.smoke)
  if args.smoke:
    args.calls, args.concurrency, args.calls_per_client = 5, 2, 2
    args.clients, args.long_tokens = 2, 256
  if args.vary:
    return vary(args, info)

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

  port = _free_port()
  proc = _serve(port, args.synchronous)
  try:
    base = f"http://127.0.0.1:{port}"
    url = base + "/v1/chat/completions"
    body = {"model": "posttrain_jax", "messages": messages, "max_tokens": args.max_tokens,
            "temperature": 1.0}
    # dialect -> (path, body, the usage field of the answer's sampled tokens, headers)
    dialects = {
        "chat": ("/v1/chat/completions", body, "completion_tokens", {}),
        "responses": ("/v1/responses", {"model": "posttrain_jax", "input": messages[0]["content"],
                                        "max_output_tokens": args.max_tokens,
                                        "temperature": 1.0}, "output_tokens", {}),
        "messages": ("/v1/messages", body, "output_tokens", {"anthropic-version": "2023-06-01"}),
    }
    client = httpx.Client(timeout=60)

    def call(name: str, seed: int, session: str) -> int:
      path, b, usage, headers = dialects[name]
      r = client.post(base + path, json={**b, "seed": seed},
                      headers={**headers, "X-Session-Id": session})
      r.raise_for_status()
      return int(r.json()["usage"][usage])
    for i in range(5):  # compile both sides' shapes
      engine.generate([ids], sp, seed=i)
      for name in dialects:
        call(name, i, f"warm{name}{i}")
    direct = []
    proxied = {name: [] for name in dialects}
    same = {name: [] for name in dialects}
    for i in range(args.calls):
      t0 = time.perf_counter()
      out = engine.generate([ids], sp, seed=1000 + i)
      direct.append(time.perf_counter() - t0)
      for name in dialects:
        t0 = time.perf_counter()
        n = call(name, 1000 + i, f"p{name}{i}")
        proxied[name].append(time.perf_counter() - t0)
        same[name].append(n == len(out[0][0].token_ids))
    same_tokens = float(np.mean(same["chat"]))
    floor = []  # an HTTP round trip to the same server doing no work: the client's + server's
    for i in range(args.calls):  # share of the added latency, which any server would cost
      t0 = time.perf_counter()
      client.get(url.replace("/v1/chat/completions", "/health")).raise_for_status()
      floor.append(time.perf_counter() - t0)
    d, q = np.array(direct) * 1e3, np.array(proxied["chat"]) * 1e3
    over, floor_ms = q - d, np.array(floor) * 1e3
    over_by = {name: np.array(x) * 1e3 - d for name, x in proxied.items()}

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
  print(f"{'added per call, by dialect':40s}")
  for name, x in over_by.items():
    print(f"{'  ' + name:40s} {np.percentile(x, 50):8.2f} {np.percentile(x, 99):8.2f}   same "
          f"tokens as direct: {np.mean(same[name]):.2f}")
  print(f"same token count both sides (chat): {same_tokens:.2f} of {args.calls} pairs")
  print(f"{args.concurrency} concurrent clients: {calls_per_s:.1f} calls/s "
        f"({args.concurrency * args.calls_per_client} calls in {wall:.1f} s; session c0 "
        f"recorded {recorded}/{args.calls_per_client} complete)")
  summary = {"args": vars(args), "direct_ms": {"p50": rows[0][1], "p99": rows[0][2]},
             "proxy_ms": {"p50": rows[1][1], "p99": rows[1][2]},
             "overhead_ms": {"p50": rows[2][1], "p99": rows[2][2]},
             "http_round_trip_ms": {"p50": rows[3][1], "p99": rows[3][2]},
             "overhead_by_dialect_ms": {
                 name: {"p50": float(np.percentile(x, 50)), "p99": float(np.percentile(x, 99)),
                        "same_tokens": float(np.mean(same[name]))}
                 for name, x in over_by.items()},
             "calls_per_s": calls_per_s, "same_tokens": same_tokens, "load_avg": os.getloadavg()[0]}
  write_result(args.out, info, summary)
  dialect_keys = " ".join(
      f"p{q}_overhead_{name}_ms={np.percentile(over_by[name], q):.2f}"
      for name in ("responses", "messages") for q in (50, 99))
  print(f"RESULT p50_overhead_ms={rows[2][1]:.2f} p99_overhead_ms={rows[2][2]:.2f} "
        f"{dialect_keys} calls_per_s={calls_per_s:.1f}")


if __name__ == "__main__":
  main()
