"""Learn from what a harness did through the proxy, graded or only commented on.

configs/byoh.py (the sessions in runs/traces.db, one trajectory per session, the `running`
baseline) with `rl.traces.require=either`: a session is taken once it has a grade or any free
text posted to /v1/sessions/{id}/feedback (or a call's). The loss is sampled_distill with an RL
term: per sampled token coef·m_t·sg(log T − log π) + rl_coef·Â, the teacher the model itself
(an EMA of its weights) with the session's feedback text in its prompt. A session without a
grade has advantage 0 (its RL term is 0; it never moves the baseline) and is counted
(`traces/ungraded`, `filter/ungraded_frac`); one without text has no teacher (counted in
`distill/no_context_frac`) and learns from its grade alone.

    python launch/train.py --config=configs/byoh_feedback.py
"""
from posttrain_jax.run_config import base_config


def get_config():
  c = base_config()
  c.workdir = "runs/byoh_feedback"
  c.model.tiny.update(chat_format="hermes")   # configs/serve.py's model
  c.tasks.update(source="synthetic", generator="arithmetic", seed=0, eval_fraction=0.05,
                 eval_size=64)
  c.tasks.generator_config = dict(min_digits=2, max_digits=2, num_operands=2, ops="+",
                                  allow_negative=False)
  c.sft.steps = 0
  c.rl.update(mode="traces", steps=50, prompts_per_step=8, reference_kl=False)
  c.rl.traces.update(require="either")
  c.rl.traces.store.path = "runs/traces.db"
  c.rl.advantage.estimator = "running"
  c.rl.learner.update(loss="sampled_distill")
  c.rl.loss = dict(coef=1.0, rl_coef=1.0, is_clip=2.0, aggregation="token_mean")
  c.rl.learner.optimizer.update(learning_rate=3e-5, warmup_steps=5)
  c.rl.teacher.update(context="feedback", weights="ema", ema_rate=0.05, seq_len=1280)
  c.rl.batch.update(rows=16, seq_len=1024, max_seqs=16, pack=False)
  c.eval.update(every_steps=25, samples_per_prompt=2, max_tokens=12)
  c.checkpoint.update(every_steps=25, max_to_keep=2)
  return c
