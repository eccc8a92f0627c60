"""Where one RL step's time goes: the real trainer loop (embedded JAX sampler, sync and async
mode) cut into parts, as seconds and as a fraction of the step.

The run is `configs/default.py` driven through `Trainer.run()` (the code a user runs); the
parts are timed by wrapping the functions the step calls, without changing them:

    weight sync        SyncRollouts.update_weights (the sampler takes the learner's arrays)
    prompt encode      rollout.encode_prompt (chat template per task)
    generate host      JaxSampler.generate outside the device call (padding, Completions)
    generate device    the jitted prefill + decode loop, to block_until_ready; split into
                       prefill (a prefill-only call of the same shapes, timed after the run)
                       and decode (the rest)
    decode to text     tokenizer.decode of every completion
    grading            the grader of every completion
    rollout python     the rest of the episode / collect (Trajectory objects, retries)
    rollout wait       async: collect() waiting for the rollout thread's groups
    advantages         compute_advantages
    batch building     batching.build_batch (+ trimming)
    host->device       Learner.put_batch, to block_until_ready
    ref / old logp     Learner.logprobs (a forward with other or current params)
    train step         the jitted train_step (forward, backward, AdamW), to block_until_ready
    train metrics      the rest of Learner.step (metric fetch, lr)
    metrics / log      episode_signals, source.metrics, MetricsWriter.write
    checkpoint         Checkpointer.save
    idle python        the step's wall time minus all of the above

In async mode the rollouts run in the actor pool's threads while the learner trains: the parts
timed there (prompt encode ... grading, "rollout python" = the episode's own Python) are
listed apart as "overlapped" seconds per step (their fraction is of the step's wall time; they
are not part of the step's sum, which is the learner thread's), and the learner thread's
time blocked on them is "rollout wait".

A step is the wall time from one rl_step call to the next (the trainer loop's whole
iteration: progress bar, metrics file and checkpoint check included); the first `--warmup`
steps (compiles) are left out, and parts are summed over the measured steps.

Also reported: real tokens (the trajectories' positions and their sampled tokens) against the
positions the train step computes (rows x seq_len per forward), the number of XLA compiles in
the measured steps (recompiles from varying shapes), and host round trips per decode step
(device calls + fetches of the sampler per decode step).

Cases: "tiny" is the issue's setting (a 3.3M-parameter Qwen3-like model, the default config's
with d=256, f=768, head_dim=64, warm-started by the default SFT, 2-digit addition, 8 prompts x 8 completions of <= 8 tokens, lr 3e-5, no KL term);
"big" the same run on a 55M-parameter model of the same family (d=768, 8 layers; random
weights unless --big_sft_steps, so completions run to the token limit).

`--variants before,after` adds, from the same warm-start and in the same process, a column
with the step's fast paths off (`before`: no batch trimming, rl.batch.trim=False, and the
report-only reference forward every step, kl_every=1, and no shared-prefix rows,
rl.batch.share_prefix=False): what the code did before them; `--trim` / `--kl_every` /
`--share_prefix` set them for the `after` column (to measure one fix at a time); `plain` is
`after` without shared-prefix rows.

    python benchmarks/step_breakdown.py --out /tmp/breakdown.json --modes sync,async [--smoke]
ends with `RESULT tiny_sync_step_s=... tiny_sync_train_frac=... tiny_sync_gen_frac=... ...`
(one group of keys per case x mode x variant; `_before` / `_plain` rows add
`..._before_speedup=` / `..._plain_speedup=`: their step time over `after`'s).

`--smoke`: the tiny case only, 2 SFT steps, 2 prompts x 8 in 16 rows a step, 1 warm-up and 1
measured step, in two runs that cover every mode and variant once (first mode x first variant,
last x last; seconds, for CI); the big case's keys read nan, the pairs not run are absent.

Measured 2026-12-05 (2-core CPU, jax 0.10.2), mean s per step, before -> after:

    case                  before    after   after: train step / generate / ref+old logp
    tiny sync (3.3M)      2.0876   0.1160   58% / 27% / 2%    (--cases tiny --modes sync)
    big sync (55.5M)     27.6775   2.5594   80% / 20% / 0%
    big async (55.5M)    35.4905   3.9046   66% / (overlapped) / 31%

The big case's train step computes 1024 positions for 1334 real ones (8192 before: unpadded
rows, one shared prompt row per group); on 2 shared cores async is slower than sync (the
generation it overlaps takes the same cores, plus the correction's old-logp forward), which is
what rl.mode=auto measures before it turns async.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import json
import pathlib
import sys
import tempfile
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain_jax import batching, learner as learner_lib
from posttrain_jax.run import rl_step as rl_step_lib
from posttrain_jax.run import loop as trainer_lib
from posttrain_jax.actors import pool as pool_lib
from posttrain_jax.actors import rollout as rollout_lib
from posttrain_jax.checkpoint import Checkpointer
from posttrain_jax.configs import default as default_config
from posttrain_jax.engines import jax_sampler
from posttrain_jax.metrics import MetricsWriter
from posttrain_jax.models.decoder import init_cache
from posttrain_jax.run_config import run_config_from_dict

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

from benchmarks._meta import run_info, write_result  # noqa: E402

PARTS = ("weight sync", "prompt encode", "generate host", "generate prefill", "generate decode",
         "decode to text", "grading", "rollout python", "rollout wait", "advantages",
         "batch building",
         "host->device", "ref / old logp", "train step", "train metrics", "metrics / log",
         "checkpoint", "idle python")


class _Clock:
  """Exclusive timers: a part's time excludes the parts timed inside it. Parts timed in the
  thread that made the clock (the learner's) go to `parts`, those of other threads (async
  rollouts) to `overlapped`."""

  def __init__(self):
    self.on = False
    self.parts = collections.defaultdict(float)
    self.overlapped = collections.defaultdict(float)
    self._main = threading.get_ident()
    self._local = threading.local()
    self._lock = threading.Lock()

  @contextlib.contextmanager
  def part(self, name):
    stack = self._local.__dict__.setdefault("stack", [])   # [name, start, child time]
    t = time.perf_counter()
    stack.append([name, t, 0.0])
    try:
      yield
    finally:
      _, start, child = stack.pop()
      dt = time.perf_counter() - start
      if stack:
        stack[-1][2] += dt
      if self.on:
        with self._lock:
          into = self.parts if threading.get_ident() == self._main else self.overlapped
          into[name] += dt - child


def _wrap(clock, name, fn, block=False):
  @functools.wraps(fn)
  def wrapped(*a, **k):
    with clock.part(name):
      out = fn(*a, **k)
      return jax.block_until_ready(out) if block else out
  return wrapped


def _patch(stack, obj, attr, new):
  old = getattr(obj, attr)
  setattr(obj, attr, new)
  stack.callback(setattr, obj, attr, old)


def case_config(case: str, args, workdir: str, model_path=None, rl_steps=None, mode="sync"):
  """The default run with the issue's RL settings; `big` widens the model. With `model_path`
  (a warm-start exported by `warm_start`) RL starts from it and there is no SFT phase."""
  c = default_config.get_config()
  c.workdir = workdir
  c.rl.mode = mode
  c.rl.update(prompts_per_step=8,
              steps=args.warmup + args.steps + 1 if rl_steps is None else rl_steps)
  c.rl.rollout.update(group_size=8, max_tokens=8)
  c.rl.learner.optimizer.update(learning_rate=3e-5, warmup_steps=0)
  c.eval.update(every_steps=0, samples_per_prompt=1, greedy=False, max_tokens=8)
  c.tasks.update(eval_size=8)
  c.checkpoint.update(every_steps=10_000, max_to_keep=1)
  if case == "big":
    c.model.tiny.update(hidden_size=768, intermediate_size=2304, num_layers=8, num_heads=12,
                        num_kv_heads=4, head_dim=64)
    c.sft.update(steps=args.big_sft_steps)
  else:   # the 3.2M-parameter model (the default config's is 0.85M)
    c.model.tiny.update(hidden_size=256, intermediate_size=768, head_dim=64)
    c.sft.update(steps=args.tiny_sft_steps)
  if c.sft.steps:
    c.sft.learner.optimizer.update(decay_steps=c.sft.steps)
  if model_path is not None:
    c.model.path = str(model_path)
    c.sft.steps = 0
  for override in args.set:
    path, value = override.split("=", 1)
    node = c
    *head, leaf = path.split(".")
    for k in head:
      node = node[k]
    node[leaf] = json.loads(value)
  return run_config_from_dict(c.to_dict())


def warm_start(case: str, args, directory: str):
  """The case's SFT warm-start, run once and shared by the variants (None: no SFT)."""
  cfg = case_config(case, args, directory, rl_steps=0)
  if not cfg.sft.steps:
    return None
  trainer_lib.Trainer(cfg, log=lambda *_: None).run()
  return f"{directory}/sft_model"


