"""Rollout throughput: generated tokens/s of the embedded JAX sampler vs in-process vLLM.

The embedded sampler (`rl.engine = "jax"`) is the default engine; this shows, on this machine,
at which batch size vLLM (`rl.engine = "vllm"`) starts to pay off. Both engines are built the
way a run builds them (the engine registry's build functions with an EngineContext) and serve
the same tiny model, built locally with build_tiny_model (no downloads; --hidden / --layers /
--vocab / --intermediate shape it; fp32).

For each batch size B (--batch_sizes, or just --prompts): B prompts of --prompt_len random
tokens, --n completions each, --max_tokens new tokens at temperature 1, no stop tokens (so
every completion runs to max_tokens; vLLM ignores EOS too). Each engine is warmed up once per
batch size (the JAX sampler compiles per shape; vLLM's first batches are slow), then timed
--repeats times, interleaved jax, vllm, jax, vllm, ... since these machines are noisy.

  seconds     wall clock of one `engine.generate(prompts, sampling, n, seed)` call
  tokens      completion tokens counted in what it returned (prompts not counted)
  tokens/s    tokens / seconds; the table shows the median over repeats, vllm/jax their ratio

Every call gets fresh prompts (the same ones for both engines): vLLM's prefix cache stays on,
as in a run, so it shares a prompt's prefill among its n samples but never reuses an earlier
call's. vLLM's start-up is reported but not timed in; if vLLM cannot be imported or started,
the JAX sampler is still measured and the vLLM columns say why they are empty. Ends with

  RESULT jax_tokens_per_s=<x> vllm_tokens_per_s=<y> vllm_over_jax=<r>

at the largest batch size (nan for vLLM when it was skipped); --out FILE.json gets every
repeat, the shapes, versions and the machine.

Usage: python benchmarks/rollout_throughput.py [--out FILE.json] [--batch_sizes 1,4,16,64]
       [--prompts B] [--prompt_len 32] [--n 4] [--max_tokens 64] [--repeats 3]
       [--hidden 128 --layers 4 --vocab 512] [--enforce_eager] [--work DIR] [--smoke]
Caches (vLLM, torch inductor, the built model) go under --work (default: a temp dir, removed
at the end). `--smoke`: the same calls at the smallest size (1 prompt of 8 tokens, n=2, 8 new
tokens, 1 repeat; d=64, 1 layer, vocab 512), JAX sampler only: seconds, for CI; its figures are
not headline figures. vLLM is skipped there (it says so): on a 2-core CPU its start-up alone
took 50 s and its first batch 28 s more (98 s in all). The same size with vLLM:
`--batch_sizes 1 --prompt_len 8 --n 2 --max_tokens 8 --repeats 1 --hidden 64 --layers 1
--enforce_eager`.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import pathlib
import platform
import shutil
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))
from benchmarks._meta import run_info, write_result  # noqa: E402

_DEFAULT_BATCH_SIZES = "1,4,16,64"
_MAX_TMPDIR = 107 - 37  # zmq's IPC path limit, less vLLM's "/<uuid4>" socket name


def _args():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default=None, help="write the results as JSON here")
  p.add_argument("--batch_sizes", default=None,
                 help=f"comma-separated prompt counts to measure (default {_DEFAULT_BATCH_SIZES}, "
                      "or just --prompts when that is given)")
  p.add_argument("--prompts", type=int, default=None,
                 help="one batch size (added to --batch_sizes)")
  p.add_argument("--prompt_len", type=int, default=32, help="tokens per prompt")
  p.add_argument("--n", type=int, default=4, help="completions per prompt")
  p.add_argument("--max_tokens", type=int, default=64, help="new tokens per completion")
  p.add_argument("--repeats", type=int, default=3, help="timed calls per engine and batch size")
  p.add_argument("--hidden", type=int, default=128)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--vocab", type=int, default=512)
  p.add_argument("--intermediate", type=int, default=None, help="default 3 * hidden")
  p.add_argument("--head_dim", type=int, default=32,
                 help="heads = hidden / head_dim, kv heads = heads / 2")
  p.add_argument("--enforce_eager", action="store_true",
                 help="vLLM without torch.compile (faster start-up, slower decoding)")
  p.add_argument("--gpu_memory_utilization", type=float, default=0.5,
                 help="vLLM's share of GPU memory (GPU only; JAX shares the device)")
  p.add_argument("--no_vllm", action="store_true", help="measure the JAX sampler only")
  p.add_argument("--work", default=None, help="directory for caches and the model (kept)")
  p.add_argument("--smoke", action="store_true",
                 help="1 prompt of 8 tokens, n=2, 8 new tokens, 1 repeat, d=64, 1 layer; the "
                      "JAX sampler only (vLLM's start-up takes minutes): seconds, for CI")
  a = p.parse_args()
  if a.smoke:
    a.batch_sizes, a.prompts, a.prompt_len, a.n, a.max_tokens, a.repeats = "1", None, 8, 2, 8, 1
    a.hidden, a.layers, a.vocab, a.intermediate = 64, 1, 512, None
  sizes = set()
  if a.batch_sizes is not None or a.prompts is None:
    sizes |= {int(s) for s in (a.batch_sizes or _DEFAULT_BATCH_SIZES).split(",") if s.strip()}
  if a.prompts is not None:
    sizes.add(a.prompts)
  if not sizes or min(sizes) < 1 or min(a.n, a.max_tokens, a.prompt_len, a.repeats) < 1:
    p.error("batch sizes, --n, --max_tokens, --prompt_len and --repeats must be >= 1")
  a.sizes = sorted(sizes)
  return a


def _environment(work: pathlib.Path) -> None:
  """vLLM's caches, sockets and temp files under `work` (what is already set is kept)."""
  tmp = work / "tmp"
  if "TMPDIR" not in os.environ and len(str(tmp.resolve())) > _MAX_TMPDIR:
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="vllm-", dir="/tmp"))
  for var, path in (("VLLM_CACHE_ROOT", work / "vllm"), ("XDG_CACHE_HOME", work / "xdg"),
                    ("TORCHINDUCTOR_CACHE_DIR", work / "inductor"), ("TMPDIR", tmp)):
    os.environ.setdefault(var, str(path))
    pathlib.Path(os.environ[var]).mkdir(parents=True, exist_ok=True)
  for var, val in (("HF_HUB_OFFLINE", "1"), ("VLLM_NO_USAGE_STATS", "1"),
                   ("VLLM_CPU_KVCACHE_SPACE", "1"), ("TOKENIZERS_PARALLELISM", "false"),
                   ("XLA_PYTHON_CLIENT_PREALLOCATE", "false")):  # GPU: leave room for vLLM
    os.environ.setdefault(var, val)
  tempfile.tempdir = None  # re-read TMPDIR


