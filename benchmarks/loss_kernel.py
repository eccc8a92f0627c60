"""LM-head loss, forward + backward: materialised logits vs the chunked / fused kernels.

For each size (N tokens, hidden D, vocabulary V) and each path, the step computes the value and
the gradients (dh, dW) of a separable loss, loss = sum_n -weight_n * log p(y_n):

  materialised  z = h @ W ([N, V] fp32), jax.nn.log_softmax, take, jax.grad (plain XLA)
  chunked       token_logprobs(impl="chunked"): custom VJP, backward recomputes tiles (8·N·D·V)
  fused         fused_logprob_loss(impl="chunked"): dh / dW accumulated in the forward (6·N·D·V)
  pallas_gpu / pallas_tpu   the Pallas kernels (only when that backend is present)

Memory is the compiled executable's temp_size_in_bytes (compile only, nothing runs), with the
total beside it: args + outputs + temp - aliased (the JSON also keeps the backend's own
peak_memory_in_bytes, which XLA:CPU does not fill with the true peak). Time is wall-clock of
the compiled step; the paths of one size run interleaved (A B C A B C ...) for --repeats rounds
after --warmup rounds, and the minimum is reported. All ratios come from this one run.

The distillation divergence, full vocabulary: per-token JSD_beta(T || S) (beta 0.5, the
teacher's own h_T, W_T), its value and the gradient w.r.t. the student's h and W, compiled at
the headline size (compile only): the materialised form (kernels/reference.py: both [N, V]
log-softmaxes and their gradient) vs the chunked kernel (kernels/teacher.py: two passes over
vocabulary tiles, never [N, V]). Ends with one line:

  RESULT memory_ratio=<materialised / fused temp bytes at N=8192, D=2048>
         time_ratio=<fused / materialised time at N=8192, D=2048>
         jsd_memory_ratio=<materialised / chunked JSD temp bytes at N=8192, D=2048>

Usage: python benchmarks/loss_kernel.py [--sizes full|small|N:D[,N:D...]] [--vocab V]
       [--no-time] [--repeats R] [--warmup W] [--dtype float32|bfloat16] [--out FILE.json]
       [--smoke]
The full size needs ~18 GB of RAM for the materialised step (5 GB of logits, a same-sized
gradient and W / dW at D = 2048). `--smoke`: every path at one tiny size (N=128, D=64,
V=10,000: two vocabulary tiles of the chunked kernels, the second partial), 1 repeat, no
warm-up: seconds, for CI; its ratios are not headline figures.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import platform
import resource
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from posttrain_jax.kernels import fused_logprob_loss, lm_head, token_logprobs
from posttrain_jax.kernels import teacher as teacher_kernels

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))
from benchmarks._meta import run_info, write_result  # noqa: E402

FULL = [(2048, 1024), (2048, 2048), (8192, 1024), (8192, 2048)]
SMALL = [(256, 128), (512, 256)]
HEADLINE = (8192, 2048)


def nll(logp, weight):
  return -weight * logp


def materialised(h, w, y, weight):
  z = jnp.dot(h, w, preferred_element_type=jnp.float32)
  logp = jnp.take_along_axis(jax.nn.log_softmax(z, axis=-1), y[:, None], axis=1)[:, 0]
  return jnp.sum(nll(logp, weight))


def chunked(h, w, y, weight):
  return jnp.sum(nll(token_logprobs(h, w, y, impl="chunked")[0], weight))


def fused(h, w, y, weight):
  return fused_logprob_loss(h, w, y, nll, weight, impl="chunked")[0]


def pallas(impl):
  def f(h, w, y, weight):
    return jnp.sum(nll(token_logprobs(h, w, y, impl=impl, interpret=False)[0], weight))
  return f


def paths():
  out = [("materialised", materialised), ("chunked", chunked), ("fused", fused)]
  backend = jax.default_backend()
  if backend in ("gpu", "tpu"):
    out.append((f"pallas_{backend}", pallas(f"pallas_{backend}")))
  return out


def jsd_memory(n, d, v, dtype):
  """Compiled temp / total bytes of value + (dh, dW) of sum_n JSD_0.5, materialised vs chunked."""
  shapes = [jax.ShapeDtypeStruct(s, dtype) for s in ((n, d), (d, v), (n, d), (d, v))]
  out = []
  for impl in ("reference", "chunked"):
    f = lambda h, w, ht, wt, impl=impl: jnp.sum(teacher_kernels.teacher_divergence(
        h, w, ht, wt, kind="jsd", beta=0.5, impl=impl))
    t0 = time.perf_counter()
    compiled = jax.jit(jax.value_and_grad(f, argnums=(0, 1))).lower(*shapes).compile()
    temp, total, _ = memory(compiled)
    out.append(dict(n=n, d=d, v=v, path=f"jsd_{'materialised' if impl == 'reference' else impl}",
                    temp_bytes=temp, total_bytes=total,
                    compile_s=round(time.perf_counter() - t0, 2)))
  return out


def parse_sizes(spec):
  if spec == "full":
    return FULL
  if spec == "small":
    return SMALL
  return [tuple(int(x) for x in part.split(":")) for part in spec.split(",")]


def memory(compiled):
  """(temp bytes, total = args + outputs + temp - aliased, the backend's own peak field)."""
  ma = compiled.memory_analysis()
  temp = int(ma.temp_size_in_bytes)
  total = (int(ma.argument_size_in_bytes) + int(ma.output_size_in_bytes) + temp
           - int(ma.alias_size_in_bytes))
  return temp, total, int(getattr(ma, "peak_memory_in_bytes", 0) or 0)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--sizes", default="full", help="full | small | N:D[,N:D...]")
  ap.add_argument("--vocab", type=int, default=151_936)
  ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  ap.add_argument("--no-time", action="store_true", help="memory analysis only (compile, no run)")
  ap.add_argument("--repeats", type=int, default=2)
  ap.add_argument("--warmup", type=int, default=0)
  ap.add_argument("--out", default=None, help="write rows + metadata as JSON")
  ap.add_argument("--smoke", action="store_true",
                  help="every path at N=128, D=64, V=10,000, 1 repeat: seconds, for CI")
  args = ap.parse_args(argv)
  info = run_info(smoke=args.smoke)
  if args.smoke:
    args.sizes, args.vocab, args.repeats, args.warmup = "128:64", 10_000, 1, 0

  sizes = parse_sizes(args.sizes)
  dtype = jnp.dtype(args.dtype)
  v = args.vocab
  meta = dict(jax=jax.__version__, backend=jax.default_backend(), device=str(jax.devices()[0]),
              cpus=os.cpu_count(), machine=platform.machine(), vocab=v, dtype=args.dtype,
              repeats=args.repeats, warmup=args.warmup,
              chunked_block_sizes=str(lm_head.default_block_sizes("chunked")),
              loadavg_start=os.getloadavg())
  rows = []
  header = (f"{'N':>6} {'D':>5} {'path':>16} {'temp GB':>8} {'total GB':>9} {'time s':>8} "
            f"{'temp x':>8} {'time x':>7} {'TFLOP/s':>8}")
  print(f"# V={v} dtype={args.dtype} backend={meta['backend']} load={meta['loadavg_start']}")
  print(header)
  print("-" * len(header))
  for n, d in sizes:
    shapes = (jax.ShapeDtypeStruct((n, d), dtype), jax.ShapeDtypeStruct((d, v), dtype),
              jax.ShapeDtypeStruct((n,), jnp.int32), jax.ShapeDtypeStruct((n,), jnp.float32))
    if not args.no_time:  # numpy draws: no device-side RNG temporaries next to a 1.2 GB W
      rng = np.random.default_rng(n * 7919 + d)
      h = jnp.asarray(rng.standard_normal((n, d), np.float32), dtype)
      w = jnp.asarray(rng.standard_normal((d, v), np.float32) * np.float32(2 / np.sqrt(d)), dtype)
      y = jnp.asarray(rng.integers(0, v, n), jnp.int32)
      weight = jnp.full((n,), 1.0 / n, jnp.float32)
    size_rows, compiled = [], {}
    for name, f in paths():
      t0 = time.perf_counter()
      compiled[name] = jax.jit(jax.value_and_grad(f, argnums=(0, 1))).lower(*shapes).compile()
      temp, total, reported_peak = memory(compiled[name])
      size_rows.append(dict(n=n, d=d, v=v, path=name, temp_bytes=temp, total_bytes=total,
                            backend_peak_bytes=reported_peak,
                            compile_s=round(time.perf_counter() - t0, 2)))
    if not args.no_time:
      # Interleaved (A B C A B C ...) so that load from other processes hits every path alike;
      # the minimum over repeats is reported.
      for _ in range(args.warmup):
        for name in compiled:
          jax.block_until_ready(compiled[name](h, w, y, weight))
      times = {name: [] for name in compiled}
      for _ in range(max(1, args.repeats)):
        for name in compiled:
          t0 = time.perf_counter()
          out = jax.block_until_ready(compiled[name](h, w, y, weight))
          times[name].append(time.perf_counter() - t0)
          del out
      for row in size_rows:
        row["times_s"] = [round(t, 3) for t in times[row["path"]]]
        row["time_s"] = min(times[row["path"]])
        flops = (6 if row["path"] in ("materialised", "fused") else 8) * n * d * v
        row["tflops"] = flops / row["time_s"] / 1e12
    base = size_rows[0]
    for row in size_rows:
      row["temp_ratio_vs_materialised"] = base["temp_bytes"] / max(row["temp_bytes"], 1)
      if "time_s" in row:
        row["time_ratio_vs_materialised"] = row["time_s"] / base["time_s"]
      rows.append(row)
      print(f"{n:>6} {d:>5} {row['path']:>16} {row['temp_bytes'] / 1e9:>8.3f} "
            f"{row['total_bytes'] / 1e9:>9.3f} {row.get('time_s', float('nan')):>8.2f} "
            f"{row['temp_ratio_vs_materialised']:>8.1f} "
            f"{row.get('time_ratio_vs_materialised', float('nan')):>7.2f} "
            f"{row.get('tflops', float('nan')):>8.3f}", flush=True)
    del compiled
    if not args.no_time:
      del h, w, y, weight

  meta["loadavg_end"] = os.getloadavg()
  meta["max_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
  pick = lambda path: next((r for r in rows if (r["n"], r["d"], r["path"]) == (*HEADLINE, path)), None)
  mat, fus = pick("materialised"), pick("fused")
  if mat is None or fus is None:
    head_n, head_d = sizes[-1]
    mat = next(r for r in rows if (r["n"], r["d"], r["path"]) == (head_n, head_d, "materialised"))
    fus = next(r for r in rows if (r["n"], r["d"], r["path"]) == (head_n, head_d, "fused"))
    print(f"# headline size {HEADLINE} not run; RESULT below is for N={head_n}, D={head_d}")
  mem_ratio = mat["temp_bytes"] / fus["temp_bytes"]
  time_ratio = fus["time_s"] / mat["time_s"] if "time_s" in fus else float("nan")
  jsd = jsd_memory(mat["n"], mat["d"], v, dtype)
  jsd_ratio = jsd[0]["temp_bytes"] / max(jsd[1]["temp_bytes"], 1)
  for row in jsd:
    row["temp_ratio_vs_materialised"] = jsd[0]["temp_bytes"] / max(row["temp_bytes"], 1)
    rows.append(row)
    print(f"{row['n']:>6} {row['d']:>5} {row['path']:>16} {row['temp_bytes'] / 1e9:>8.3f} "
          f"{row['total_bytes'] / 1e9:>9.3f} {'':>8} {row['temp_ratio_vs_materialised']:>8.1f}")
  if args.out:
    write_result(args.out, info, dict(meta=meta, rows=rows, result=dict(
        n=mat["n"], d=mat["d"], memory_ratio=mem_ratio, time_ratio=time_ratio,
        jsd_memory_ratio=jsd_ratio)))
  print(f"# max RSS {meta['max_rss_gb']:.1f} GB, load {meta['loadavg_start']} -> {meta['loadavg_end']}")
  print(f"RESULT memory_ratio={mem_ratio:.1f} time_ratio={time_ratio:.2f} "
        f"jsd_memory_ratio={jsd_ratio:.1f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
