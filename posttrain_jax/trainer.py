"""The synchronous run: optional SFT warm-start, then GRPO on graded rollouts, with held-out eval.

    for step in SFT steps:  batch of reference solutions -> learner(sft)
    export the warm-start model (the GRPO start and the KL reference)
    for step in RL steps:
        tasks -> engine.generate(G per task) -> grade -> Trajectories
        advantages per group (infra errors excluded) -> packed TrainBatch -> learner(grpo)
        engine.update_weights(new params, version = step)

Global step numbering runs through both phases, so one checkpoint series, one metrics file
and one progress bar cover the run. A checkpoint holds the TrainState, the task iterator's
state, the reward history and the held-out "before" accuracy; sampling seeds derive from
(seed, step). Resuming therefore replays exactly the steps an uninterrupted run would take.

With `rl.mode = "async"` an actor pool samples while the learner trains (actors/pool.py): the
batch of a step may come from older policy versions (at most `rl.replay.max_staleness` behind),
`old_logp` is recomputed by the learner whenever the loss has an off-policy correction, and the
checkpoint also holds the replay queue and unfinished work (no trajectory lost or trained twice
on resume; data order is not reproduced).
"""
from __future__ import annotations

import base64
import dataclasses
import json
import math
import pathlib
import time
import zlib
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain_jax import batching
from posttrain_jax.actors.pool import AsyncRollouts
from posttrain_jax.actors.rollout import SyncRollouts, encode_prompt
from posttrain_jax.advantages import compute_advantages
from posttrain_jax.checkpoint import Checkpointer
from posttrain_jax.config_io import to_dict
from posttrain_jax.engines.base import SamplingParams
from posttrain_jax.engines.jax_sampler import JaxSampler, JaxSamplerConfig
from posttrain_jax.envs import TaskBank, make_grader, solution_text
from posttrain_jax.learner import Learner
from posttrain_jax.metrics import MetricsWriter, plot_run, read_metrics
from posttrain_jax.models import hf_io
from posttrain_jax.models.tiny import build_tiny_model
from posttrain_jax.run_config import RunConfig
from posttrain_jax.sharding import make_mesh
from posttrain_jax.types import Status


