"""On-policy distillation from an external teacher: the student samples, another checkpoint scores
every sampled token, and the student descends the reverse KL to it (no reward signal needed).

    python launch/train.py --config=configs/distill_external.py \
        --config.rl.teacher.checkpoint=DIR [--config.model.path=STUDENT_DIR]

`--config.rl.teacher.checkpoint` is required (nothing is downloaded; without it the config is
refused, naming the field): an HF model directory of any size and architecture that shares the
student's vocabulary and tokenizer (checked before anything runs). The teacher sees the
student's own prompt (`rl.teacher.context="none"`); `rl.learner.loss=full_distill` distills the
whole next-token distribution through the teacher's hidden states and head instead of the
sampled token's log-prob. The student defaults to configs/default.py's tiny model on 2-digit
addition; held-out accuracy is still graded.
"""
from posttrain_jax.run_config import base_config


def get_config():
  c = base_config()
  c.workdir = "runs/distill_external"
  c.model.tiny.update(family="qwen3", vocab_size=512, hidden_size=128, intermediate_size=384,
                      num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, seed=0)
  c.tasks.update(source="synthetic", generator="arithmetic", seed=0, eval_fraction=0.05,
                 eval_size=256)
  c.tasks.generator_config = dict(min_digits=2, max_digits=2, num_operands=2, ops="+",
                                  allow_negative=False)
  c.sft.steps = 0
  c.rl.update(steps=200, prompts_per_step=32, reference_kl=False)
  c.rl.rollout.update(group_size=1, max_tokens=12, temperature=1.0)
  c.rl.advantage.estimator = "running"   # one sample per prompt; no RL term (rl_coef 0)
  c.rl.learner.update(loss="sampled_distill")
  c.rl.learner.optimizer.update(learning_rate=1e-4, warmup_steps=5)
  c.rl.teacher.update(weights="checkpoint", context="none", seq_len=32, checkpoint="")
  c.rl.batch.update(rows=32, seq_len=32, max_seqs=32, pack=False)
  c.eval.update(every_steps=50, samples_per_prompt=4, temperature=1.0, max_tokens=12)
  c.checkpoint.update(every_steps=50, max_to_keep=2)
  return c
