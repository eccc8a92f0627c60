"""GPU check of the Pallas (Triton) LM-head kernel: correctness against the reference, then time.

1. Correctness: token_logprobs(impl="pallas_gpu") vs the materialised reference, values (logp,
   lse, entropy) and gradients (dh, dW) under a random cotangent, fp32 and bf16, W as [D, V]
   and as [V, D]; relative error = max|got - want| / max|want| (fp32 <= 1e-5 with exact fp32
   matmuls, bf16 <= 1e-2). Exits 1 on the first failure.
2. Timing (bf16 inputs, V = 151,936): forward + backward of sum(-logp) for XLA materialised,
   pallas_gpu, XLA chunked and the fused-loss path, one table row per size, printed as it goes.
   Sizes run smallest first and stop once --budget-s is spent, so a timeout loses nothing.

  python benchmarks/loss_kernel_gpu_check.py [--out FILE.json]   # on a GPU
  python benchmarks/loss_kernel_gpu_check.py --interpret     # CPU: correctness in interpret mode
  python benchmarks/loss_kernel_gpu_check.py --smoke         # seconds, for CI (GPU or CPU)

`--smoke`: the first correctness case only (fp32 and bf16, both W layouts); on a GPU then the
smallest timing size with 1 rep; without a GPU it implies --interpret (the kernels interpreted
on the CPU, tiny sizes, correctness only: there is nothing to time). Ends with one line

  RESULT correctness=<1|0> max_err_fp32=<x> max_err_bf16=<x>
         pallas_over_materialised=<r> fused_over_materialised=<r>

(the worst relative errors over the cases; the time ratios at the largest size timed, nan when
nothing was timed; everything nan when nothing ran, e.g. no GPU without --interpret).
"""
from __future__ import annotations

import argparse
import math
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from posttrain_jax.kernels import fused_logprob_loss, lm_head_pallas_gpu, token_logprobs

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))
from benchmarks._meta import run_info, write_result  # noqa: E402

SIZES = [(1024, 1024), (4096, 2048), (8192, 4096), (16384, 4096)]


def rel_err(got, want):
  got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
  want = np.asarray(jnp.asarray(want, jnp.float32), np.float64)
  if not np.all(np.isfinite(got)):
    return float("inf")
  return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def check(n, d, v, dtype, transposed, bs, interpret, seed):
  rng = np.random.default_rng(seed)
  h = jnp.asarray(rng.standard_normal((n, d), np.float32), dtype)
  wshape = (v, d) if transposed else (d, v)
  w = jnp.asarray(rng.standard_normal(wshape, np.float32) * np.float32(2 / np.sqrt(d)), dtype)
  y = jnp.asarray(rng.integers(0, v, n), jnp.int32)
  mask = jnp.asarray(rng.random(n) > 0.2)
  cts = jnp.asarray(rng.standard_normal((3, n), np.float32))

  def run(impl, block_sizes):
    def f(h, w):
      lp, lse, ent = token_logprobs(h, w, y, temperature=0.8, mask=mask, return_entropy=True,
                                    transposed=transposed, impl=impl, block_sizes=block_sizes,
                                    interpret=interpret)
      return jnp.sum(cts[0] * lp + cts[1] * lse + cts[2] * ent), (lp, lse, ent)
    with jax.default_matmul_precision("highest"):
      (_, outs), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(h, w)
    return outs + grads

  want = run("reference", None)
  got = run("pallas_gpu", bs)
  names = ("logp", "lse", "entropy", "dh", "dW")
  return {k: rel_err(g, r) for k, g, r in zip(names, got, want)}


