"""Fidelity: the field's two multi-turn failure cases reproduced on a tiny model on CPU, each as a
pair of runs (naive scoring vs our default), and whether the audit (posttrain_jax/audit.py)
flags them.

Every run starts from one warm start, configs/tool_math.py's SFT (WORKDIR/base, or --base DIR:
a tiny model that calls python on 4-digit × 4-digit products and copies its operands right),
then SFTs 200 steps on its case's demonstrations (posttrain_jax/envs/fidelity_envs.py: several
paths per task) and runs GRPO over whole episodes with the embedded JAX sampler (P=8 × G=8):

  case 1, infra faults (tool_math_fidelity_infra): paths `tool` (python, submit; 1 demonstration
    in 4) and `verify` (python, check × 5, submit), equally correct by design; 10% of backend
    calls fail on our side (ToolMathConfig.infra_fault_rate = 0.1, an EnvInfraError), which a
    verify episode meets 47% of the time and a tool episode 10%.
    naive   infra_scoring="zero": a fault scores the episode 0, so the long path earns less and
            GRPO shortens episodes, for no gain in what the policy can do;
    default infra_scoring="exclude": such episodes leave the loss and the baselines.
    Measured: response_len/mean (sampled tokens per episode; verify is ~3× tool).
  case 2, timeouts (tool_math_fidelity_timeout): every task hard for a tiny model (a 4-digit
    product); paths `tool` (1 demonstration in 64, the one that succeeds), `think` (10 in 64:
    "Let me think." past the episode's 64-token budget, a timeout) and `direct` (the rest:
    "The answer is v.", which the model gets wrong at RL time). The three differ from the first
    sampled token, so GRPO moves them through one decision.
    naive   timeouts="drop": a timed-out episode leaves its group; successes push the tool up,
            failures push direct down, the dropped think is pushed nowhere, so its share grows
            while failures outnumber successes (d log π_think = c·(π_direct − π_tool) > 0, with
            c > 0 the push one success–failure pair of a group gives);
    default timeouts="score": a timeout is a failure (reward 0) and is pushed down with them.
    Measured: the share of hard-task episodes that timed out. The trainer's own
    status/timeout_frac/hard only sees the episodes it kept, so under "drop" it reads 0; the
    trainer also logs filter/dropped_timeout_frac (which the audit reads), and this benchmark
    wraps the rollout source to count the dropped ones per difficulty
    (fidelity/timeout_frac[/<difficulty>], fidelity/dropped_frac).

change = mean of the last quarter of the RL steps ÷ mean of the first quarter (audit.py's
convention). The audit runs on each run's metrics.jsonl rows as the trainer wrote them
("flagged"), and once more on rows whose status/timeout_frac* count the dropped timeouts
("flagged if dropped timeouts were logged"). Held-out success (eval/accuracy, every 8 steps,
64 tasks × 2 samples) leaves infra failures out in every run and scores timeouts as failures
even where training drops them (actors/multiturn.py evaluate_episodes_detail; before
2026-12-04 it dropped them under timeouts="drop"), so the audit can tell a shortening that
only dodges faults from a gain.
One PNG per case (naive vs default over RL steps). Ends with one RESULT line.

    python benchmarks/fidelity.py --out fidelity.json [--workdir DIR] [--base DIR] [--steps 32]
                                  [--smoke]

`--smoke` (CI): both cases at the smallest size that runs every part (2 base SFT steps of 2
sequences, 2 case SFT steps, 2 GRPO steps of 2 prompts × 2 episodes, 2 held-out tasks), so the
code path cannot rot unseen; its figures mean nothing.

Measured on the 2-core dev box, 2026-12-04, one invocation (`--out fidelity.json --workdir W`,
W/base made first by the same base_config: 6.8 min), 57 min for the rest: infra SFT 8.1 min,
its runs 15.2 / 14.7; timeout SFT 2.9, its runs 7.8 / 8.5. Output and plots:
benchmarks/results/fidelity/. RESULT naive_len_change=0.479 default_len_change=0.788
naive_timeout_change=3.836 default_timeout_change=0.698 flagged_naive=2 flagged_default=0
  infra (response_len/mean, first → last quarter; tool calls/episode; reward; held-out):
    naive    137.6 → 65.9 tokens (×0.479), 4.41 → 1.93 calls, reward 0.637 → 0.883; flagged
             length_collapse: held-out 0.958 → 0.983 (+0.025), under half of the reward's +0.246
    default  146.7 → 115.7 tokens (×0.788), 4.74 → 3.64 calls, reward 0.990 → 0.972, held-out
             0.942 → 0.952, no flag. It shortens too, on the policy's own errors: of the scored
             episodes, the long path failed 7 of 197 (4 timeouts, 3 truncated: garbled calls,
             '{"name": "arguments": "arguments": ...', that ran out of turns or tokens), the short
             one 0 of 134; faults took 132 long-path and 47 first-call episodes out of the loss.
             Under naive, 44 of 111 long-path episodes scored 0 (faults), and 44 first calls.
             The in-run held-out eval read 0.93-0.96 all run (the same evaluation once read
             0.25-0.34 here: the seconds budget charged a batch's time to each episode, fixed
             2026-12-04 in actors/multiturn.py).
  timeout (fidelity/timeout_frac/hard):
    naive    0.107 → 0.412 (×3.84), flagged filter_growing (dropped_timeout 0.11 → 0.41); with
             the dropped ones logged as timeouts: timeout_rising as well; held-out 0.012 → 0.426
    default  0.104 → 0.072 (×0.70), no flag; held-out 0.012 → 0.656 (timeouts scored as
             failures in both evals)
  Why the two timeout runs part only after ~10 steps: a failing path is pushed down in
  proportion to how often it is sampled, so the rare think gains at first under "score" too;
  then "score" drives it down and "drop" holds it up. Why infra samples at 0.7: at 1.0 the SFT
  model broke 23% of its calls (stray </tool_call>, "checit") and 25% of episodes timed out, so
  the long path lost under either scoring (naive ×0.690 / default ×0.659 in an earlier pair).
  Earlier (2026-12-01, separate invocations, check() starting a sandbox process per call, which
  made the infra runs 33 and 68 min): infra naive ×0.652 flagged / default ×0.953; timeout
  naive ×5.00 flagged / default ×0.67 (resumed from step-24 checkpoints).
How the design got here (each failed run taught one constraint):
  A/B  1-digit arithmetic from scratch (2- and 4-layer models): the tiny model never learned
       to copy operands into a call, so the tool path was no more accurate than guessing, and
       accuracy gaps, not the scoring, decided which path won. C/D: other layouts, same.
  E    tool_math's layout (where copying forms) with tool / direct / direct / think-by-tool-
       calls demonstrations: timeouts fell under both scorings (0.18 → 0.11 drop, → 0.01
       score): a stall that shares its first tokens with the tool call is pushed down by every
       tool success. Hence a stall that differs from the first token, and a rare tool path.
  F    tool 1/32, think 8/32, lr 3e-4, 24 steps: drop held timeouts at 0.14-0.30 vs 0.03 under
       score, but the tool took over by step 10 and the naive share fell back (×0.71).
  G    tool 1/64, think 10/64, lr 1.5e-4: the numbers above. After 24 steps it read ×6.03 vs
       ×1.94 (the default still on its way down); both runs were then resumed from their
       step-24 checkpoints to 32 steps (constant GRPO lr, exact resume), the default since.
  infra, each stopped after a few steps: long path = print(v) reruns (v
  copied wrong: held-out 0.44); check × 3 then "The answer is v." (0.33 vs 0.66 correct:
  v copied wrong after the checks); check × 3 then submit, 1:1 demonstrations (the SFT model
  took the long path 27% of the time: 91 → 71 tokens, a floor of 0.75× that no flag can reach);
  check × 5, lr 3e-4 (139 → 75 tokens within 4 steps, inside the first quarter the change is
  measured from).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib.util
import json
import math
import pathlib
import shutil
import time

import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks._meta import run_info, write_result  # noqa: E402
from posttrain_jax.audit import audit, change_ratio, summarize
from posttrain_jax.metrics import read_metrics
from posttrain_jax.run import Trainer
from posttrain_jax.run_config import run_config_from_dict
from posttrain_jax.types import Status

TASKS = {"min_digits": 4, "max_digits": 4, "ops": "*"}  # configs/tool_math.py's products
CASES = {  # case -> environment, its config, budgets, naive / default settings, measured key
    "infra": {"env": "tool_math_fidelity_infra", "env_config": {"infra_fault_rate": 0.1},
              "tasks": TASKS, "turn_max_tokens": 48, "seq_len": 800, "lr": 6e-5,
              # at 1.0 the SFT model broke 23% of its calls (stray tags, "checit"), mostly the
              # long path's, and 25% of episodes ran out of budget; at 0.7: 0% and 0% (measured
              # over 2 GRPO steps of 64 episodes), so the long path is as correct as designed
              "temperature": 0.7,
              "budgets": {"max_turns": 7, "max_tokens": 280, "max_tool_calls": 7},
              "naive": {"infra_scoring": "zero"}, "default": {"infra_scoring": "exclude"},
              "key": "response_len/mean"},
    # every task labelled hard (4-digit operands: hard_digits=4) for the per-difficulty keys;
    # a turn may run past the episode's token budget (72 > 64): a long think is a timeout
    "timeout": {"env": "tool_math_fidelity_timeout", "env_config": {},
                "tasks": {**TASKS, "hard_fraction": 1.0, "hard_digits": 4},
                "turn_max_tokens": 72, "seq_len": 448, "lr": 1.5e-4, "temperature": 1.0,
                "budgets": {"max_turns": 3, "max_tokens": 64, "max_tool_calls": 2},
                "naive": {"timeouts": "drop"}, "default": {"timeouts": "score"},
                "key": "fidelity/timeout_frac/hard"},
}


SMOKE = {"prompts_per_step": 2, "group_size": 2, "rows": 4, "sft_batch": 2, "eval_size": 2}


def base_config(workdir: pathlib.Path, sft_steps: int, smoke: bool = False):
  """configs/tool_math.py's SFT, stopped after it: the warm start every case starts from."""
  spec = importlib.util.spec_from_file_location(
      "tool_math_config", pathlib.Path(__file__).parent.parent / "configs" / "tool_math.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  c = mod.get_config()
  c.workdir, c.sft.steps, c.stop_after_step = str(workdir), sft_steps, sft_steps
  c.sft.learner.optimizer.decay_steps = sft_steps
  if smoke:
    c.sft.batch_size = SMOKE["sft_batch"]
    c.sft.batch.update(rows=SMOKE["sft_batch"], max_seqs=SMOKE["sft_batch"])
    c.sft.learner.optimizer.warmup_steps = 0
    c.tasks.eval_size = SMOKE["eval_size"]
  return run_config_from_dict(c.to_dict())


def run_config(workdir: pathlib.Path, base: pathlib.Path, case: str, naive: bool, steps: int,
               sft_steps: int, lr: float, smoke: bool = False):
  """SFT on the case's demonstrations from the base model, then GRPO over its episodes."""
  c = CASES[case]
  seq = c["seq_len"]  # tokens per training row: the prompt (~180) and the longest path
  d = {
      "workdir": str(workdir), "seed": 0,
      "model": {"path": str(base / "sft_model")},
      "tasks": {"source": "synthetic", "generator": "tool_math", "seed": 0,
                "eval_fraction": 0.05, "eval_size": 64, "generator_config": c["tasks"]},
      "sft": {"steps": sft_steps, "batch_size": 16,
              "batch": {"rows": 16, "seq_len": seq, "max_seqs": 16, "pack": False},
              "learner": {"loss": "sft", "optimizer": {"learning_rate": 1e-3, "warmup_steps": 20,
                                                       "decay_steps": sft_steps,
                                                       "end_lr_ratio": 0.3}}},
      "rl": {"steps": steps, "prompts_per_step": 8, "episode": "env",
             "episode_config": {"env": c["env"], "env_config": c["env_config"],
                                "tool_format": "hermes", "turn_max_tokens": c["turn_max_tokens"],
                                "max_context_tokens": seq, "budgets": c["budgets"],
                                **c["naive" if naive else "default"]},
             "rollout": {"group_size": 8, "temperature": c["temperature"]},
             "learner": {"loss": "grpo", "optimizer": {"learning_rate": lr or c["lr"],
                                                       "warmup_steps": 2}},
             "loss": {"eps_low": 0.2, "eps_high": 0.28, "aggregation": "token_mean"},
             "batch": {"rows": 80, "seq_len": seq, "max_seqs": 80, "pack": False}},
      "eval": {"every_steps": 8, "samples_per_prompt": 2, "temperature": c["temperature"],
               "greedy": False},
      "checkpoint": {"every_steps": 1000, "max_to_keep": 1},
  }
  if smoke:
    rl, sft = d["rl"], d["sft"]
    rl.update(prompts_per_step=SMOKE["prompts_per_step"])
    rl["rollout"]["group_size"] = SMOKE["group_size"]
    rl["batch"].update(rows=SMOKE["rows"], max_seqs=SMOKE["rows"])
    sft.update(batch_size=SMOKE["sft_batch"])
    sft["batch"].update(rows=SMOKE["sft_batch"], max_seqs=SMOKE["sft_batch"])
    sft["learner"]["optimizer"]["warmup_steps"] = 0
    d["tasks"]["eval_size"] = SMOKE["eval_size"]
    d["eval"].update(every_steps=1, samples_per_prompt=1)
  return run_config_from_dict(d)


class _CountDropped:
  """A rollout source that also reports the timeouts the episode dropped (see module doc)."""

  def __init__(self, source, dump: pathlib.Path):
    self._source, self._extra, self._dump = source, {}, dump

  def __getattr__(self, name):
    return getattr(self._source, name)

  def collect(self, step: int):
    tasks, trajs = self._source.collect(step)
    with self._dump.open("a") as f:  # two episodes per group, to read what the policy does
      for t in trajs:
        if t.messages and t.id.rsplit("/", 1)[-1] in ("0", "1"):
          f.write(json.dumps({"step": step, "status": t.status.value, "reward": t.reward,
                              "messages": t.messages}, default=str) + "\n")
    g = self._source.group_size
    kept = collections.Counter(t.task_id for t in trajs if t.metrics.get("sample_index", 0) == 0)
    timeouts = collections.Counter(t.task_id for t in trajs if t.status is Status.TIMEOUT
                                   and t.metrics.get("sample_index", 0) == 0)
    runs, out = collections.Counter(t.id for t in tasks), collections.defaultdict(lambda: [0, 0])
    for task in {t.id: t for t in tasks}.values():
      n = g * runs[task.id]
      dropped = max(0, n - kept[task.id])
      for level in {"all", str(task.metadata.get("difficulty", "all"))}:
        out[level][0] += timeouts[task.id] + dropped
        out[level][1] += n
      out["dropped"][0] += dropped
      out["dropped"][1] += n
    self._extra = {"fidelity/timeout_frac": out["all"][0] / out["all"][1],
                   "fidelity/dropped_frac": out["dropped"][0] / out["dropped"][1]}
    self._extra.update({f"fidelity/timeout_frac/{d}": a / n for d, (a, n) in out.items()
                        if d not in ("all", "dropped")})
    return tasks, trajs

  def metrics(self):
    return {**self._source.metrics(), **self._extra}


def _Trainer(cfg, log):
  """A Trainer whose rollout source is wrapped in _CountDropped (the public hook)."""
  dump = pathlib.Path(cfg.workdir) / "episodes.jsonl"
  return Trainer(cfg, log=log, wrap_source=lambda source: _CountDropped(source, dump))


def rl_rows(workdir: pathlib.Path) -> list[dict]:
  """The GRPO steps' rows and the held-out evals (the first at the SFT → GRPO boundary)."""
  return [r for r in read_metrics(workdir / "metrics.jsonl")
          if "reward/mean" in r or "eval/accuracy" in r]


def change(rows: list[dict], key: str) -> tuple[float, float, float]:
  """(first-quarter mean, last-quarter mean, last ÷ first) of `key` over the rows."""
  pts = [(r["step"], float(r[key])) for r in rows if key in r and math.isfinite(r[key])]
  if len(pts) < 2:
    return math.nan, math.nan, math.nan
  s = summarize(key, pts, 0.25)
  return s.first, s.last, change_ratio(s.first, s.last)


def with_dropped_timeouts(rows: list[dict]) -> list[dict]:
  """Rows whose status/timeout_frac* also count the dropped timeouts (as if they were logged)."""
  out = []
  for r in rows:
    r = dict(r)
    for k in [k for k in r if k.startswith("fidelity/timeout_frac")]:
      r["status/" + k[len("fidelity/"):]] = r[k]
    out.append(r)
  return out


def plot(case: str, runs: dict[str, list[dict]], keys: list[str], png: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.8 * len(keys)), sharex=True, squeeze=False)
  for ax, key in zip(axes[:, 0], keys):
    for name, rows in runs.items():
      pts = [(r["step"], r[key]) for r in rows if key in r]
      if pts:
        ax.plot(*zip(*pts), "-o", markersize=3, label=name)
    ax.set_ylabel(key, fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  axes[0, 0].set_title(f"fidelity case {case!r}: naive vs default")
  axes[-1, 0].set_xlabel("step (SFT steps + RL step)")
  fig.tight_layout()
  fig.savefig(png, dpi=100)
  plt.close(fig)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", required=True, help="the JSON summary")
  p.add_argument("--workdir", default="runs/fidelity", help="runs go in WORKDIR/<case>_<mode>")
  p.add_argument("--steps", type=int, default=32, help="GRPO steps per run (audit needs ≥ 16)")
  p.add_argument("--base_sft_steps", type=int, default=700,
                 help="SFT steps of the base model (configs/tool_math.py's)")
  p.add_argument("--sft_steps", type=int, default=200, help="SFT steps per case, from the base")
  p.add_argument("--base", default="", help="a workdir holding a finished base SFT (sft_model/) "
                 "to start from, instead of training one in WORKDIR/base")
  p.add_argument("--lr", type=float, default=None, help="GRPO learning rate (default: the case's)")
  p.add_argument("--cases", default="infra,timeout", help="comma-separated subset of cases")
  p.add_argument("--smoke", action="store_true",
                 help="every part at the smallest size (seconds per run; CI): see the docstring")
  p.add_argument("--reuse", action="store_true",
                 help="read runs that already finished in WORKDIR (result.json) and start new ones "
                 "from WORKDIR/<case>_sft if it holds an SFT model, instead of rerunning them")
  args = p.parse_args()
  if args.smoke:
    args.base_sft_steps, args.sft_steps, args.steps = 2, 2, 2
  record = run_info(smoke=args.smoke)

  root = pathlib.Path(args.workdir)
  summary = {"args": vars(args), "runs": {}, "plots": {}}
  table = []
  flagged = {"naive": 0, "default": 0}
  flagged_visible = {"naive": 0, "default": 0}
  base = pathlib.Path(args.base) if args.base else root / "base"
  if not (base / "sft_model").is_dir():  # the warm start: tool_math's SFT (it copies digits)
    t0 = time.perf_counter()
    _Trainer(base_config(base, args.base_sft_steps, args.smoke), log=lambda *_: None).run()
    summary["runs"]["base_sft"] = {"minutes": (time.perf_counter() - t0) / 60}
  for case in args.cases.split(","):
    key = CASES[case]["key"]
    runs = {}
    # SFT once per case (stopped at its boundary checkpoint); both runs resume from a copy, so
    # the pair starts GRPO from the same weights and draws the same tasks
    sft_wd = root / f"{case}_sft"
    done = {m: args.reuse and (root / f"{case}_{m}" / "result.json").exists()
            for m in ("naive", "default")}
    if not all(done.values()) and not (args.reuse and (sft_wd / "sft_model").is_dir()):
      if sft_wd.exists():
        shutil.rmtree(sft_wd)
      t0 = time.perf_counter()
      sft_cfg = dataclasses.replace(run_config(sft_wd, base, case, True, args.steps,
                                               args.sft_steps, args.lr, args.smoke),
                                    stop_after_step=args.sft_steps)
      _Trainer(sft_cfg, log=lambda *_: None).run()
      summary["runs"][f"{case}_sft"] = {"minutes": (time.perf_counter() - t0) / 60}
    for mode in ("naive", "default"):
      wd = root / f"{case}_{mode}"
      if done[mode]:
        result = json.loads((wd / "result.json").read_text())
      else:
        if wd.exists():
          shutil.rmtree(wd)
        shutil.copytree(sft_wd, wd)
        t0 = time.perf_counter()
        result = _Trainer(run_config(wd, base, case, mode == "naive", args.steps, args.sft_steps,
                                     args.lr, args.smoke), log=lambda *_: None).run()
        result["rl_minutes"] = (time.perf_counter() - t0) / 60  # GRPO (and its evals) only
        (wd / "result.json").write_text(json.dumps(result, indent=1))
      minutes = result["rl_minutes"]
      rows = runs[mode] = rl_rows(wd)
      all_rows = read_metrics(wd / "metrics.jsonl")
      rep, rep_visible = audit(all_rows), audit(with_dropped_timeouts(all_rows))
      flagged[mode] += bool(rep.flags)
      flagged_visible[mode] += bool(rep_visible.flags)
      first, last, ratio = change(rows, key)
      info = {"minutes": minutes, "metric": key, "first": first, "last": last, "change": ratio,
              "flags": [f.message for f in rep.flags],
              "flags_if_dropped_logged": [f.message for f in rep_visible.flags],
              "notes": list(rep.notes), "result": result}
      for k in ("response_len/mean", "episode/tool_calls", "reward/mean",
                "fidelity/timeout_frac/hard", "status/timeout_frac/hard", "fidelity/dropped_frac",
                "filter/dropped_timeout_frac", "filter/infra_error_frac", "eval/accuracy"):
        info[k] = dict(zip(("first", "last", "change"), change(rows, k)))
      summary["runs"][f"{case}_{mode}"] = info
      table.append((case, mode, key, first, last, ratio, info["reward/mean"]["first"],
                    info["reward/mean"]["last"], ",".join(f.name for f in rep.flags) or "-",
                    ",".join(f.name for f in rep_visible.flags) or "-", minutes))
    png = root / f"fidelity_{case}.png"
    keys = ([key, "episode/tool_calls", "reward/mean", "eval/accuracy"] if case == "infra" else
            [key, "filter/dropped_timeout_frac", "reward/mean", "eval/accuracy"])
    plot(case, runs, keys, png)
    summary["plots"][case] = str(png)

  hdr = ("case", "mode", "metric", "first", "last", "change", "reward0", "reward1", "flags",
         "flags(dropped logged)", "min")
  print(" | ".join(hdr))
  for row in table:
    print(" | ".join(f"{x:.3f}" if isinstance(x, float) else str(x) for x in row))
  r = summary["runs"]
  get = lambda name: r.get(name, {}).get("change", math.nan)  # noqa: E731
  summary["flagged"] = {"naive": flagged["naive"], "default": flagged["default"],
                        "naive_if_dropped_logged": flagged_visible["naive"],
                        "default_if_dropped_logged": flagged_visible["default"]}
  write_result(args.out, record, summary)
  print(f"flagged if dropped timeouts were logged: naive={flagged_visible['naive']} "
        f"default={flagged_visible['default']}")
  print(f"RESULT naive_len_change={get('infra_naive'):.3f} "
        f"default_len_change={get('infra_default'):.3f} "
        f"naive_timeout_change={get('timeout_naive'):.3f} "
        f"default_timeout_change={get('timeout_default'):.3f} "
        f"flagged_naive={flagged['naive']} flagged_default={flagged['default']}")


if __name__ == "__main__":
  main()
