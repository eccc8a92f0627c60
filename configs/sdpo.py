"""SDPO-style self-distillation from free-text feedback on single trajectories (no groups).

The hidden-rule task (posttrain_jax/tasks/hidden_rule.py): a word and a rule; the RL prompts never
state their rule (it is `reverse`), and the `hidden_rule` grader's feedback names it. Two commands:

    python launch/train.py --config=configs/sdpo.py:warmstart   # SFT: every rule when stated
    python launch/train.py --config=configs/sdpo.py             # RL from its sft_model

The warm start (800 SFT steps on prompts of which 75 % state their rule, written to
runs/sdpo_warmstart/sft_model) teaches the rules in context and the prior "no rule stated means
copy". The RL phase samples one trajectory per prompt; the teacher is the model itself (an EMA
of its weights, rate 0.05, from the warm start) with the grader's feedback ("rule: reverse") in
its prompt, and the loss is full_distill: JSD_0.5 between the student's and the teacher's
next-token distributions (student top-100 + tail) at every sampled position. The `running` baseline
is kept for the reported advantages; full_distill reads no reward. These are the settings
benchmarks/feedback_learning.py measured (greedy held-out 0.055 -> 0.578 in 40 steps x 32
prompts at lr 1e-3).
"""
from posttrain_jax.run_config import base_config

TINY = dict(family="qwen3", vocab_size=512, hidden_size=128, intermediate_size=384,
            num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, seed=0)
WORDS = dict(letters="abcdefgh", min_len=3, max_len=5, hidden_rule="reverse", default_rule="copy")
WARMSTART = "runs/sdpo_warmstart"


def _warmstart(c):
  """SFT only, stopped after it: writes WARMSTART/sft_model."""
  c.workdir = WARMSTART
  c.model.tiny.update(**TINY)
  c.tasks.generator_config = dict(**WORDS, stated_frac=0.75)
  c.sft.update(steps=800, batch_size=64)
  c.sft.learner.optimizer.update(learning_rate=3e-3, warmup_steps=20, decay_steps=800,
                                 end_lr_ratio=0.1)
  c.sft.batch.update(rows=64, seq_len=40, max_seqs=64, pack=False)
  c.rl.steps = 1
  c.stop_after_step = 800
  c.checkpoint.update(every_steps=0, max_to_keep=1)
  return c


def get_config(arg: str = ""):
  c = base_config()
  c.grader = "hidden_rule"
  c.tasks.update(source="synthetic", generator="string_rule", seed=0, eval_fraction=0.1,
                 eval_size=128)
  if arg == "warmstart":
    return _warmstart(c)
  if arg:
    raise ValueError(f"configs/sdpo.py takes ':warmstart' or nothing, got {arg!r}")
  c.workdir = "runs/sdpo"
  c.model.path = f"{WARMSTART}/sft_model"
  c.tasks.seed = 1
  c.tasks.generator_config = dict(**WORDS, stated_frac=0.0)
  c.sft.steps = 0
  c.rl.update(steps=40, prompts_per_step=32)
  c.rl.rollout.update(group_size=1, max_tokens=8, temperature=1.0)
  c.rl.advantage.estimator = "running"
  c.rl.learner.update(loss="full_distill")
  c.rl.learner.optimizer.update(learning_rate=1e-3, warmup_steps=2)
  c.rl.loss = dict(divergence="jsd", beta=0.5, topk=100)
  c.rl.teacher.update(context="feedback", template="{context} | {prompt}",
                      feedback_template="{text}", seq_len=48, weights="ema", ema_rate=0.05)
  c.rl.batch.update(rows=32, seq_len=32, max_seqs=32, pack=False)
  c.eval.update(every_steps=5, samples_per_prompt=2, temperature=1.0, greedy=True, max_tokens=8)
  c.checkpoint.update(every_steps=20, max_to_keep=2)
  return c