# The code's behaviour before the step_breakdown fixes, for a side-by-side column.
VARIANTS = {"before": {"trim": False, "kl_every": 1, "share_prefix": False},
            "plain": {"share_prefix": False}, "after": {}}


def measure(case: str, args, model_path=None, variant=None, mode="sync") -> dict:
  variant = variant or {}
  clock = _Clock()
  windows: list[float] = []
  tokens = collections.Counter()
  compiles = [0]
  gen_calls: list = []           # [device calls, (prompt, seg) of the last, sampling params]
  decode_steps = [0]
  marks: list[float] = []

  def rl_step(*a, **k):
    now = time.perf_counter()
    if marks and len(marks) > args.warmup:
      windows.append(now - marks[-1])
    marks.append(now)
    clock.on = len(marks) > args.warmup and len(marks) <= args.warmup + args.steps
    if "kl_every" in variant:
      k["kl_every"] = variant["kl_every"]
    return real_rl_step(*a, **k)

  def on_event(event, duration, **kw):
    if event == "/jax/core/compile/backend_compile_duration" and clock.on:
      compiles[0] += 1

  real_rl_step = trainer_lib.rl_step
  real_start, real_continue = jax_sampler._start, jax_sampler._continue

  def start_device(*a, **k):  # the sampler's prefill program
    with clock.part("generate device"):
      out = jax.block_until_ready(real_start(*a, **k))
    if clock.on:
      gen_calls[:] = [gen_calls[0] + 1 if gen_calls else 1, a[2:4], k["sp"]]
    return out

  def continue_device(*a, **k):  # its decode steps (carry[5]: the rows' lengths)
    with clock.part("generate device"):
      out = jax.block_until_ready(real_continue(*a, **k))
    if clock.on:
      decode_steps[0] += int(np.max(np.asarray(out[5])))
    return out

  def build_batch(trajs, advs, cfg, *a, **k):
    with clock.part("batch building"):
      out = real_build(trajs, advs, cfg, *a, **k)
    if clock.on:
      tokens["real_positions"] += sum(len(t.token_ids) - 1 for t in trajs)
      tokens["sampled_tokens"] += sum(t.num_sampled for t in trajs)
      tokens["sequences"] += len(trajs)
    return out

  def count_forward(kind, fn):
    def counted(self, batch, *a, **k):
      if clock.on:
        tokens[f"{kind}_positions"] += int(np.prod(np.shape(batch.input_ids)))
        tokens[f"{kind}_calls"] += 1
      return fn(self, batch, *a, **k)
    return counted

  real_build = batching.build_batch
  L = learner_lib.Learner
  real_init = L.__init__

  def learner_init(self, *a, **k):
    real_init(self, *a, **k)
    self._step = _wrap(clock, "train step", self._step, block=True)

  jax.monitoring.register_event_duration_secs_listener(on_event)
  with tempfile.TemporaryDirectory() as workdir, contextlib.ExitStack() as stack:
    cfg = case_config(case, args, workdir, model_path, mode=mode)
    batch_fields = {k: variant[k] for k in ("trim", "share_prefix") if k in variant}
    if batch_fields:
      cfg = dataclasses.replace(cfg, rl=dataclasses.replace(
          cfg.rl, batch=dataclasses.replace(cfg.rl.batch, **batch_fields)))
    p = functools.partial(_patch, stack)
    p(trainer_lib, "rl_step", rl_step)
    p(jax_sampler, "_start", start_device)
    p(jax_sampler, "_continue", continue_device)
    p(jax_sampler.JaxSampler, "generate",
      _wrap(clock, "generate host", jax_sampler.JaxSampler.generate))
    p(rollout_lib.SyncRollouts, "update_weights",
      _wrap(clock, "weight sync", rollout_lib.SyncRollouts.update_weights))
    p(rollout_lib.SyncRollouts, "collect",
      _wrap(clock, "rollout python", rollout_lib.SyncRollouts.collect))
    p(rollout_lib.SyncRollouts, "metrics",
      _wrap(clock, "metrics / log", rollout_lib.SyncRollouts.metrics))
    A = pool_lib.AsyncRollouts
    p(A, "update_weights", _wrap(clock, "weight sync", A.update_weights))
    p(A, "collect", _wrap(clock, "rollout wait", A.collect))
    p(A, "metrics", _wrap(clock, "metrics / log", A.metrics))
    p(rollout_lib.TaskEpisode, "run", _wrap(clock, "rollout python", rollout_lib.TaskEpisode.run))
    p(rollout_lib, "encode_prompt", _wrap(clock, "prompt encode", rollout_lib.encode_prompt))
    p(rl_step_lib, "compute_advantages",
      _wrap(clock, "advantages", rl_step_lib.compute_advantages))
    p(rl_step_lib, "episode_signals", _wrap(clock, "metrics / log", rl_step_lib.episode_signals))
    p(batching, "build_batch", build_batch)
    p(L, "__init__", learner_init)
    p(L, "put_batch", _wrap(clock, "host->device", L.put_batch, block=True))
    p(L, "logprobs", count_forward("logprob", _wrap(clock, "ref / old logp", L.logprobs,
                                                    block=True)))
    p(L, "step", count_forward("train", _wrap(clock, "train metrics", L.step)))
    p(MetricsWriter, "write", _wrap(clock, "metrics / log", MetricsWriter.write))
    p(Checkpointer, "save", _wrap(clock, "checkpoint", Checkpointer.save))
    t0 = time.perf_counter()
    trainer = trainer_lib.Trainer(cfg, log=lambda *_: None)
    p(trainer.tokenizer, "decode", _wrap(clock, "decode to text", trainer.tokenizer.decode))
    trainer.parts.grader = _wrap(clock, "grading", trainer.parts.grader)
    result = trainer.run()
    wall = time.perf_counter() - t0
    # the last measured call's shapes, on the final weights (the ones it saw were donated)
    prefill = (_prefill_seconds(trainer.engine, *gen_calls[1:]) if gen_calls else 0.0)
    n_params = trainer.parts.model_cfg.num_params()
  n = len(windows)
  total = sum(windows)
  gen_n = gen_calls[0] if gen_calls else 0

  def split_generate(timed):   # the device call as prefill (measured apart) + decode
    out = dict(timed)
    device = out.pop("generate device", 0.0)
    if device:
      out["generate prefill"] = min(prefill * gen_n, device)
      out["generate decode"] = device - out["generate prefill"]
    return out
  parts, overlapped = split_generate(clock.parts), split_generate(clock.overlapped)
  parts["idle python"] = total - sum(parts.values())
  per_step = {k: parts.get(k, 0.0) / n for k in PARTS}
  computed = tokens["train_positions"] + tokens["logprob_positions"]
  return {
      "case": case, "mode": mode, "params": n_params, "steps": n, "step_s": total / n,
      "step_s_best": min(windows), "step_s_median": float(np.median(windows)),
      "parts_s": per_step, "parts_frac": {k: v * n / total for k, v in per_step.items()},
      "overlapped_s": {k: overlapped.get(k, 0.0) / n for k in PARTS if overlapped.get(k)},
      "overlapped_frac": {k: v / total for k, v in overlapped.items() if v},
      "real_positions_per_step": tokens["real_positions"] / n,
      "sampled_tokens_per_step": tokens["sampled_tokens"] / n,
      "sequences_per_step": tokens["sequences"] / n,
      "train_positions_per_step": tokens["train_positions"] / n,
      "logprob_positions_per_step": tokens["logprob_positions"] / n,
      "logprob_calls_per_step": tokens["logprob_calls"] / n,
      "computed_over_real": computed / max(tokens["real_positions"], 1),
      "compiles_in_measured_steps": compiles[0],
      "decode_steps_per_step": decode_steps[0] / n,
      "host_round_trips_per_decode_step": 2 * gen_n / max(decode_steps[0], 1),
      "run_wall_s": wall, "heldout_after": result["heldout_after"] if result else None,
      "lm_head_impl": __import__("posttrain_jax.kernels.lm_head", fromlist=["x"]).resolve_impl(
          "auto"),
  }


