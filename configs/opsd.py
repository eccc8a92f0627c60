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
from posttrain_jax.run_config import base_config


def get_config():
  c = base_config()
  c.workdir = "runs/opsd"
  c.model.tiny.update(family="qwen3", vocab_size=512, hidden_size=128, intermediate_size=384,
                      num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, seed=0)
  c.tasks.update(source="synthetic", generator="arithmetic", seed=0, eval_fraction=0.05,
                 eval_size=256)
  c.tasks.generator_config = dict(min_digits=2, max_digits=2, num_operands=2, ops="+",
                                  allow_negative=False)
  # configs/default.py's warm-start: the answer format and some of the skill
  c.sft.update(steps=350, batch_size=64)
  c.sft.learner.optimizer.update(learning_rate=3e-3, warmup_steps=20, decay_steps=350,
                                 end_lr_ratio=0.1)
  c.sft.batch.update(rows=64, seq_len=32, max_seqs=64, pack=False)
  c.rl.update(steps=200, prompts_per_step=64, reference_kl=False)
  c.rl.rollout.update(group_size=1, max_tokens=12, temperature=1.0)
  c.rl.advantage.estimator = "running"
  c.rl.learner.update(loss="full_distill")
  c.rl.learner.optimizer.update(learning_rate=1e-4, warmup_steps=5)
  c.rl.loss = dict(divergence="jsd", beta=0.5, topk=100)
  c.rl.teacher.update(context="reference", weights="ema", ema_rate=0.05, seq_len=48)
  c.rl.batch.update(rows=64, seq_len=32, max_seqs=64, pack=False)
  c.eval.update(every_steps=50, samples_per_prompt=4, temperature=1.0, max_tokens=12)
  c.checkpoint.update(every_steps=100, max_to_keep=2)
  return c
