"""Self-distillation mixed with an RL advantage: sampled_distill with rl_coef > 0, in groups.

    python launch/train.py --config=configs/distill_mix.py

configs/default.py's run (SFT warm-start, 8 samples per prompt, GRPO's group advantage Â) with
the loss sampled_distill: per sampled token the advantage is coef·m_t·sg(log T − log π) +
rl_coef·Â (losses/distill.py). The teacher is the model itself (an EMA of its weights) with
SDPO's context (`rl.teacher.context=sdpo`): a successful sibling's answer from the same group,
else the grader's feedback. The numeric grader gives no feedback, so a sample of a group with
no correct answer has no teacher (m_t = 0, counted in `distill/no_context_frac`) and learns
from the RL term alone; a correct sample is shown another correct sibling's answer.
"""
from posttrain_jax.configs.default import get_config as default_config


def get_config():
  c = default_config()    # the tiny model, the SFT warm-start, 16 prompts x 8 samples
  c.workdir = "runs/distill_mix"
  c.rl.advantage.estimator = "grpo"
  c.rl.learner.update(loss="sampled_distill")
  c.rl.loss = dict(coef=1.0, rl_coef=1.0, is_clip=2.0, aggregation="token_mean")
  c.rl.teacher.update(context="sdpo", weights="ema", ema_rate=0.05, seq_len=48)
  c.checkpoint.update(every_steps=100, max_to_keep=2)
  return c