def _prefill_seconds(sampler, arrays, sp, repeats: int = 3) -> float:
  """Best time of a prefill-only call (prompt forward + first logits) of the same shapes."""
  prompt_bp, seg_bp = arrays
  graphdef, (params, _) = sampler._graphdef, sampler._snapshot()

  @jax.jit
  def prefill(params, prompt_bp, seg_bp):
    model = nnx.merge(graphdef, params)
    b, p = prompt_bp.shape
    cache = init_cache(model.cfg, b, p + sp.max_tokens)
    pos = jnp.maximum(jnp.cumsum(seg_bp, axis=1) - 1, 0)
    hidden, _ = model(prompt_bp, pos, seg_bp, cache)
    return model.logits(hidden[:, -1])

  jax.block_until_ready(prefill(params, prompt_bp, seg_bp))
  best = float("inf")
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(prefill(params, prompt_bp, seg_bp))
    best = min(best, time.perf_counter() - t)
  return best


def print_table(rows: list[dict]) -> None:
  head = f"{'part':<18}" + "".join(f"{r['case'] + ' s':>16}{'frac':>7}" for r in rows)
  print(head)
  for k in PARTS:
    print(f"{k:<18}" + "".join(f"{r['parts_s'][k]:>16.4f}{r['parts_frac'][k]:>7.3f}" for r in rows))
  print(f"{'step (mean)':<18}" + "".join(f"{r['step_s']:>16.4f}{1.0:>7.3f}" for r in rows))
  over = [k for k in PARTS if any(k in r["overlapped_s"] for r in rows)]
  if over:
    print("overlapped (rollout threads, not in the step's sum):")
    for k in over:
      print(f"  {k:<16}" + "".join(f"{r['overlapped_s'].get(k, 0.0):>16.4f}"
                                   f"{r['overlapped_frac'].get(k, 0.0):>7.3f}" for r in rows))
  for key in ("params", "step_s_best", "sequences_per_step", "real_positions_per_step",
              "sampled_tokens_per_step", "train_positions_per_step",
              "logprob_positions_per_step", "computed_over_real", "compiles_in_measured_steps",
              "decode_steps_per_step", "host_round_trips_per_decode_step", "lm_head_impl"):
    print(f"{key:<34}" + "".join(f"{r[key]!s:>23.10}" for r in rows))