class Trainer:
  """Wires the parts of a RunConfig together and runs it (resuming from the workdir)."""

  def __init__(self, cfg: RunConfig, log=print):
    self.cfg = cfg
    self.log = log
    self.workdir = pathlib.Path(cfg.workdir)
    self.workdir.mkdir(parents=True, exist_ok=True)
    self.model_dir = (pathlib.Path(cfg.model.path) if cfg.model.path
                      else build_tiny_model(cfg.model.tiny))
    self.tokenizer = hf_io.load_tokenizer(self.model_dir)
    model_cfg = hf_io.read_model_config(self.model_dir)
    eos = model_cfg.eos_token_id
    self.stop_ids = tuple(eos) if isinstance(eos, tuple) else ((eos,) if eos is not None else ())
    if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in self.stop_ids:
      self.stop_ids = (self.tokenizer.eos_token_id,) + self.stop_ids
    self.mesh = make_mesh(cfg.mesh)
    tasks_cfg = dataclasses.replace(cfg.tasks, process_index=jax.process_index(),
                                    process_count=jax.process_count())
    self.bank = TaskBank(tasks_cfg)
    self.tasks = self.bank.iterator()
    self.held_out = self.bank.eval_tasks()
    self.grader = make_grader(cfg.grader)
    self.ckpt = Checkpointer(self.workdir / "checkpoints", cfg.checkpoint)
    self.sft_dir = self.workdir / "sft_model"
    self.total_steps = cfg.sft.steps + cfg.rl.steps
    self.rewards: list[float] = []
    self.heldout_before: Optional[dict] = None
    self._source = None                       # the RL phase's rollout source (sync or async)
    self._engine_obj = None                   # the RL phase's engine (closed at the end)
    self._source_state: Optional[dict] = None  # its checkpointed state, restored when it starts

  # ------------------------------------------------------------------ helpers
  def _load(self, path) -> "hf_io.Decoder":
    m = self.cfg.model
    return hf_io.load_hf_model(path, mesh=self.mesh, param_dtype=m.param_dtype,
                               compute_dtype=m.compute_dtype, remat=m.remat)

  def _extra(self, step: int) -> dict:
    return {"step": step, "tasks_state": base64.b64encode(self.tasks.get_state_bytes()).decode(),
            "rewards": self.rewards, "heldout_before": self.heldout_before,
            "rollouts": self._source.state() if self._source is not None else None,
            "config": to_dict(self.cfg)}

  def _save(self, step: int, learner: Learner, force: bool = False) -> None:
    if force or self.ckpt.should_save(step):
      self.ckpt.save(step, learner.state, self._extra(step))

  def evaluate(self, engine) -> dict[str, float]:
    """Mean reward on the held-out tasks: sampled at the policy temperature, and greedy."""
    ev = self.cfg.eval
    prompts = [encode_prompt(self.tokenizer, t) for t in self.held_out]
    out = {}
    modes = [("accuracy", ev.temperature, ev.samples_per_prompt)]
    if ev.greedy:
      modes.append(("accuracy_greedy", 0.0, 1))
    for name, temp, n in modes:
      sp = SamplingParams(max_tokens=ev.max_tokens, temperature=temp, stop_token_ids=self.stop_ids)
      groups = engine.generate(prompts, sp, n=n, seed=12345)
      rewards = [self.grader(self.tokenizer.decode(c.token_ids, skip_special_tokens=True), t).reward
                 for comps, t in zip(groups, self.held_out) for c in comps]
      out[f"eval/{name}"] = float(np.mean(rewards)) if rewards else float("nan")
    return out

  def _engine(self, learner: Learner, base: pathlib.Path):
    """The rollout engine of `rl.engine`, serving `base` (the GRPO start) at version 0."""
    if self.cfg.rl.engine == "jax":
      return self._sampler(learner.model())
    from posttrain_jax.engines.vllm_engine import VLLMEngine  # optional dependency
    vcfg = dataclasses.replace(self.cfg.rl.vllm, model=str(base))
    return _DecoderWeights(VLLMEngine(vcfg), learner.graphdef)

  def _sampler(self, model) -> JaxSampler:
    max_prompt = max([len(encode_prompt(self.tokenizer, t)) for t in self.held_out[:64]] + [64])
    return JaxSampler(model, JaxSamplerConfig(max_prompt_len=max(256, 2 * max_prompt),
                                              pad_id=self.tokenizer.pad_token_id or 0))

  # ------------------------------------------------------------------ phases
  def _sft(self, start: int, state, bar, writer) -> int:
    cfg = self.cfg.sft
    learner = Learner(self._load(self.model_dir), cfg.learner, mesh=self.mesh)
    if state is not None:
      learner.restore(state)
    eos = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
    for step in range(start, cfg.steps):
      t0 = time.perf_counter()
      trajs = []
      for i in range(cfg.batch_size):
        task = next(self.tasks)
        answer = self.tokenizer.encode(solution_text(task, cfg.answer_style), add_special_tokens=False)
        trajs.append(batching.sft_trajectory(encode_prompt(self.tokenizer, task), answer + eos,
                                             f"sft{step}/{i}", task.id))
      metrics = learner.step(batching.build_batch(trajs, [0.0] * len(trajs), cfg.batch))
      metrics = {f"sft/{k}": v for k, v in metrics.items()}
      metrics["data/hash"] = _data_hash([t.task_id for t in trajs])
      metrics["time/step_s"] = time.perf_counter() - t0
      writer.write(step + 1, metrics)
      bar.update(1)
      bar.set_postfix(phase="sft", loss=f"{metrics['sft/loss']:.3f}")
      self._save(step + 1, learner, force=step + 1 == cfg.steps)
      if self._stop(step + 1):
        return step + 1
    if jax.process_index() == 0 and not (self.sft_dir / "config.json").exists():
      hf_io.save_hf_model(learner.model(), self.sft_dir, tokenizer_dir=self.model_dir)
    return cfg.steps

  def _rl(self, start: int, state, bar, writer) -> int:
    cfg = self.cfg.rl
    base = self.sft_dir if self.cfg.sft.steps > 0 else self.model_dir
    learner = Learner(self._load(base), cfg.learner, self.cfg.loss_config(), mesh=self.mesh)
    reference = None  # the warm-start weights, copied: the learner donates its own buffers
    if getattr(self.cfg.loss_config(), "kl_coef", 0.0) > 0 or cfg.reference_kl:
      reference = jax.tree.map(jnp.copy, learner.state.params)
    engine = self._engine_obj = self._engine(learner, base)
    if cfg.mode == "async":  # the pool gets its own sampler: it decodes while `engine` evaluates
      pool_engine = self._sampler(learner.model()) if cfg.engine == "jax" else engine
      source = AsyncRollouts(pool_engine, self.tasks, self.tokenizer,
                             self.grader, cfg.rollout, self.stop_ids, cfg.prompts_per_step,
                             seed=self.cfg.seed, replay=cfg.replay, pool=cfg.pool)
    else:
      source = SyncRollouts(engine, self.tasks, self.tokenizer, self.grader, cfg.rollout,
                            self.stop_ids, cfg.prompts_per_step, seed=self.cfg.seed)
    self._source = source
    if self._source_state:
      source.restore(self._source_state)
    if self.heldout_before is None:
      self.heldout_before = self.evaluate(engine)
      writer.write(start, dict(self.heldout_before))
      self.log(f"held-out before GRPO: {_fmt(self.heldout_before)}")
    if state is not None:
      learner.restore(state)
    sft_steps = self.cfg.sft.steps
    for step in range(start, self.total_steps):
      rl_step = step - sft_steps
      t0 = time.perf_counter()
      source.update_weights(learner.params, version=rl_step)
      tasks, trajs = source.collect(step)
      t_gen = time.perf_counter() - t0
      adv = compute_advantages(trajs, cfg.advantage)
      keep = [t for t, k in zip(trajs, adv.keep) if k]
      batch = batching.build_batch(keep, adv.advantages[adv.keep].tolist(), cfg.batch)
      if reference is not None:
        batch = dataclasses.replace(batch, ref_logp=np.asarray(learner.logprobs(batch, reference)))
      if cfg.update_epochs > 1 or getattr(learner.loss_cfg, "correction", "none") != "none":
        batch = dataclasses.replace(batch, old_logp=np.asarray(learner.logprobs(batch)))
      t1 = time.perf_counter()
      for _ in range(cfg.update_epochs):
        metrics = learner.step(batch)
      t_train = time.perf_counter() - t1
      scored = [t for t in keep if t.reward is not None]
      reward = float(np.mean([t.reward for t in scored])) if scored else float("nan")
      self.rewards.append(reward)
      metrics.update({
          "reward/mean": reward,
          "response_len/mean": float(np.mean([t.num_sampled for t in trajs])),
          "truncated_frac": float(np.mean([t.status is Status.TRUNCATED for t in trajs])),
          "infra_error_frac": adv.stats["infra_error_frac"],
          "zero_var_group_frac": adv.stats.get("zero_var_group_frac", 0.0),
          "time/generate_s": t_gen, "time/train_s": t_train,
          "time/step_s": time.perf_counter() - t0,
          "policy_version": rl_step + 1,
          "data/hash": _data_hash([t.id for t in tasks]),
      })
      metrics.update(source.metrics())
      if self.cfg.eval.every_steps and (rl_step + 1) % self.cfg.eval.every_steps == 0 \
          and step + 1 < self.total_steps:
        engine.update_weights(learner.params, version=rl_step + 1)
        metrics.update(self.evaluate(engine))
      writer.write(step + 1, metrics)
      bar.update(1)
      bar.set_postfix(phase="grpo", reward=f"{reward:.3f}", loss=f"{metrics['loss']:.4f}")
      self._save(step + 1, learner, force=step + 1 == self.total_steps)
      if self._stop(step + 1):
        return step + 1
    source.close()
    engine.update_weights(learner.params, version=cfg.steps)
    self.final_eval = self.evaluate(engine)
    writer.write(self.total_steps, dict(self.final_eval))
    if jax.process_index() == 0:
      hf_io.save_hf_model(learner.model(), self.workdir / "final_model", tokenizer_dir=self.model_dir)
    return self.total_steps

  def _stop(self, step: int) -> bool:
    return self.cfg.stop_after_step is not None and step >= self.cfg.stop_after_step

  # ------------------------------------------------------------------ the run
  def run(self) -> Optional[dict]:
    """Runs (or resumes) to the end; returns the result dict (None if stopped early)."""
    from tqdm import tqdm

    t_start = time.perf_counter()
    start, state = 0, None
    latest = self.ckpt.latest_step()
    if latest is not None:
      like = self._like_state(latest)
      state, extra = self.ckpt.restore(like, latest)
      start = int(extra["step"])
      self.tasks.set_state_bytes(base64.b64decode(extra["tasks_state"]))
      self.rewards = list(extra["rewards"])
      self.heldout_before = extra["heldout_before"]
      self._source_state = extra.get("rollouts")
      self.log(f"resumed from {self.ckpt.directory}/{latest} (step {start})")
    writer = MetricsWriter(self.workdir, resume_step=start if latest is not None else None)
    (self.workdir / "config.json").write_text(json.dumps(to_dict(self.cfg), indent=1))
    bar = tqdm(total=self.total_steps, initial=start, desc="train", dynamic_ncols=True,
               disable=jax.process_index() != 0)
    try:
      step = start
      if step < self.cfg.sft.steps:
        step = self._sft(step, state, bar, writer)
        state = None
        if step < self.cfg.sft.steps or self._stop(step):
          return None
      elif step == self.cfg.sft.steps:
        state = None  # a boundary checkpoint holds SFT state; GRPO starts from sft_model
      step = self._rl(step, state, bar, writer)
      if step < self.total_steps:
        return None
    finally:
      if self._source is not None:
        self._source.close()
      if hasattr(self._engine_obj, "close"):
        self._engine_obj.close()  # vLLM: stop its engine-core process now, not at interpreter exit
      bar.close()
      self.ckpt.wait()
      writer.close()
    return self._finish(time.perf_counter() - t_start)

  def _like_state(self, step: int):
    """A TrainState of the right structure/shardings for the phase `step` belongs to."""
    cfg = self.cfg
    if step <= cfg.sft.steps and cfg.sft.steps:
      return Learner(self._load(self.model_dir), cfg.sft.learner, mesh=self.mesh).state
    base = self.sft_dir if cfg.sft.steps > 0 else self.model_dir
    return Learner(self._load(base), cfg.rl.learner, cfg.loss_config(), mesh=self.mesh).state

  def _finish(self, seconds: float) -> dict:
    rows = read_metrics(self.workdir / "metrics.jsonl") if (self.workdir / "metrics.jsonl").exists() else []
    if jax.process_index() == 0 and rows:
      plot_run(rows, self.workdir / "plot.png")
    r = self.rewards
    result = {
        "heldout_before": self.heldout_before.get("eval/accuracy", float("nan")),
        "heldout_after": self.final_eval.get("eval/accuracy", float("nan")),
        "heldout_greedy_before": self.heldout_before.get("eval/accuracy_greedy", float("nan")),
        "heldout_greedy_after": self.final_eval.get("eval/accuracy_greedy", float("nan")),
        "reward_first10": float(np.mean(r[:10])) if r else float("nan"),
        "reward_last10": float(np.mean(r[-10:])) if r else float("nan"),
        "minutes": seconds / 60,
    }
    (self.workdir / "result.json").write_text(json.dumps(result, indent=1))
    return result


class _DecoderWeights:
  """Engine wrapper: the learner's params dict becomes a Decoder (HF names) for engines
  outside this process."""

  def __init__(self, engine, graphdef):
    self.engine, self.graphdef = engine, graphdef

  @property
  def version(self) -> int:
    return self.engine.version

  def generate(self, *args, **kwargs):
    return self.engine.generate(*args, **kwargs)

  def update_weights(self, params, version: int) -> None:
    self.engine.update_weights(nnx.merge(self.graphdef, params), version)

  def __getattr__(self, name):  # close(), last_weight_sync, ...
    return getattr(self.engine, name)


def _data_hash(task_ids) -> float:
  """A fingerprint of the tasks a step used (logged so resumed runs can be compared)."""
  return float(zlib.crc32("\n".join(task_ids).encode()))


def _fmt(d: dict) -> str:
  return " ".join(f"{k}={v:.4f}" for k, v in d.items())


def result_line(result: dict) -> str:
  keys = ("heldout_before", "heldout_after", "reward_first10", "reward_last10", "minutes")
  return "RESULT " + " ".join(f"{k}={result[k]:.4f}" if k != "minutes" else f"{k}={result[k]:.2f}"
                              for k in keys)
