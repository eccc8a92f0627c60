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
from posttrain_jax.run_config import base_config


def get_config():
  c = base_config()
  c.workdir = "runs/distill_mix"
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
  c.rl.update(steps=400, prompts_per_step=16)
  c.rl.rollout.update(group_size=8, max_tokens=12, temperature=1.0)
  c.rl.advantage.estimator = "grpo"
  c.rl.learner.update(loss="sampled_distill")
  c.rl.learner.optimizer.update(learning_rate=1e-4, warmup_steps=5)
  c.rl.loss = dict(coef=1.0, rl_coef=1.0, is_clip=2.0, aggregation="token_mean")
  c.rl.teacher.update(context="sdpo", weights="ema", ema_rate=0.05, seq_len=48)
  c.rl.batch.update(rows=128, seq_len=32, max_seqs=128, pack=False)
  c.eval.update(every_steps=100, samples_per_prompt=4, temperature=1.0, max_tokens=12)
  c.checkpoint.update(every_steps=100, max_to_keep=2)
  return c