def _gen_frac(r) -> float:
  keys = ("generate prefill", "generate decode", "generate host")
  return sum(r["parts_frac"][k] for k in keys) + sum(r["overlapped_frac"].get(k, 0.0)
                                                      for k in keys)


def main():
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", required=True, help="write the figures here (JSON)")
  ap.add_argument("--cases", default="tiny,big", help="comma-separated: tiny, big")
  ap.add_argument("--modes", default="sync,async", help="comma-separated: sync, async (rl.mode)")
  ap.add_argument("--steps", type=int, default=20, help="measured steps (tiny)")
  ap.add_argument("--big_steps", type=int, default=3, help="measured steps (big)")
  ap.add_argument("--warmup", type=int, default=2, help="steps left out (compiles)")
  ap.add_argument("--tiny_sft_steps", type=int, default=350, help="SFT warm-start (tiny)")
  ap.add_argument("--big_sft_steps", type=int, default=0, help="SFT warm-start (big)")
  ap.add_argument("--variants", default="before,after",
                  help="comma-separated: after (the code as it is, or as --trim / --kl_every "
                       "say), before (rl.batch.trim=False and the report-only reference "
                       "forward every step, kl_every=1), side by side from one warm-start")
  ap.add_argument("--trim", choices=("true", "false"), default=None,
                  help="the after column's rl.batch.trim (default: the config's)")
  ap.add_argument("--share_prefix", choices=("true", "false"), default=None,
                  help="the after column's rl.batch.share_prefix (default: the config's)")
  ap.add_argument("--kl_every", type=int, default=None,
                  help="the after column's report-only KL interval (default: rl_step.KL_EVERY)")
  ap.add_argument("--set", action="append", default=[],
                  help="a config override path=json for both cases, e.g. rl.reference_kl=false")
  ap.add_argument("--smoke", action="store_true",
                  help="the tiny case only, 2 SFT steps, 2 prompts a step, 1 warm-up + 1 "
                       "measured step (CI)")
  args = ap.parse_args()
  info = run_info(smoke=args.smoke)
  if args.smoke:
    args.steps, args.big_steps, args.warmup, args.tiny_sft_steps = 1, 1, 1, 2
    args.set = ["rl.prompts_per_step=2", "rl.batch.rows=16", "rl.batch.max_seqs=16", *args.set]
  after = {}
  if args.trim is not None:
    after["trim"] = args.trim == "true"
  if args.kl_every is not None:
    after["kl_every"] = args.kl_every
  if args.share_prefix is not None:
    after["share_prefix"] = args.share_prefix == "true"
  variants = dict(VARIANTS, after=after)
  rows = []
  for case in args.cases.split(","):
    if args.smoke and case != "tiny":   # its keys read nan
      print(f"--smoke: the {case} case is skipped (a 55M-parameter model: minutes a step)")
      rows += [{"case": f"{case}_{mode}" + ("" if v == "after" else f"_{v}"), "skipped": True}
               for mode in args.modes.split(",") for v in args.variants.split(",")]
      continue
    a = argparse.Namespace(**vars(args))
    if case == "big":
      a.steps = args.big_steps
    with tempfile.TemporaryDirectory() as directory:
      path = warm_start(case, a, directory)
      modes, names = args.modes.split(","), args.variants.split(",")
      pairs = [(m, v) for m in modes for v in names]
      if args.smoke:  # every mode and every variant once, not every pair: 2 runs, not 4
        pairs = sorted({(modes[0], names[0]), (modes[-1], names[-1])})
      for mode, v in pairs:
        row = measure(case, a, path, variants[v], mode=mode)
        row["case"] = f"{case}_{mode}" + ("" if v == "after" else f"_{v}")
        row["variant"] = variants[v]
        rows.append(row)
        print(f"[{row['case']}] done: {row['steps']} steps, mean {row['step_s']:.4f} s",
              flush=True)
  print(f"backend {jax.default_backend()}, {jax.device_count()} device(s); jax sampler")
  groups: dict = {}
  for r in rows:
    groups.setdefault(r["case"].removesuffix("_before").removesuffix("_plain"), []).append(r)
  for name, group in groups.items():
    group = [r for r in group if not r.get("skipped")]
    if group:
      print(f"\n== {name} ({group[0]['params'] / 1e6:.1f}M parameters) ==")
      print_table(group)
  write_result(args.out, info, {"backend": jax.default_backend(), "rows": rows})
  out = []
  for r in rows:
    if r.get("skipped"):
      out += [f"{r['case']}_{k}=nan" for k in ("step_s", "train_frac", "gen_frac", "ref_frac",
                                                "computed_over_real", "compiles")]
      continue
    c, fr = r["case"], r["parts_frac"]
    out += [f"{c}_step_s={r['step_s']:.4f}", f"{c}_train_frac={fr['train step']:.3f}",
            f"{c}_gen_frac={_gen_frac(r):.3f}", f"{c}_ref_frac={fr['ref / old logp']:.3f}",
            f"{c}_computed_over_real={r['computed_over_real']:.2f}",
            f"{c}_compiles={r['compiles_in_measured_steps']}"]
  by_case = {r["case"]: r for r in rows}
  for c in groups:
    for v in ("before", "plain"):
      if c in by_case and f"{c}_{v}" in by_case:
        x, y = by_case[f"{c}_{v}"], by_case[c]
        out.append(f"{c}_{v}_speedup=" + ("nan" if x.get("skipped") or y.get("skipped") else
                                          f"{x['step_s'] / y['step_s']:.2f}"))
  print("RESULT " + " ".join(out))


if __name__ == "__main__":
  main()
