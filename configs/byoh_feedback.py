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
from posttrain_jax.configs.byoh import get_config as byoh_config


def get_config():
  c = byoh_config()       # the store, the serve model, one trajectory per session
  c.workdir = "runs/byoh_feedback"
  c.rl.traces.update(require="either")
  c.rl.learner.update(loss="sampled_distill")
  c.rl.loss = dict(coef=1.0, rl_coef=1.0, is_clip=2.0, aggregation="token_mean")
  c.rl.teacher.update(context="feedback", weights="ema", ema_rate=0.05, seq_len=1280)
  return c