def _vllm_importable() -> tuple[bool, str]:
  """(importable, why not)."""
  try:
    import vllm  # noqa: F401
  except Exception as e:  # ModuleNotFoundError, or a broken install (torchcodec, ...)
    return False, f"vLLM is not importable ({type(e).__name__}: {e})"
  return True, ""


def _version(dist: str):
  import importlib.metadata
  try:
    return importlib.metadata.version(dist)
  except importlib.metadata.PackageNotFoundError:
    return None


def _prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
  import numpy as np
  rng = np.random.default_rng(seed)
  return rng.integers(0, vocab, size=(batch, length)).tolist()


def _timed(engine, prompts, sampling, n: int, seed: int) -> dict:
  """One generate call: its wall clock and the completion tokens it returned."""
  t0 = time.perf_counter()
  out = engine.generate(prompts, sampling, n=n, seed=seed)
  seconds = time.perf_counter() - t0
  lengths = [len(c.token_ids) for comps in out for c in comps]
  return {"seconds": seconds, "tokens": sum(lengths), "completions": len(lengths),
          "short": sum(x < sampling.max_tokens for x in lengths),
          "tokens_per_s": sum(lengths) / seconds}


def _summary(runs: list[dict]) -> dict:
  return {"median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
          "repeats": runs}


