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
from posttrain_jax.configs.default import get_config as default_config


def get_config():
  c = default_config()    # the tiny student on 2-digit addition, without its SFT phase
  c.workdir = "runs/distill_external"
  c.sft.steps = 0
  c.rl.update(steps=200, prompts_per_step=32, reference_kl=False)
  c.rl.rollout.update(group_size=1)
  c.rl.advantage.estimator = "running"   # one sample per prompt; no RL term (rl_coef 0)
  c.rl.learner.update(loss="sampled_distill")
  c.rl.loss = dict()
  c.rl.teacher.update(weights="checkpoint", context="none", seq_len=32, checkpoint="")
  c.rl.batch.update(rows=32, max_seqs=32)
  c.eval.every_steps = 50
  c.checkpoint.update(every_steps=50, max_to_keep=2)
  return c
