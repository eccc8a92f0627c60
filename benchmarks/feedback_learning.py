"""Learning from free-text feedback on single trajectories: self-distillation vs policy gradient.

The task (tasks/hidden_rule.py): a word, and a rule that maps it to the answer. A warm-start SFT
teaches the tiny model every rule when the prompt states it ("rule: reverse | abc" -> "cba")
and the prior "a prompt without a rule means copy". The RL phase then sees only prompts without
a rule, whose real rule is hidden (reverse): the grader scores exact match and its free-text
feedback names the rule ("rule: reverse"); no prompt ever shows it. From the same warm start,
with one trajectory per prompt (group size 1) and the same prompts, steps, learning rate:

  sd   loss full_distill with SDPO's defaults: the teacher is the model itself (an EMA of its
       weights, rate 0.05, from the warm start) with the feedback in its context (teacher.py, template "{context} | {prompt}"),
       scoring the student's own response; JSD_0.5 between the student's and the teacher's
       next-token distributions over the student's top-100 ids + a tail bucket, at every
       response position (losses/full_distill.py)
  pg   loss grpo with the `running` per-task baseline on the 0/1 grade (no group): the
       feedback text is unused, only the number
  sd_sampled (optional, --methods): loss sampled_distill, the sampled-token form: per-token
       advantage log T(y_t) − log π_θ(y_t) in a policy gradient (losses/distill.py)

Reported: held-out accuracy (unseen words, the hidden rule; sampled at temperature 1 and
greedy) before and after, curves for both (plot), and forgetting: KL(π‖π_start) on unrelated
prompts (stated rules), estimated on π's own samples as the mean over prompts of
Σ_t log π(y_t) − log π_start(y_t) (k1, unbiased) and the per-token k3 mean.

    python benchmarks/feedback_learning.py --out runs/feedback.json [--workdir DIR] [--smoke]
ends with `RESULT sd_before=… sd_after=… pg_before=… pg_after=…` (greedy held-out accuracy).
`--smoke`: 2 SFT steps, then 2 RL steps of 4 prompts per method (held-out evals before and
after), 16 held-out tasks and 8 KL prompts, in a fresh temporary --workdir unless one is given
(seconds, for CI).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import shutil
import sys
import tempfile
import time

import numpy as np

from posttrain_jax import batching
from posttrain_jax.actors.rollout import encode_prompt
from posttrain_jax.engines.base import SamplingParams
from posttrain_jax.engines.registry import EngineContext, engine_spec
from posttrain_jax.tasks import distinct_tasks
from posttrain_jax.tasks.hidden_rule import StringRuleConfig
from posttrain_jax.learner import Learner, LearnerConfig
from posttrain_jax.metrics import read_metrics
from posttrain_jax.models import hf_io
from posttrain_jax.run import Trainer
from posttrain_jax.run_config import run_config_from_dict

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

from benchmarks._meta import run_info, write_result  # noqa: E402

TINY = dict(family="qwen3", vocab_size=512, hidden_size=128, intermediate_size=384,
            num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, seed=0)
GEN = dict(letters="abcdefgh", min_len=3, max_len=5, hidden_rule="reverse", default_rule="copy")


def sft_config(workdir: pathlib.Path, steps: int) -> dict:
  """The warm start: SFT on prompts of which 75 % state their rule, stopped after it."""
  return {
      "workdir": str(workdir), "seed": 0, "model": {"tiny": TINY}, "grader": "hidden_rule",
      "stop_after_step": steps,
      "tasks": {"source": "synthetic", "generator": "string_rule", "seed": 0,
                "eval_fraction": 0.1, "eval_size": 128,
                "generator_config": {**GEN, "stated_frac": 0.75}},
      "sft": {"steps": steps, "batch_size": 64,
              "batch": {"rows": 64, "seq_len": 40, "max_seqs": 64, "pack": False},
              "learner": {"loss": "sft", "optimizer": {"learning_rate": 3e-3, "warmup_steps": 20,
                                                       "decay_steps": steps,
                                                       "end_lr_ratio": 0.1}}},
      "rl": {"steps": 1},
      "checkpoint": {"every_steps": 0, "max_to_keep": 1},
  }


LOSSES = {  # method -> the RL phase's loss and its config
    "sd": {"loss": "full_distill", "cfg": {"divergence": "jsd", "beta": 0.5, "topk": 100}},
    "sd_sampled": {"loss": "sampled_distill", "cfg": {"coef": 1.0, "rl_coef": 0.0, "is_clip": 2.0}},
    "pg": {"loss": "grpo", "cfg": {"eps_low": 0.2, "eps_high": 0.28, "aggregation": "token_mean"}},
}


def rl_config(workdir: pathlib.Path, start: pathlib.Path, method: str, steps: int, lr: float,
              prompts: int, eval_every: int, teacher: str = "ema") -> dict:
  """One RL run from the warm start on prompts without a rule: `sd` or `pg` (module doc)."""
  loss = LOSSES[method]
  return {
      "workdir": str(workdir), "seed": 0, "model": {"path": str(start)}, "grader": "hidden_rule",
      "tasks": {"source": "synthetic", "generator": "string_rule", "seed": 1,
                "eval_fraction": 0.1, "eval_size": 128,
                "generator_config": {**GEN, "stated_frac": 0.0}},
      "rl": {"steps": steps, "prompts_per_step": prompts,
             "rollout": {"group_size": 1, "max_tokens": 8, "temperature": 1.0},
             "advantage": {"estimator": "running"},
             "learner": {"loss": loss["loss"], "optimizer": {"learning_rate": lr,
                                                             "warmup_steps": 2}},
             "loss": loss["cfg"],
             "teacher": {"context": "feedback", "template": "{context} | {prompt}",
                         "feedback_template": "{text}", "seq_len": 48, "weights": teacher,
                         "ema_rate": 0.05},
             "batch": {"rows": prompts, "seq_len": 32, "max_seqs": prompts, "pack": False}},
      "eval": {"every_steps": eval_every, "samples_per_prompt": 2, "temperature": 1.0,
               "greedy": True, "max_tokens": 8},
      "checkpoint": {"every_steps": 0, "max_to_keep": 1},
  }


def kl_to_start(final: pathlib.Path, start: pathlib.Path, n: int = 96) -> dict[str, float]:
  """KL(π‖π_start) on stated-rule prompts (unrelated to the hidden rule), on π's samples."""
  tok = hf_io.load_tokenizer(final)
  tasks = distinct_tasks("string_rule", StringRuleConfig(**GEN, stated_frac=1.0), n, seed=7,
                         partition="train", eval_fraction=0.1)
  model = hf_io.load_hf_model(final)
  learner = Learner(model, LearnerConfig(loss="sft"))
  start_params = Learner(hf_io.load_hf_model(start), LearnerConfig(loss="sft")).params
  prompts = [encode_prompt(tok, t) for t in tasks]
  mcfg = hf_io.read_model_config(final)
  spec = engine_spec("jax")
  engine = spec.build(spec.config_cls(), EngineContext(
      model_dir=final, model_config=mcfg, model=learner.model(), graphdef=learner.graphdef,
      max_prompt_len=max(len(p) for p in prompts), max_tokens=8, pad_id=tok.pad_token_id or 0))
  stop = (tok.eos_token_id,) if tok.eos_token_id is not None else ()
  groups = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=1.0,
                                                   stop_token_ids=stop), n=4, seed=99)
  trajs = [batching.sft_trajectory(p, c.token_ids, f"{i}/{j}")
           for i, (p, comps) in enumerate(zip(prompts, groups)) for j, c in enumerate(comps)
           if c.token_ids]
  cfg = batching.BatchConfig(rows=len(trajs), seq_len=40, max_seqs=len(trajs), pack=False)
  batch = batching.build_batch(trajs, [0.0] * len(trajs), cfg)
  lp, lp0 = np.asarray(learner.logprobs(batch)), np.asarray(learner.logprobs(batch, start_params))
  m, sid = np.asarray(batch.loss_mask), np.asarray(batch.seq_ids)
  x = (lp0 - lp) * m
  seq_k1 = np.bincount(sid.ravel(), weights=(-x).ravel(), minlength=len(trajs))[:len(trajs)]
  k3 = (np.expm1(x) - x) * m
  if hasattr(engine, "close"):
    engine.close()
  return {"kl_seq_k1": float(np.mean(seq_k1)), "kl_token_k3": float(k3.sum() / m.sum())}