def _fmt(x, spec: str) -> str:
  return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def main():
  t_start = time.perf_counter()
  a = _args()
  info = run_info(smoke=a.smoke)
  own_work = a.work is None
  work = pathlib.Path(a.work or tempfile.mkdtemp(prefix="rollout_tp_", dir="/tmp"))
  _environment(work)

  import jax
  from flax import nnx

  from posttrain_jax.engines.base import SamplingParams
  from posttrain_jax.engines.jax_sampler import JaxSamplerConfig
  from posttrain_jax.engines.registry import EngineContext, engine_spec
  from posttrain_jax.models import hf_io
  from posttrain_jax.models.tiny import TinyModelConfig, build_tiny_model

  heads = max(1, a.hidden // a.head_dim)
  tiny = TinyModelConfig(vocab_size=a.vocab, hidden_size=a.hidden,
                         intermediate_size=a.intermediate or 3 * a.hidden, num_layers=a.layers,
                         num_heads=heads, num_kv_heads=max(1, heads // 2), head_dim=a.head_dim,
                         max_position_embeddings=max(1024, a.prompt_len + a.max_tokens),
                         param_dtype="float32", corpus_lines=1000)
  t0 = time.perf_counter()
  model_dir = build_tiny_model(tiny, cache_root=work / "models")
  model = hf_io.load_hf_model(model_dir)
  graphdef, _ = nnx.split(model, nnx.Param)
  n_params = model.cfg.num_params()
  print(f"model: {n_params / 1e6:.2f}M parameters (d={a.hidden}, {a.layers} layers, vocab "
        f"{a.vocab}, fp32), built/loaded in {time.perf_counter() - t0:.1f} s; batch: "
        f"{a.prompt_len}-token prompts x n={a.n} x {a.max_tokens} new tokens, temperature 1, "
        f"no stop tokens; {a.repeats} repeats; {os.cpu_count()} CPUs, jax on "
        f"{jax.default_backend()}", flush=True)

  ctx = EngineContext(model_dir=model_dir, model_config=model.cfg, model=model, graphdef=graphdef,
                      max_prompt_len=a.prompt_len, max_tokens=a.max_tokens)
  engines = {"jax": engine_spec("jax").build(JaxSamplerConfig(), ctx)}
  vllm_skipped, startup_s, vllm_cfg = None, None, None
  if a.no_vllm:
    ok, why = False, "--no_vllm"
  elif a.smoke:
    ok, why = False, ("--smoke: vLLM's start-up and first batch (50 + 28 s measured on a 2-core "
                      "CPU) are beyond a smoke run; run without --smoke for the vLLM side")
  else:
    ok, why = _vllm_importable()
  if not ok:
    vllm_skipped = why
  else:
    from posttrain_jax.engines.base import EngineError
    from posttrain_jax.engines.vllm_engine import VLLMEngineConfig
    spec = engine_spec("vllm")
    vllm_cfg = VLLMEngineConfig(dtype="float32", max_model_len=a.prompt_len + a.max_tokens,
                                enforce_eager=a.enforce_eager, seed=0,
                                gpu_memory_utilization=a.gpu_memory_utilization)
    try:
      spec.check(vllm_cfg, model.cfg, a.max_tokens)
      engines["vllm"] = spec.build(vllm_cfg, ctx)
      startup_s = engines["vllm"].startup_s
      print(f"vLLM {_version('vllm') or _version('vllm-cpu')} started in {startup_s:.1f} s "
            f"(enforce_eager={a.enforce_eager})", flush=True)
    except (EngineError, ValueError) as e:  # UserError / ConfigTypeError are ValueErrors
      vllm_skipped = f"vLLM did not start ({type(e).__name__}: {e})"
  if vllm_skipped:
    print(f"vLLM skipped: {vllm_skipped}", flush=True)

  sampling = SamplingParams(max_tokens=a.max_tokens, temperature=1.0)
  rows = []
  try:
    for b in a.sizes:
      runs = {name: [] for name in engines}
      warmup = {}
      for r in range(a.repeats + 1):  # r = 0: the warm-up (compiles)
        prompts = _prompts(b, a.prompt_len, a.vocab, seed=1000 * b + r)
        for name, engine in engines.items():
          run = _timed(engine, prompts, sampling, a.n, seed=r)
          if r == 0:
            warmup[name] = run["seconds"]
          else:
            runs[name].append(run)
      row = {"prompts": b, "completions": b * a.n, "warmup_s": warmup,
             **{name: _summary(rs) for name, rs in runs.items()}}
      jax_tps = row["jax"]["median_tokens_per_s"]
      vllm_tps = row["vllm"]["median_tokens_per_s"] if "vllm" in row else None
      row["vllm_over_jax"] = None if vllm_tps is None else vllm_tps / jax_tps
      rows.append(row)
      warm = ", ".join(f"{k} {v:.1f} s" for k, v in warmup.items())
      print(f"  B={b}: jax {jax_tps:.0f} tok/s" + ("" if vllm_tps is None else
            f", vllm {vllm_tps:.0f} tok/s") + f" (warm-up {warm})", flush=True)
  finally:
    if "vllm" in engines:
      engines["vllm"].close()
  short = sum(run["short"] for row in rows for name in engines for run in row[name]["repeats"])

  print(f"\n{'prompts':>7} {'compl.':>6} {'tokens':>7} {'jax tok/s':>10} {'vllm tok/s':>11} "
        f"{'vllm/jax':>9} {'jax warm s':>10} {'vllm warm s':>11}")
  for row in rows:
    vllm_tps = row["vllm"]["median_tokens_per_s"] if "vllm" in row else None
    print(f"{row['prompts']:>7} {row['completions']:>6} {row['jax']['repeats'][0]['tokens']:>7} "
          f"{row['jax']['median_tokens_per_s']:>10.0f} {_fmt(vllm_tps, '11.0f'):>11} "
          f"{_fmt(row['vllm_over_jax'], '9.2f'):>9} {row['warmup_s']['jax']:>10.1f} "
          f"{_fmt(row['warmup_s'].get('vllm'), '11.1f'):>11}")
  if vllm_skipped:
    print(f"vLLM skipped: {vllm_skipped}")
  if short:
    print(f"WARNING: {short} completions ended before max_tokens={a.max_tokens}")
  faster = [row["prompts"] for row in rows if (row["vllm_over_jax"] or 0) > 1]
  if not vllm_skipped:
    print("vLLM is faster from " + (f"{faster[0]} prompts x n={a.n} on" if faster
                                    else "none of these batch sizes"))

  wall_s = time.perf_counter() - t_start
  result = {
      "model": dataclasses.asdict(tiny), "params": n_params,
      "batch": {"batch_sizes": a.sizes, "prompt_len": a.prompt_len, "n": a.n,
                "max_tokens": a.max_tokens, "temperature": 1.0, "stop_token_ids": [],
                "repeats": a.repeats},
      "rows": rows, "short_completions": short,
      "vllm": {"skipped": vllm_skipped, "startup_s": startup_s,
               "config": None if vllm_cfg is None else dataclasses.asdict(vllm_cfg)},
      "versions": {"python": platform.python_version(), "jax": jax.__version__,
                   "jaxlib": _version("jaxlib"), "flax": _version("flax"),
                   "vllm": _version("vllm") or _version("vllm-cpu"), "torch": _version("torch")},
      "machine": {"cpus": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)),
                  "platform": platform.platform(), "jax_backend": jax.default_backend(),
                  "loadavg_end": list(os.getloadavg())},
      "wall_s": wall_s,
  }
  write_result(a.out, info, result)
  if own_work:
    shutil.rmtree(work, ignore_errors=True)
  last = rows[-1]
  nan = float("nan")
  vllm_tps = last["vllm"]["median_tokens_per_s"] if "vllm" in last else nan
  ratio = nan if last["vllm_over_jax"] is None else last["vllm_over_jax"]
  print(f"wall time {wall_s:.0f} s")
  print(f"RESULT jax_tokens_per_s={last['jax']['median_tokens_per_s']:.1f} "
        f"vllm_tokens_per_s={vllm_tps:.1f} vllm_over_jax={ratio:.3f}")


if __name__ == "__main__":
  main()
