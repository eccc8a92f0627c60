"""Learn from what a harness did through the proxy: the graded sessions in runs/traces.db.

`python launch/serve.py` serves and records (configs/serve.py: the tiny hermes model, the same
weights this run starts from); post grades to /v1/sessions/{id}/feedback; then
`python launch/train.py --config=configs/byoh.py` trains on every graded session once, one
trajectory per session (no groups: the `running` baseline), with the off-policy correction
(`rl.async_correction`, TIS by default) against the recorded behaviour log-probs, and reports
their staleness (`traces/staleness/*`). Held-out accuracy is measured on the task bank below.
Serve your own checkpoint and train it with `--config.model.path=DIR`.

`--config=configs/byoh.py:online` serves the policy being trained instead (the proxy in the run,
each step's weights swapped in) and trains only sessions sampled at most 4 versions ago
(`rl.traces.max_staleness`; older ones are counted in `filter/stale_session_frac`, not trained).
Measured (benchmarks/byoh_online.py, 8 harness threads, 64 sessions a step, 200 steps, lr 1e-4,
one seed each): held-out 0.563 -> 0.689 with the bound (10.6% of sessions not trained, median
staleness 2), 0.563 -> 0.389 at step 50 and 0.656 at the end without it (median staleness 5:
the sessions served while the first eval ran, all at version 0, were trained first).
One adapter per tenant (docs/byoh.md, "Many tenants, one base"): `:online` with
`--config.rl.learner.lora.rank=8 --config.rl.learner.lora.tenants='("a", "b")'` and
`--config.rl.traces.online.proxy.api_keys='(("key-a", "a"), ("key-b", "b"))'`.
"""
from posttrain_jax.byoh.server import ProxyConfig
from posttrain_jax.config_io import config_dict_of
from posttrain_jax.models.lora import LoRAConfig
from posttrain_jax.run_config import base_config


def get_config(mode: str = ""):
  if mode not in ("", "online"):
    raise ValueError(f"configs/byoh.py:{mode}: the variants are '' and 'online'")
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
  if mode == "online":
    c.rl.mode = "online"
    c.rl.traces.max_staleness = 4
    # tuple-valued fields settable as flags: --config.rl.learner.lora.tenants='("a", "b")',
    # --config.rl.traces.online.proxy.api_keys='(("key-a", "a"), ("key-b", "b"))'
    c.rl.learner.lora = config_dict_of(LoRAConfig(), keep_tuples=True)
    c.rl.traces.online.proxy = config_dict_of(ProxyConfig(), keep_tuples=True)
  return c
