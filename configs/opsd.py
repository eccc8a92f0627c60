"""OPSD-style self-distillation from reference solutions: the teacher sees the task's solution.

    python launch/train.py --config=configs/opsd.py

configs/default.py's run (the tiny model, SFT warm-start on 2-digit addition) with its RL phase
replaced: one sample per prompt, and the teacher is the model itself (an EMA of its weights)
with "A correct solution: <solution>" added to the prompt (`rl.teacher.context=reference`:
`task.metadata["solution"]`, else the answer; for arithmetic both are the final value), scoring
the student's own sampled tokens. The loss is full_distill (JSD_0.5 over the student's top-100
+ tail); no reward enters it (the `running` baseline is only reported). Every task has a
solution, so every sample is scored (`distill/no_context_frac` 0).
"""
from posttrain_jax.configs.default import get_config as default_config


def get_config():
  c = default_config()    # the tiny model, the SFT warm-start on 2-digit addition
  c.workdir = "runs/opsd"
  c.rl.update(steps=200, prompts_per_step=64, reference_kl=False)
  c.rl.rollout.update(group_size=1)
  c.rl.advantage.estimator = "running"
  c.rl.learner.update(loss="full_distill")
  c.rl.loss = dict(divergence="jsd", beta=0.5, topk=100)
  c.rl.teacher.update(context="reference", weights="ema", ema_rate=0.05, seq_len=48)
  c.rl.batch.update(rows=64, max_seqs=64)
  c.eval.every_steps = 50
  c.checkpoint.update(every_steps=100, max_to_keep=2)
  return c
