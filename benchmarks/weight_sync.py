"""Weight sync learner -> in-process vLLM: seconds per GB of weights, end to end.

A model of ~100M parameters (fp32, ~0.4 GB) is built with build_tiny_model and loaded into a
JAX Decoder (the learner's side); a VLLMEngine serves it. Each timed `update_weights(model,
version)` covers everything between the learner's arrays and the engine sampling with them:

  pack    JAX arrays -> one safetensors buffer in RAM (HF names, transposes, dtype cast)
  load    the buffer -> vLLM's weights (RPC to the worker, reload_weights, CPU re-packing)
  reset   prefix-cache reset

Two parameter sets alternate so that every push changes the weights; after the last push the
engine's teacher-forced log-probs of a fixed sequence are compared with the learner's (a sync
that is fast but wrong would show here). Median over --repeats pushes per transport
(`shm`: the buffer is a file in /dev/shm and only its path crosses the process boundary;
`bytes`: the buffer rides inside the RPC). Ends with one line:

  RESULT weight_sync_s_per_gb=<median s/GB of the first transport>

Usage: python benchmarks/weight_sync.py [--out FILE.json] [--repeats R] [--transports shm,bytes]
       [--hidden 768 --layers 14 --intermediate 2048 --vocab 16384] [--work DIR] [--smoke]
Caches (vLLM, torch inductor, the built model) go under --work (default: a temp dir).

`--smoke`: the smallest model (d=64, 1 layer, vocab 512; 1 repeat), the learner's side only:
build and load it, pack each transport's buffer (the `pack` of a push, timed) and the
learner's log-probs of the fixed sequence. vLLM is skipped there (it says so; its columns and
the RESULT are nan): on a 2-core CPU its start-up alone took 50-53 s. Seconds, for CI.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))
from benchmarks._meta import run_info, write_result  # noqa: E402

SMOKE_SKIP = ("--smoke: vLLM's start-up (~50 s measured on a 2-core CPU) is beyond a smoke run; "
              "run without --smoke for the vLLM side")


def _args():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default=None, help="write the results as JSON here")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--transports", default="shm,bytes")
  p.add_argument("--hidden", type=int, default=768)
  p.add_argument("--layers", type=int, default=14)
  p.add_argument("--intermediate", type=int, default=2048)
  p.add_argument("--vocab", type=int, default=16384)
  p.add_argument("--heads", type=int, default=12)
  p.add_argument("--kv-heads", type=int, default=4)
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--work", default=None, help="directory for caches and the model")
  p.add_argument("--smoke", action="store_true",
                 help="d=64, 1 layer, vocab 512, 1 repeat; the learner's side only (pack, "
                      "log-probs), vLLM skipped: seconds, for CI")
  a = p.parse_args()
  if a.smoke:
    a.hidden, a.layers, a.intermediate, a.vocab, a.repeats = 64, 1, 128, 512, 1
    a.heads, a.kv_heads, a.head_dim = 2, 1, 32
  return a


def main():
  a = _args()
  info = run_info(smoke=a.smoke)
  work = pathlib.Path(a.work or tempfile.mkdtemp(prefix="weight_sync_"))
  for var, sub in (("VLLM_CACHE_ROOT", "vllm"), ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
                   ("XDG_CACHE_HOME", "xdg"), ("TMPDIR", "tmp")):
    os.environ.setdefault(var, str(work / sub))
    pathlib.Path(os.environ[var]).mkdir(parents=True, exist_ok=True)
  for var, val in (("HF_HUB_OFFLINE", "1"), ("VLLM_NO_USAGE_STATS", "1"),
                   ("VLLM_CPU_KVCACHE_SPACE", "1"), ("JAX_PLATFORMS", "cpu"),
                   ("TOKENIZERS_PARALLELISM", "false")):
    os.environ.setdefault(var, val)

  import jax
  import numpy as np
  from flax import nnx

  from posttrain_jax import batching
  from posttrain_jax import learner as L
  from posttrain_jax.engines import vllm_worker
  from posttrain_jax.engines.vllm_engine import VLLMEngine, VLLMEngineConfig
  from posttrain_jax.engines.vllm_inputs import hf_pairs
  from posttrain_jax.models import hf_io
  from posttrain_jax.models.tiny import TinyModelConfig, build_tiny_model
  from posttrain_jax.types import Trajectory

  jax.config.update("jax_default_matmul_precision", "highest")
  tiny = TinyModelConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                         num_layers=a.layers, num_heads=a.heads, num_kv_heads=a.kv_heads,
                         head_dim=a.head_dim, param_dtype="float32")
  t0 = time.perf_counter()
  model_dir = build_tiny_model(tiny, cache_root=work / "models")
  model_a = hf_io.load_hf_model(model_dir)
  graphdef, state = nnx.split(model_a, nnx.Param)
  leaves, tree = jax.tree.flatten(nnx.to_pure_dict(state))
  keys = jax.random.split(jax.random.key(1), len(leaves))
  nnx.replace_by_pure_dict(state, jax.tree.unflatten(
      tree, [x + 0.01 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]))
  model_b = nnx.merge(graphdef, state)
  n_params = sum(int(np.prod(x.shape)) for x in leaves)
  print(f"model: {n_params / 1e6:.1f}M parameters ({n_params * 4 / 1e9:.2f} GB fp32), "
        f"built/loaded in {time.perf_counter() - t0:.0f} s", flush=True)

  rows, version = [], 0
  transports = a.transports.split(",")
  seq = [(13 * i + 5) % min(a.vocab, 2000) for i in range(64)]

  def learner_logprobs(served):
    traj = Trajectory(id="s", task_id="s", token_ids=seq, loss_mask=[0] + [1] * 63,
                      behaviour_logprobs=[0.0] * 64, policy_version=[0] * 64)
    batch = batching.build_batch([traj], [0.0],
                                 batching.BatchConfig(rows=1, seq_len=64, max_seqs=1))
    return np.asarray(L.Learner(served, L.LearnerConfig(loss="sft")).logprobs(batch))[0, :63]

  if a.smoke:  # the learner's side of a push (update_weights' pack), no engine to load into
    print(f"vLLM skipped: {SMOKE_SKIP}", flush=True)
    nan = float("nan")
    for transport in transports:
      pairs = list(hf_pairs(model_b))
      t0 = time.perf_counter()
      nbytes = (vllm_worker.pack_file(str(work / "tmp" / "weights.safetensors"), pairs, "float32")
                if transport == "shm" else len(vllm_worker.pack_bytes(pairs, "float32")))
      rows.append({"transport": transport, "bytes": nbytes, "tensors": len(pairs),
                   "pack_s": time.perf_counter() - t0, "load_s": nan, "reset_s": nan,
                   "seconds": nan, "s_per_gb": nan, "s_per_gb_all": []})
    ours = learner_logprobs(model_b)
    result = {"params": n_params, "model": dataclasses.asdict(tiny), "startup_s": None,
              "rows": rows, "logprob_delta_after_sync": nan, "repeats": a.repeats,
              "vllm_skipped": SMOKE_SKIP}
    _report(rows)
    print(f"learner's mean log-prob of the fixed sequence {ours.mean():.3f} (no engine to compare)")
    write_result(a.out, info, result)
    print(f"RESULT weight_sync_s_per_gb={rows[0]['s_per_gb']:.3f}")
    return

  engine = VLLMEngine(VLLMEngineConfig(model=str(model_dir), dtype="float32", max_model_len=256,
                                       enforce_eager=True))
  print(f"vLLM start-up {engine.startup_s:.1f} s", flush=True)
  for transport in transports:
    engine.cfg = dataclasses.replace(engine.cfg, weight_transport=transport)
    stats = []
    for i in range(a.repeats + 1):  # the first push of each transport is a warm-up
      version += 1
      engine.update_weights(model_b if version % 2 else model_a, version)
      if i:
        stats.append(engine.last_weight_sync)
    med = lambda f: statistics.median(getattr(s, f) for s in stats)
    rows.append({"transport": transport, "bytes": stats[0].bytes, "tensors": stats[0].tensors,
                 "pack_s": med("pack_s"), "load_s": med("load_s"), "reset_s": med("reset_s"),
                 "seconds": med("seconds"),
                 "s_per_gb": statistics.median(s.seconds_per_gb for s in stats),
                 "s_per_gb_all": [s.seconds_per_gb for s in stats]})

  # correctness of the last push: engine vs learner log-probs of a fixed sequence
  served = model_b if version % 2 else model_a
  vllm_lp = np.asarray(engine.score([seq])[0])
  ours = learner_logprobs(served)
  delta = float(np.abs(vllm_lp - ours).mean())
  engine.close()

  _report(rows)
  print(f"after the last push: mean |vLLM - learner| log-prob {delta:.2e}")
  result = {"params": n_params, "model": dataclasses.asdict(tiny), "startup_s": engine.startup_s,
            "rows": rows, "logprob_delta_after_sync": delta, "repeats": a.repeats,
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}}
  write_result(a.out, info, result)
  print(f"RESULT weight_sync_s_per_gb={rows[0]['s_per_gb']:.3f}")


def _report(rows):
  print(f"\n{'transport':>9} {'MB':>7} {'pack s':>7} {'load s':>7} {'reset s':>7} {'total s':>7} "
        f"{'s/GB':>6}")
  for r in rows:
    print(f"{r['transport']:>9} {r['bytes'] / 1e6:7.1f} {r['pack_s']:7.3f} {r['load_s']:7.3f} "
          f"{r['reset_s']:7.3f} {r['seconds']:7.3f} {r['s_per_gb']:6.3f}")


if __name__ == "__main__":
  main()