def time_step(f, args, reps):
  c = jax.jit(jax.value_and_grad(f, argnums=(0, 1))).lower(*args).compile()
  jax.block_until_ready(c(*args))  # warm-up
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(c(*args))
    ts.append(time.perf_counter() - t0)
  return min(ts), c.memory_analysis().temp_size_in_bytes


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--interpret", action="store_true",
                  help="run the Pallas kernel in interpret mode (CPU); tiny sizes, no timing")
  ap.add_argument("--budget-s", type=float, default=420.0, help="stop timing new sizes after this")
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--vocab", type=int, default=151_936)
  ap.add_argument("--seed", type=int, default=int.from_bytes(os.urandom(4), "little"))
  ap.add_argument("--out", default=None, help="write the errors and times as JSON here")
  ap.add_argument("--smoke", action="store_true",
                  help="the first correctness case, then (GPU) the smallest size with 1 rep; "
                       "no GPU: implies --interpret (seconds, for CI)")
  args = ap.parse_args(argv)
  info = run_info(smoke=args.smoke)
  t_start = time.perf_counter()
  print(f"# jax {jax.__version__} backend={jax.default_backend()} device={jax.devices()[0]} "
        f"seed={args.seed}", flush=True)
  nan = float("nan")
  errors, timing = [], []
  result = dict(correctness=nan, max_err_fp32=nan, max_err_bf16=nan,
                pallas_over_materialised=nan, fused_over_materialised=nan)

  def finish(rc):
    for dt in ("float32", "bfloat16"):
      errs = [e for row in errors if row["dtype"] == dt for e in row["errors"].values()]
      if errs:
        result[f"max_err_{'fp32' if dt == 'float32' else 'bf16'}"] = max(errs)
    if timing:
      result["pallas_over_materialised"] = timing[-1]["pallas_over_materialised"]
      result["fused_over_materialised"] = timing[-1]["fused_over_materialised"]
    if args.out:
      write_result(args.out, info, dict(seed=args.seed, interpret=args.interpret, vocab=args.vocab,
                                        correctness=errors, timing=timing, result=result))
    fmt = lambda k, v: (str(v) if not isinstance(v, float) or math.isnan(v)
                        else f"{v:.2e}" if k.startswith("max_err") else f"{v:.3f}")
    print("RESULT " + " ".join(f"{k}={fmt(k, v)}" for k, v in result.items()))
    return rc

  if args.smoke and not args.interpret and jax.default_backend() != "gpu":
    print(f"# --smoke without a GPU (backend {jax.default_backend()}): the correctness part only, "
          "the Pallas kernels interpreted on the CPU; nothing to time", flush=True)
    args.interpret = True
  if not args.interpret and jax.default_backend() != "gpu":
    print("no GPU: run with --interpret for the correctness part on CPU")
    return finish(2)

  if args.interpret:
    cases = [(13, 24, 101), (1, 8, 37)]
    bs = lm_head_pallas_gpu.BlockSizes(block_n=8, block_v=16, block_d=8, vocab_splits=3)
  else:
    cases = [(300, 192, 4099), (64, 256, 32000)]
    bs = lm_head_pallas_gpu.BlockSizes.get_default("gpu")
  if args.smoke:
    cases, args.reps = cases[:1], 1
  ok = True
  print(f"{'N':>6} {'D':>5} {'V':>7} {'dtype':>8} {'W':>6}  " + "  ".join(
      f"{k:>8}" for k in ("logp", "lse", "entropy", "dh", "dW")))
  for (n, d, v) in cases:
    for dtype in (jnp.float32, jnp.bfloat16):
      for transposed in (False, True):
        errs = check(n, d, v, dtype, transposed, bs, args.interpret, args.seed)
        tol = 1e-5 if dtype == jnp.float32 else 1e-2
        bad = [k for k, e in errs.items() if not e <= tol]
        ok &= not bad
        errors.append(dict(n=n, d=d, v=v, dtype=jnp.dtype(dtype).name,
                           w="[V,D]" if transposed else "[D,V]", errors=errs, ok=not bad))
        print(f"{n:>6} {d:>5} {v:>7} {jnp.dtype(dtype).name:>8} {'[V,D]' if transposed else '[D,V]':>6}  "
              + "  ".join(f"{e:8.1e}" for e in errs.values()) + ("  FAIL " + ",".join(bad) if bad else "  ok"),
              flush=True)
  print(f"# correctness {'PASSED' if ok else 'FAILED'} ({time.perf_counter() - t_start:.0f} s)", flush=True)
  result["correctness"] = int(ok)
  if not ok:
    return finish(1)
  if args.interpret:
    return finish(0)

  nll = lambda lp, wt: -wt * lp
  paths = {
      "materialised": lambda h, w, y, wt: jnp.sum(nll(jnp.take_along_axis(jax.nn.log_softmax(
          jnp.dot(h, w, preferred_element_type=jnp.float32), -1), y[:, None], 1)[:, 0], wt)),
      "pallas_gpu": lambda h, w, y, wt: jnp.sum(nll(token_logprobs(h, w, y, impl="pallas_gpu")[0], wt)),
      "chunked": lambda h, w, y, wt: jnp.sum(nll(token_logprobs(h, w, y, impl="chunked")[0], wt)),
      "fused": lambda h, w, y, wt: fused_logprob_loss(h, w, y, nll, wt, impl="chunked")[0],
  }
  v = args.vocab
  print(f"\n{'N':>6} {'D':>5} " + " ".join(f"{k + ' ms':>15}" for k in paths)
        + "   pallas/mat  fused/mat  (temp GB: " + " ".join(paths) + ")", flush=True)
  for n, d in SIZES[:1] if args.smoke else SIZES:
    if time.perf_counter() - t_start > args.budget_s:
      print(f"# budget spent, skipping N={n} D={d} and larger")
      break
    rng = np.random.default_rng(n + d)
    h = jnp.asarray(rng.standard_normal((n, d), np.float32), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((d, v), np.float32) * np.float32(2 / np.sqrt(d)), jnp.bfloat16)
    y = jnp.asarray(rng.integers(0, v, n), jnp.int32)
    wt = jnp.full((n,), 1.0 / n, jnp.float32)
    res = {}
    for name, f in paths.items():
      try:
        res[name] = time_step(f, (h, w, y, wt), args.reps)
      except Exception as e:  # report and keep going: one failing path must not hide the rest
        print(f"# {name} at N={n} D={d} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        res[name] = (float("nan"), 0)
    mat = res["materialised"][0]
    timing.append(dict(n=n, d=d, v=v, **{f"{k}_s": res[k][0] for k in paths},
                       **{f"{k}_temp_bytes": res[k][1] for k in paths},
                       pallas_over_materialised=res["pallas_gpu"][0] / mat,
                       fused_over_materialised=res["fused"][0] / mat))
    print(f"{n:>6} {d:>5} " + " ".join(f"{res[k][0] * 1e3:>15.2f}" for k in paths)
          + f"   {res['pallas_gpu'][0] / mat:>10.2f} {res['fused'][0] / mat:>10.2f}  ("
          + " ".join(f"{res[k][1] / 1e9:.2f}" for k in paths) + ")", flush=True)
  print(f"# done in {time.perf_counter() - t_start:.0f} s")
  return finish(0)


if __name__ == "__main__":
  sys.exit(main())