def curve(workdir: pathlib.Path) -> list[dict]:
  return [r for r in read_metrics(workdir / "metrics.jsonl") if "eval/accuracy_greedy" in r]


def plot(runs: dict[str, list[dict]], png: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
  for ax, key in zip(axes, ("eval/accuracy_greedy", "eval/accuracy")):
    for name, rows in runs.items():
      ax.plot([r["step"] for r in rows], [r[key] for r in rows], marker="o", label=name)
    ax.set_title(f"held-out {key.split('/')[1]} (hidden rule)")
    ax.set_xlabel("step")
    ax.legend()
  fig.tight_layout()
  fig.savefig(png)
  plt.close(fig)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", required=True, help="results JSON")
  ap.add_argument("--workdir", default=None,
                  help="default: runs/feedback_learning; --smoke: a fresh temporary one")
  ap.add_argument("--sft_steps", type=int, default=800)
  ap.add_argument("--steps", type=int, default=40)
  ap.add_argument("--prompts", type=int, default=32, help="single trajectories per step")
  ap.add_argument("--lr", type=float, default=1e-3)
  ap.add_argument("--teacher", default="ema", choices=["ema", "student", "frozen"],
                  help="the self-teacher's weights (teacher.py)")
  ap.add_argument("--eval_every", type=int, default=5)
  ap.add_argument("--methods", default="sd,pg")
  ap.add_argument("--reuse", action="store_true", help="keep finished phases in --workdir")
  ap.add_argument("--smoke", action="store_true",
                  help="2 SFT steps, 2 RL steps of 4 prompts per method (seconds, for CI)")
  args = ap.parse_args()
  info = run_info(smoke=args.smoke)
  if args.smoke:
    args.sft_steps, args.steps, args.prompts, args.eval_every = 2, 2, 4, 2
  if args.workdir is None:
    args.workdir = (tempfile.mkdtemp(prefix="feedback_learning_smoke_") if args.smoke
                    else "runs/feedback_learning")

  def sized(cfg: dict) -> dict:   # --smoke: 16 held-out tasks
    if args.smoke:
      cfg["tasks"]["eval_size"] = 16
    return cfg
  root = pathlib.Path(args.workdir)
  sft_dir = root / "sft"
  t0 = time.time()
  if not (args.reuse and (sft_dir / "sft_model" / "config.json").exists()):
    shutil.rmtree(sft_dir, ignore_errors=True)
    Trainer(run_config_from_dict(sized(sft_config(sft_dir, args.sft_steps)))).run()
  start = sft_dir / "sft_model"
  results, runs = {}, {}
  for method in args.methods.split(","):
    wd = root / method
    if not (args.reuse and (wd / "final_model" / "config.json").exists()):
      shutil.rmtree(wd, ignore_errors=True)
      Trainer(run_config_from_dict(sized(rl_config(wd, start, method, args.steps, args.lr,
                                                   args.prompts, args.eval_every,
                                                   args.teacher)))).run()
    rows = curve(wd)
    runs[method] = rows
    results[method] = {"before": rows[0]["eval/accuracy_greedy"],
                       "after": rows[-1]["eval/accuracy_greedy"],
                       "before_sampled": rows[0]["eval/accuracy"],
                       "after_sampled": rows[-1]["eval/accuracy"],
                       **kl_to_start(wd / "final_model", start, n=8 if args.smoke else 96)}
  plot(runs, root / "feedback_learning.png")
  print(f"\n{'method':<6} {'before':>7} {'after':>7} {'before(T=1)':>12} {'after(T=1)':>11} "
        f"{'KL k1/seq':>10} {'KL k3/tok':>10}")
  for m, r in results.items():
    print(f"{m:<6} {r['before']:>7.3f} {r['after']:>7.3f} {r['before_sampled']:>12.3f} "
          f"{r['after_sampled']:>11.3f} {r['kl_seq_k1']:>10.4f} {r['kl_token_k3']:>10.5f}")
  out = {"results": results, "curves": runs, "args": vars(args), "seconds": time.time() - t0,
         "plot": str(root / "feedback_learning.png")}
  write_result(args.out, info, json.loads(json.dumps(out, default=float)))
  line = " ".join(f"{m}_{k}={results[m][k]:.3f}" for m in results for k in ("before", "after"))
  print(f"RESULT {line}")


if __name__ == "__main__":
  main()
