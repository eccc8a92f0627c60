"""Fidelity: the field's two multi-turn failure cases reproduced on a tiny model on CPU, each as a
pair of runs (naive scoring vs our default), and whether the audit (posttrain_jax/audit.py)
flags them.

Both cases run SFT on the `tool_math_fidelity` demonstrations (envs/fidelity_envs.py: several
paths per task) and then GRPO over whole episodes with the embedded JAX sampler:

  case 1, infra faults: 1-digit additions, answerable with or without the python tool; 10% of
    tool calls fail on our side (ToolMathConfig.infra_fault_rate = 0.1, an EnvInfraError).
    naive   infra_scoring="zero": a failed call scores the episode 0, so the tool path earns
            less than answering directly and GRPO shifts the policy away from the tool;
    default infra_scoring="exclude": such episodes leave the loss and the baselines.
    Measured: response_len/mean (sampled tokens per episode; the tool path is ~3× longer),
    plus episode/tool_calls.
  case 2, timeouts: half the tasks are "hard" (2-digit products; mostly answered wrong), and
    a quarter of their demonstrations stall (call the tool until the turn budget ends it).
    naive   timeouts="drop": a timed-out episode leaves the group; within a hard group the
            failures get negative advantage, the (dropped) timeouts none, so the timeout share
            grows (d log p_timeout ∝ p_s·p_f·(p_f − p_s) > 0 while failures outnumber successes);
    default timeouts="score": a timeout is a failure (reward 0) and is pushed down with them.
    Measured: the share of hard-task episodes that timed out. The trainer's own
    status/timeout_frac/hard only sees the episodes it kept, so under "drop" it reads 0; the
    benchmark wraps the rollout source to count the dropped ones too (a group of G episodes
    per task: dropped = G − kept) and logs fidelity/timeout_frac[/<difficulty>] and
    fidelity/dropped_frac beside the trainer's keys.

change = mean of the last quarter of the RL steps ÷ mean of the first quarter (audit.py's
convention). The audit runs on each run's metrics.jsonl rows as the trainer wrote them
("flagged"), and once more on rows whose status/timeout_frac* count the dropped timeouts
("flagged if dropped timeouts were logged"): the difference is what dropping hides from it.
One PNG per case (naive vs default over RL steps). Ends with one RESULT line.

    python benchmarks/fidelity.py --out fidelity.json [--workdir DIR] [--steps 20] [--reuse]

Measured on the 2-core dev box, 2026-12-01 (P=8 × G=8, 20 GRPO steps per run). Neither
signature has appeared yet; the warm start is the blocker, not the scoring.
  run A: 2-layer model, 200 SFT steps at batch 32, GRPO lr 1e-4
    infra    len change naive 0.825, default 0.876; timeout share change 0.884 vs 0.869; no flag.
    (lr 1e-3: all four runs collapsed alike to short direct answers, each flagged
    length_collapse: Adam-normalised noise, not the scoring.)
  run B (the defaults now): 4-layer model (configs/tool_math.py's), 600 SFT steps at batch 16,
  GRPO lr 3e-4:
    RESULT naive_len_change=1.177 default_len_change=1.195 naive_timeout_change=0.709
           default_timeout_change=0.772 flagged_naive=0 flagged_default=0
    infra: both runs moved TO the tool (tool calls/episode 0.69 → 0.92 naive, 0.69 → 0.94
    default) because the tool path was the more accurate one (0.68 vs 0.55 correct on
    1-digit additions at the start): a 13-point accuracy gap outweighs the 10% fault cost that
    naive scoring adds. timeout: reward 0.02 → 0.06: the warm start does not copy operands
    (`Compute 4*4.` → `print(3*7)`), hard groups are all-zero, no gradient reaches the stall.
  run C: timeout case with both difficulties at one operand width (2-digit sums easy,
  2-digit products hard: `ToolMathTasks.hard_ops`), 700 SFT steps: still no copying
  (`Compute 25+93.` → `print(28+84)`: the model writes operands that roughly sum right), reward
  0.00-0.02 for 17 steps; stopped.
What differs from configs/tool_math.py, where SFT does learn to copy (loss 0.69 → 0.04 at step
~350, held-out 0.64 → 0.82 after GRPO): there the answer cannot be computed in the head, so
copying is the only way to lower the loss; here half the demonstrations answer directly from
the operands, which rewards computing over copying, and the copy circuit never forms.
  run D: run C warm-started from the tool_math SFT model (which copies 4-digit operands), 300
  SFT steps at lr 1e-3: no copying either (`Compute 50+39.` → `print(17+31)`). What the tiny model
  learns is a copy at a fixed distance, which does not carry over to another prompt layout.
  run E: timeout case in tool_math's layout (every task a 4-digit × 4-digit product, labelled
  hard; demonstrations tool / direct / direct / stall), warm start from the tool_math SFT
  model, 200 SFT steps at lr 1e-3: copying works (held-out 0.26 → 0.87 by step 8).
    naive_timeout_change=0.586 (0.181 → 0.106), default_timeout_change=0.075 (0.166 → 0.013)
  From step 8 on, "drop" keeps 5-17% of hard episodes timing out while "score" drives them to
  0-3%: dropped timeouts escape the push-down. They do not rise, though: successes outnumber
  failures after ~4 steps, and then d log p_timeout ∝ p_s·p_f·(p_f − p_s) < 0. The signature
  needs hard tasks that stay mostly failed. No audit flag in either run.
Next: tool_math's exact layout (4-digit × 4-digit products, where copying forms), with cases
whose paths differ only in what is measured. Case 2: as run E with a rarer success (p_f > p_s
throughout). Case 1: tool paths only, 1 call vs 3 calls at
equal accuracy, so naive scoring exposes the longer path to 27% faults instead of 10%, and an
all-short policy ends near 0.63× the start length (the audit flags below 0.7).
The trainer now logs filter/dropped_timeout_frac under timeouts="drop", so the audit sees
dropped timeouts through filter_growing; the benchmark's own count
(fidelity/timeout_frac/<difficulty>) also splits them by difficulty.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import pathlib
import shutil
import time

from posttrain_jax.audit import audit, change_ratio, summarize
from posttrain_jax.metrics import read_metrics
from posttrain_jax.trainer import Trainer, run_config_from_dict
from posttrain_jax.types import Status

MODEL = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 384, "num_layers": 4,
         "num_heads": 4, "num_kv_heads": 2, "head_dim": 32, "chat_format": "hermes",
         "seed": 0}  # configs/tool_math.py's model: it learns to copy digits (module doc)
CASES = {  # case -> (task generator config, naive / default episode settings, measured key)
    "infra": ({"min_digits": 1, "max_digits": 1, "ops": "+"},
              {"infra_scoring": "zero"}, {"infra_scoring": "exclude"}, "response_len/mean"),
    "timeout": ({"min_digits": 1, "max_digits": 1, "ops": "*", "hard_fraction": 0.5,
                 "hard_digits": 2},
                {"timeouts": "drop"}, {"timeouts": "score"}, "fidelity/timeout_frac/hard"),
}


def run_config(workdir: pathlib.Path, case: str, naive: bool, steps: int, sft_steps: int,
               lr: float):
  gen, bad, good, _ = CASES[case]
  env_config = {"infra_fault_rate": 0.1} if case == "infra" else {}
  return run_config_from_dict({
      "workdir": str(workdir), "seed": 0,
      "model": {"tiny": MODEL},
      "tasks": {"source": "synthetic", "generator": "tool_math", "seed": 0,
                "eval_fraction": 0.05, "eval_size": 16, "generator_config": gen},
      "sft": {"steps": sft_steps, "batch_size": 16,
              "batch": {"rows": 16, "seq_len": 352, "max_seqs": 16, "pack": False},
              "learner": {"loss": "sft", "optimizer": {"learning_rate": 3e-3, "warmup_steps": 20,
                                                       "decay_steps": sft_steps,
                                                       "end_lr_ratio": 0.3}}},
      "rl": {"steps": steps, "prompts_per_step": 8, "episode": "env",
             "episode_config": {"env": "tool_math_fidelity", "env_config": env_config,
                                "tool_format": "hermes", "turn_max_tokens": 40,
                                "max_context_tokens": 352,
                                "budgets": {"max_turns": 3, "max_tokens": 120,
                                            "max_tool_calls": 3},
                                **(bad if naive else good)},
             "rollout": {"group_size": 8, "temperature": 1.0},
             "learner": {"loss": "grpo", "optimizer": {"learning_rate": lr, "warmup_steps": 2}},
             "loss": {"eps_low": 0.2, "eps_high": 0.28, "aggregation": "token_mean"},
             "batch": {"rows": 80, "seq_len": 352, "max_seqs": 80, "pack": False}},
      "eval": {"every_steps": 8, "samples_per_prompt": 2, "temperature": 1.0, "greedy": False},
      "checkpoint": {"every_steps": 1000, "max_to_keep": 1},
  })


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


class _Trainer(Trainer):
  def _rollout_source(self, learner, engine, base):
    return _CountDropped(super()._rollout_source(learner, engine, base),
                         self.workdir / "episodes.jsonl")


def rl_rows(workdir: pathlib.Path) -> list[dict]:
  return [r for r in read_metrics(workdir / "metrics.jsonl") if "reward/mean" in r]


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
  p.add_argument("--steps", type=int, default=20, help="GRPO steps per run (audit needs ≥ 16)")
  p.add_argument("--sft_steps", type=int, default=600, help="SFT steps per run")
  p.add_argument("--lr", type=float, default=3e-4, help="GRPO learning rate (1e-3: see doc)")
  p.add_argument("--cases", default="infra,timeout", help="comma-separated subset of cases")
  p.add_argument("--reuse", action="store_true",
                 help="read runs that already finished in WORKDIR (result.json) and start new ones "
                 "from WORKDIR/<case>_sft if it holds an SFT model, instead of rerunning them")
  args = p.parse_args()

  root = pathlib.Path(args.workdir)
  summary = {"args": vars(args), "runs": {}, "plots": {}}
  table = []
  flagged = {"naive": 0, "default": 0}
  flagged_visible = {"naive": 0, "default": 0}
  for case in args.cases.split(","):
    key = CASES[case][3]
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
      sft_cfg = dataclasses.replace(run_config(sft_wd, case, True, args.steps, args.sft_steps,
                                               args.lr), stop_after_step=args.sft_steps)
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
        result = _Trainer(run_config(wd, case, mode == "naive", args.steps, args.sft_steps,
                                     args.lr), log=lambda *_: None).run()
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
                "filter/infra_error_frac"):
        info[k] = dict(zip(("first", "last", "change"), change(rows, k)))
      summary["runs"][f"{case}_{mode}"] = info
      table.append((case, mode, key, first, last, ratio, info["reward/mean"]["first"],
                    info["reward/mean"]["last"], ",".join(f.name for f in rep.flags) or "-",
                    ",".join(f.name for f in rep_visible.flags) or "-", minutes))
    png = root / f"fidelity_{case}.png"
    keys = ([key, "episode/tool_calls", "reward/mean"] if case == "infra" else
            [key, "status/timeout_frac/hard", "reward/mean"])
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
  pathlib.Path(args.out).write_text(json.dumps(summary, indent=1, default=str))
  print(f"flagged if dropped timeouts were logged: naive={flagged_visible['naive']} "
        f"default={flagged_visible['default']}")
  print(f"RESULT naive_len_change={get('infra_naive'):.3f} "
        f"default_len_change={get('infra_default'):.3f} "
        f"naive_timeout_change={get('timeout_naive'):.3f} "
        f"default_timeout_change={get('timeout_default'):.3f} "
        f"flagged_naive={flagged['naive']} flagged_default={flagged['default']}")


if __name__ == "__main__":
  main()
