"""Learn from what a harness did through the proxy: the graded sessions in runs/traces.db.

`python launch/serve.py` serves and records (configs/serve.py: the tiny hermes model, the same
weights this run starts from); post grades to /v1/sessions/{id}/feedback; then
`python launch/train.py --config=configs/byoh.py` trains on every graded session once, one
trajectory per session (no groups: the `running` baseline), with the off-policy correction
(`rl.async_correction`, TIS by default) against the recorded behaviour log-probs, and reports
their staleness (`traces/staleness/*`). Held-out accuracy is measured on the task bank below.
Serve your own checkpoint and train it with `--config.model.path=DIR`.
"""
from posttrain_jax.run_config import base_config


def get_config():
  c = base_config()
  c.workdir = "runs/byoh"
  c.model.tiny.update(chat_format="hermes")   # configs/serve.py's model
  c.tasks.update(source="synthetic", generator="arithmetic", seed=0, eval_fraction=0.05,
                 eval_size=64)
  c.tasks.generator_config = dict(min_digits=2, max_digits=2, num_operands=2, ops="+",
                                  allow_negative=False)
  c.sft.steps = 0
  c.rl.update(mode="traces", steps=50, prompts_per_step=8, reference_kl=False)
  c.rl.traces.store.path = "runs/traces.db"
  c.rl.advantage.estimator = "running"
  c.rl.learner.optimizer.update(learning_rate=3e-5, warmup_steps=5)
  c.rl.batch.update(rows=16, seq_len=1024, max_seqs=16, pack=False)
  c.eval.update(every_steps=25, samples_per_prompt=2, max_tokens=12)
  c.checkpoint.update(every_steps=25, max_to_keep=2)
  return c
