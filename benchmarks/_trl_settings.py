"""TRL's side of benchmarks/time_to_accuracy.py, read off the run config ours runs: the
`GRPOConfig` keywords and the peft `LoraConfig` (so "identical settings" are identical by
construction)."""


def trl_settings(cfg) -> dict:
  """`GRPOConfig` keywords for what a RunConfig sets: batch, group, sampling, lr and its warmup
  (then constant: ours has no decay here), clip range, token-mean loss ("dapo"), grad-norm clip,
  no KL, activation recompute (`model.remat`; TRL's default would recompute, ours does not)."""
  rl, opt = cfg.rl, cfg.rl.learner.optimizer
  if opt.decay_steps:
    raise SystemExit("time_to_accuracy: a decaying lr has no TRL twin here (decay_steps=0)")
  loss = rl.loss     # the loss's own config (losses/grpo.py's GRPOConfig)
  if loss.aggregation != "token_mean" or loss.kl_coef:
    raise SystemExit("time_to_accuracy: TRL is run with token-mean loss and no KL only")
  # what TRL would do otherwise and nothing here maps: refused, not silently different
  unmapped = {"rl.rollout.top_p": (rl.rollout.top_p, 1.0), "rl.rollout.top_k": (rl.rollout.top_k, 0),
              "rl.advantage.estimator": (rl.advantage.estimator, "grpo"),
              "rl.advantage.std_ddof": (rl.advantage.std_ddof, 1),   # torch's std: sample std
              "rl.oversample": (rl.oversample, 0.0),
              "rl.learner.temperature": (rl.learner.temperature, rl.rollout.temperature)}
  for field, (value, twin) in unmapped.items():
    if value != twin:
      raise SystemExit(f"time_to_accuracy: {field}={value!r} has no TRL twin here "
                       f"(it must be {twin!r})")
  return dict(per_device_train_batch_size=rl.prompts_per_step * rl.rollout.group_size,
              gradient_accumulation_steps=1, num_generations=rl.rollout.group_size,
              max_completion_length=rl.rollout.max_tokens, temperature=rl.rollout.temperature,
              learning_rate=opt.learning_rate, warmup_steps=opt.warmup_steps,
              lr_scheduler_type="constant_with_warmup" if opt.warmup_steps else "constant",
              beta=0.0, loss_type="dapo", epsilon=loss.eps_low,
              epsilon_high=loss.eps_high, max_grad_norm=opt.grad_clip_norm,
              weight_decay=opt.weight_decay, adam_beta1=opt.b1, adam_beta2=opt.b2,
              adam_epsilon=opt.eps,
              gradient_checkpointing=cfg.model.remat)


def trl_lora(cfg):
  """peft's LoraConfig for the run's `rl.learner.lora` (None without adapters)."""
  lo = cfg.rl.learner.lora
  if not lo.rank:
    return None
  from peft import LoraConfig
  return LoraConfig(r=lo.rank, lora_alpha=lo.alpha, lora_dropout=lo.dropout,
                    target_modules=list(lo.target_modules), task_type="CAUSAL_LM")
