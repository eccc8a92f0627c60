"""Checks a run makes before it trains (a config that cannot run fails in the first second, not
after the SFT phase) and when it resumes (a checkpoint written under another meaning)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax

from posttrain_jax.config_io import ConfigTypeError, to_dict
from posttrain_jax.multihost import share

# Config fields whose change makes a checkpoint mean something else: resuming is refused.
FIXED_ON_RESUME = ("seed", "model", "tasks", "sft.steps", "sft.batch_size", "sft.answer_style",
                   "rl.mode", "rl.rollout.group_size", "rl.prompts_per_step",
                   "rl.learner.loss", "rl.advantage.estimator", "rl.teacher.weights",
                   "rl.teacher.checkpoint", "mesh")


@dataclasses.dataclass(frozen=True)
class Shares:
  """This process's part of every global count (all of it with one process)."""
  sft_batch_size: int
  sft_batch: Any
  prompts_per_step: int
  rl_batch: Any


def process_shares(cfg, source, engine, episode) -> Shares:
  """Several processes (a multi-host job): every global count in the config is split evenly,
  each process feeding its share (the same config trains on the same global batch on any number
  of processes). The rollout source must run in several processes, and an engine that is one
  program of the whole job (processes="lockstep") serves only sources and episodes whose every
  process calls it in step; an engine driven by one learner (processes="one") none.
  `source`, `engine`, `episode`: the registry entries of rl.mode, rl.engine, rl.episode."""
  n = jax.process_count()
  if n == 1:
    return Shares(cfg.sft.batch_size, cfg.sft.batch, cfg.rl.prompts_per_step, cfg.rl.batch)
  local = lambda b, name: dataclasses.replace(  # noqa: E731
      b, rows=share(b.rows, f"{name}.rows"), max_seqs=share(b.max_seqs, f"{name}.max_seqs"))
  sft_size, sft_batch = cfg.sft.batch_size, cfg.sft.batch
  if cfg.sft.steps:
    sft_size, sft_batch = share(cfg.sft.batch_size, "sft.batch_size"), local(cfg.sft.batch,
                                                                             "sft.batch")
  prompts, rl_batch = cfg.rl.prompts_per_step, cfg.rl.batch
  if cfg.rl.steps:
    prompts, rl_batch = share(prompts, "rl.prompts_per_step"), local(rl_batch, "rl.batch")
    if not source.multi_process:
      raise ConfigTypeError(f"rl.mode={source.name!r} runs in one process (got {n}): its data "
                            "(the trace store) is not sharded between processes")
    if engine.processes == "one":
      raise ConfigTypeError(f"rl.engine={engine.name!r} is driven by a one-process learner (got "
                            f"{n}): each process would push weights to, and route over, every "
                            "server")
    if engine.processes == "lockstep" and not (source.lockstep and episode.lockstep):
      raise ConfigTypeError(
          f"rl.engine={engine.name!r} with {n} processes serves rollouts every process runs in "
          f"step only (got rl.mode={source.name!r}, rl.episode={episode.name!r}): its decode is "
          "one program of the whole job; use an engine per process (rl.engine='vllm' or "
          "'openai')")
  return Shares(sft_size, sft_batch, prompts, rl_batch)


def check_data_budget(cfg, bank, draws_per_step: Callable[[Any, int], int]) -> None:
  """A finite task bank must hold the tasks the run draws (async may draw a few more)."""
  if bank.endless or cfg.tasks.num_epochs is None:
    return
  have = len(bank.dataset())
  need = cfg.sft.steps * cfg.sft.batch_size + cfg.rl.steps * draws_per_step(
      cfg.rl, cfg.rl.prompts_per_step)
  if need > have:
    raise ConfigTypeError(
        f"config.tasks.num_epochs={cfg.tasks.num_epochs}: the task bank yields {have} tasks "
        f"but the run draws {need} (sft.steps × sft.batch_size + rl.steps × "
        f"rl.prompts_per_step); raise num_epochs, set it to None to cycle, or train fewer steps")


def check_resume_config(cfg, saved: Optional[dict], where, log) -> None:
  """Refuses a resume whose config changes a FIXED_ON_RESUME field; logs the other changes."""
  if not saved:
    return
  now = to_dict(cfg)
  diffs = _diff(saved, now)
  fixed = [d for d in diffs if any(d == f or d.startswith(f + ".") for f in FIXED_ON_RESUME)]
  if fixed:
    raise ConfigTypeError(
        f"the checkpoint in {where} was written with a different "
        f"{', '.join(fixed)} (saved vs now: "
        + "; ".join(f"{d}: {_get(saved, d)!r} vs {_get(now, d)!r}" for d in fixed)
        + "); resume with the saved values or start over with --noresume")
  benign = [d for d in diffs if d not in fixed and d not in ("workdir", "stop_after_step")]
  if benign:
    log("resuming with a changed config: " + "; ".join(
        f"{d}: {_get(saved, d)!r} -> {_get(now, d)!r}" for d in benign))


def _diff(a: Any, b: Any, prefix: str = "") -> list[str]:
  """Dotted paths where two config dicts differ."""
  if isinstance(a, dict) and isinstance(b, dict):
    out = []
    for k in sorted(set(a) | set(b)):
      out += _diff(a.get(k), b.get(k), f"{prefix}.{k}" if prefix else k)
    return out
  return [] if a == b else [prefix]


def _get(d: dict, path: str):
  for k in path.split("."):
    d = d.get(k) if isinstance(d, dict) else None
  return d
