"""The run: optional SFT warm-start, then GRPO-family RL on graded rollouts, with held-out eval.

    for step in SFT steps:  batch of reference solutions -> learner(sft)
    export the warm-start model (the RL start and the KL reference), then checkpoint
    for step in RL steps:   rl_step (rl_step.py): weights -> rollouts -> advantages -> update

Global step numbering runs through both phases, so one checkpoint series, one metrics file
and one progress bar cover the run. A checkpoint holds the TrainState (and an EMA teacher's
weights), the task iterator's state, the rollout source's state, the running baseline, the
reward history, the held-out "before" accuracy and the config; sampling seeds derive from (seed, step). Resuming therefore
replays exactly the steps an uninterrupted run would take (sync mode).

Resume: the side-car is read first and the config compared with the saved one (fields that
change what the saved state means are refused, the rest are printed); the TrainState is
restored into abstract shapes (no second copy is ever built). The SFT -> RL boundary is atomic:
`sft_model/` is exported before the step-`sft.steps` checkpoint is written, and re-exported from
that checkpoint if it is missing.

With `rl.mode = "async"` an actor pool samples while the learner trains (actors/pool.py): the
batch of a step may come from older policy versions (at most `rl.replay.max_staleness` behind),
corrected off-policy (`rl.async_correction`, TIS by default); the checkpoint also holds the
replay queue and unfinished work (no trajectory lost or trained twice on resume; data order is
not reproduced). `rl.mode = "auto"` starts sync and, after `rl.auto.probe_steps` steps, turns
async only where the measured bound says overlap pays (overlap.py); the log says which mode it
chose and why, the checkpoint keeps the choice, metrics.jsonl's `rl/async` shows it per step.
With several processes it stays sync.

Preemption (`preempt`, a threading.Event: launch/train.py sets it on SIGTERM / SIGINT): the run
stops at the next step boundary (the step in progress is finished), closes the rollout source
(async: in-flight episodes finish within `rl.pool.shutdown_grace_s` and are saved as queued
groups, the rest are cut and saved as unfinished work, re-run on resume), writes a checkpoint
at the current step unless one is there, waits for it, logs "preempted at step k: checkpoint
written, resume with the same command" and returns None (`preempted_at` = k). The resumed run
equals an uninterrupted one bit for bit in sync mode, as any resume does.

Early stops (the config, no code): `eval.target_accuracy` ends RL at the first in-run eval
whose `eval.target_metric` reaches it (that eval is the final one), `train_budget_s` at the
first step boundary with `time/train_s_total` ≥ the budget (then the final eval runs). Either
logs why, checkpoints that step with a `stopped` record and ends with the result as a finished
run does. metrics.jsonl carries `time/train_s_total` (training steps, SFT + RL) and
`time/eval_s_total` (held-out evals), both cumulative and checkpointed, so they continue across a
resume. Resuming a stopped run finishes it again without training, unless the current config
no longer stops there (a higher target, a larger budget): then it trains on and says so.
"""
from __future__ import annotations

import base64
import dataclasses
import json
import math
import pathlib
import threading
import time
import zlib
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain_jax import batching
from posttrain_jax.actors.episode import EpisodeContext, episode_spec
from posttrain_jax.actors.multiturn import demonstration_trajectory, evaluate_episodes_detail
from posttrain_jax.actors.pool import AsyncRollouts
from posttrain_jax.actors.rollout import SyncRollouts, draw_task, encode_messages, encode_prompt
from posttrain_jax.byoh.online import OnlineServer
from posttrain_jax.byoh.trace_source import TraceRollouts
from posttrain_jax.advantages import BaselineState
from posttrain_jax.checkpoint import Checkpointer, crash_point
from posttrain_jax.config_io import ConfigTypeError, to_dict
from posttrain_jax.engines.base import EngineError, SamplingParams
from posttrain_jax.engines.registry import EngineContext, engine_spec
from posttrain_jax.envs import GraderError, TaskBank, make_grader, solution_text
from posttrain_jax.envs.env import EnvInfraError
from posttrain_jax.errors import DiskWriteError, disk_cause, disk_errno, disk_fix, free_note
from posttrain_jax.learner import Learner, abstract_train_state
from posttrain_jax.losses import get_loss
from posttrain_jax.metrics import MetricsWriter, plot_run, read_metrics
from posttrain_jax.models import hf_io
from posttrain_jax.models.tiny import build_tiny_model
from posttrain_jax import overlap
from posttrain_jax.multihost import all_gather_json, mean_over_processes, share
from posttrain_jax.rl_step import rl_step
from posttrain_jax.run_config import RunConfig, run_config_from_dict
from posttrain_jax.sharding import make_mesh
from posttrain_jax.teacher import (FIELDS as TEACHER_FIELDS, SelfTeacher, TeacherModel,
                                   check_teacher_checkpoint)

# Config fields whose change makes a checkpoint mean something else: resuming is refused.
_FIXED_ON_RESUME = ("seed", "model", "tasks", "sft.steps", "sft.batch_size", "sft.answer_style",
                    "rl.mode", "rl.rollout.group_size", "rl.prompts_per_step",
                    "rl.learner.loss", "rl.advantage.estimator", "rl.teacher.weights",
                    "rl.teacher.checkpoint", "mesh")


class Trainer:
  """Wires the parts of a RunConfig together and runs it (resuming from the workdir)."""

  def __init__(self, cfg: RunConfig, log=None, preempt: Optional[threading.Event] = None):
    """`preempt`: once set, the run checkpoints at the next step boundary and stops."""
    from tqdm import tqdm
    self.cfg = cfg
    self.preempt = preempt
    self.preempted_at: Optional[int] = None   # the step a preempted run checkpointed and stopped
    self.log = log or tqdm.write   # a line above the progress bar, not inside it
    self.workdir = pathlib.Path(cfg.workdir)
    self.model_dir = (pathlib.Path(cfg.model.path) if cfg.model.path
                      else build_tiny_model(cfg.model.tiny))
    self.tokenizer = hf_io.load_tokenizer(self.model_dir)
    self.model_cfg = hf_io.read_model_config(self.model_dir)
    eos = self.model_cfg.eos_token_id
    self.stop_ids = tuple(eos) if isinstance(eos, tuple) else ((eos,) if eos is not None else ())
    if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in self.stop_ids:
      self.stop_ids = (self.tokenizer.eos_token_id,) + self.stop_ids
    self._multi_turn = cfg.rl.episode == "env"
    # Checked before anything runs: an engine that cannot start fails now, not after SFT.
    self.engine_spec = engine_spec(cfg.rl.engine)
    self.engine_cfg = cfg.engine_config()
    if cfg.rl.steps and self.engine_spec.check is not None:
      self.engine_spec.check(self.engine_cfg, self.model_cfg,
                             (cfg.episode_config().turn_max_tokens if self._multi_turn
                              else max(cfg.rl.rollout.max_tokens, cfg.eval.max_tokens)))
    self.loss_cfg = cfg.loss_config()
    distill = cfg.rl.steps and get_loss(cfg.rl.learner.loss).needs(self.loss_cfg) & TEACHER_FIELDS
    if distill and cfg.rl.teacher.weights == "checkpoint":  # another model: it must fit, now
      check_teacher_checkpoint(cfg.rl.teacher.checkpoint, self.model_cfg.vocab_size,
                               self.tokenizer)
    self.mesh = make_mesh(cfg.mesh)
    tasks_cfg = dataclasses.replace(cfg.tasks, process_index=jax.process_index(),
                                    process_count=jax.process_count())
    self.bank = TaskBank(tasks_cfg)
    self._check_data_budget()
    self.tasks = self.bank.iterator()
    self.held_out = self.bank.eval_tasks(shard=jax.process_count() > 1)
    self._check_processes()
    self.grader = make_grader(cfg.grader, cfg.grader_cfg())
    try:
      self.workdir.mkdir(parents=True, exist_ok=True)  # after the checks: a bad config leaves none
    except OSError as e:
      code = disk_errno(e)
      raise DiskWriteError(f"cannot use workdir {self.workdir}: {disk_cause(code)}"
                           f"{free_note(code, self.workdir)}; {disk_fix(code, self.workdir)}",
                           code) from e
    self.ckpt = Checkpointer(self.workdir / "checkpoints", cfg.checkpoint)
    self.sft_dir = self.workdir / "sft_model"
    self.total_steps = cfg.sft.steps + cfg.rl.steps
    self.end_step = self.total_steps           # earlier when the run stopped at a target / budget
    self.stopped: Optional[dict] = None        # {"reason", "step", ...} of such a stop
    self.train_s = 0.0                         # time/train_s_total: seconds in training steps
    self.eval_s = 0.0                          # time/eval_s_total: seconds in held-out evals
    self.rewards: list[float] = []
    self.heldout_before: Optional[dict] = None
    self.baseline = BaselineState()
    self.shapes = batching.ShapeReuse(cfg.rl.batch.shape_slack)  # the RL step's compiled shapes
    self.auto: Optional[dict] = None          # rl.mode="auto": the mode chosen, why, the figures
    self._probe: list[tuple[float, float]] = []  # auto: (generate_s, train_s) of probe steps
    self._source = None                       # the RL phase's rollout source (sync or async)
    self._teacher_obj: Optional[SelfTeacher] = None  # the RL phase's teacher (its EMA is saved)
    self._engine_obj = None                   # the RL phase's engine (closed at the end)
    self._source_state: Optional[dict] = None  # its checkpointed state, restored when it starts
    self._drawn = 0                            # SFT tasks drawn (for the exhausted-data message)
    self._saved: Optional[int] = None          # the step of the last checkpoint (written or read)
    self._writer: Optional[MetricsWriter] = None

  # ------------------------------------------------------------------ checks
  def _check_processes(self) -> None:
    """Several processes (a multi-host job): every global count in the config is split evenly,
    each process feeding its share (the same config trains on the same global batch on any
    number of processes), and the embedded sampler, whose decode is a collective of the whole
    job, serves only what every process calls in step: synchronous single-turn rollouts."""
    cfg, n = self.cfg, jax.process_count()
    local = lambda b, name: dataclasses.replace(  # noqa: E731
        b, rows=share(b.rows, f"{name}.rows"), max_seqs=share(b.max_seqs, f"{name}.max_seqs"))
    self.sft_batch_size, self.sft_batch = cfg.sft.batch_size, cfg.sft.batch
    self.prompts_per_step, self.rl_batch = cfg.rl.prompts_per_step, cfg.rl.batch
    if n == 1:
      return
    if cfg.sft.steps:
      self.sft_batch_size = share(cfg.sft.batch_size, "sft.batch_size")
      self.sft_batch = local(cfg.sft.batch, "sft.batch")
    if cfg.rl.steps:
      self.prompts_per_step = share(cfg.rl.prompts_per_step, "rl.prompts_per_step")
      self.rl_batch = local(cfg.rl.batch, "rl.batch")
      if cfg.rl.mode == "traces":   # every process would read, and train on, every session
        raise ConfigTypeError(f"rl.mode='traces' runs in one process (got {n}): the trace "
                              "store is not sharded between processes")
      if cfg.rl.engine == "fleet":   # each process would push its weights to every server
        raise ConfigTypeError(f"rl.engine='fleet' is driven by a one-process learner (got {n}): "
                              "each process would push weights to, and route over, every server")
      if cfg.rl.engine == "jax" and (cfg.rl.mode not in ("sync", "auto") or self._multi_turn):
        raise ConfigTypeError(
            f"rl.engine='jax' with {n} processes serves rl.mode='sync' single-turn rollouts only "
            f"(got rl.mode={cfg.rl.mode!r}, rl.episode={cfg.rl.episode!r}): its decode is one "
            "program of the whole job; use rl.engine='vllm' or 'openai' (an engine per process)")

  def _check_data_budget(self) -> None:
    """A finite task bank must hold the tasks the run draws (async may draw a few more)."""
    cfg = self.cfg
    if self.bank.endless or cfg.tasks.num_epochs is None:
      return
    have = len(self.bank.dataset())
    rl_draws = cfg.rl.steps * _drawn_per_step(cfg.rl, cfg.rl.prompts_per_step)
    need = cfg.sft.steps * cfg.sft.batch_size + rl_draws
    if need > have:
      raise ConfigTypeError(
          f"config.tasks.num_epochs={cfg.tasks.num_epochs}: the task bank yields {have} tasks "
          f"but the run draws {need} (sft.steps × sft.batch_size + rl.steps × "
          f"rl.prompts_per_step); raise num_epochs, set it to None to cycle, or train fewer steps")

  def _check_resume_config(self, saved: Optional[dict]) -> None:
    if not saved:
      return
    now = to_dict(self.cfg)
    diffs = _diff(saved, now)
    fixed = [d for d in diffs if any(d == f or d.startswith(f + ".") for f in _FIXED_ON_RESUME)]
    if fixed:
      raise ConfigTypeError(
          f"the checkpoint in {self.ckpt.directory} was written with a different "
          f"{', '.join(fixed)} (saved vs now: "
          + "; ".join(f"{d}: {_get(saved, d)!r} vs {_get(now, d)!r}" for d in fixed)
          + "); resume with the saved values or start over with --noresume")
    benign = [d for d in diffs if d not in fixed and d not in ("workdir", "stop_after_step")]
    if benign:
      self.log("resuming with a changed config: " + "; ".join(
          f"{d}: {_get(saved, d)!r} -> {_get(now, d)!r}" for d in benign))

  # ------------------------------------------------------------------ helpers
  def _overrides(self) -> dict:
    m = self.cfg.model
    return dict(param_dtype=m.param_dtype, compute_dtype=m.compute_dtype, remat=m.remat)

  def _load(self, path) -> "hf_io.Decoder":
    return hf_io.load_hf_model(path, mesh=self.mesh, **self._overrides())

  def _learner(self, base: pathlib.Path, learner_cfg, loss_cfg=None,
               restore_step: Optional[int] = None) -> Learner:
    """A learner starting from the HF weights in `base`, or from checkpoint `restore_step`
    (restored into abstract shapes: no initial state is built beside it)."""
    if restore_step is None:
      return Learner(self._load(base), learner_cfg, loss_cfg, mesh=self.mesh)
    model = hf_io.abstract_model(hf_io.read_model_config(base, **self._overrides()), self.mesh)
    state, _ = self.ckpt.restore(abstract_train_state(model, learner_cfg, self.mesh),
                                 restore_step)
    return Learner(model, learner_cfg, loss_cfg, mesh=self.mesh, state=state)

  def _extra(self, step: int) -> dict:
    return {"step": step, "tasks_state": base64.b64encode(self.tasks.get_state_bytes()).decode(),
            "rewards": self.rewards, "heldout_before": self.heldout_before,
            "rollouts": self._source.state() if self._source is not None else self._source_state,
            "baseline": {"task_means": dict(self.baseline.task_means),
                         "global_mean": self.baseline.global_mean},
            "shapes": self.shapes.state(),
            "auto": self.auto,
            "metrics_rows": self._writer.rows if self._writer is not None else None,
            "time_totals": {"train_s": self.train_s, "eval_s": self.eval_s},
            "stopped": self.stopped,
            "config": to_dict(self.cfg)}

  def _save(self, step: int, learner: Learner, force: bool = False) -> None:
    if force or self.ckpt.should_save(step):
      t = self._teacher_obj
      arrays = ({"teacher": t.ema_params} if t is not None and t.cfg.weights == "ema" else None)
      self.ckpt.save(step, learner.state, self._extra(step), arrays=arrays)
      self._saved = step

  def _timed_eval(self, engine, learner: Optional[Learner] = None,
                  version: Optional[int] = None) -> dict[str, float]:
    """`evaluate` (after syncing the learner's weights at `version`, when given), its seconds
    added to `time/eval_s_total`."""
    t0 = time.perf_counter()
    out = self._eval_or_report(engine, learner, version)
    self.eval_s += time.perf_counter() - t0
    out.update({"time/eval_s_total": self.eval_s, "time/train_s_total": self.train_s})
    return out

  def _eval_or_report(self, engine, learner: Optional[Learner], version: Optional[int]
                      ) -> dict[str, float]:
    """`evaluate`, retried with `rl.retry`'s backoff when our side fails (an EngineError: the
    engine or its weight sync; EnvInfraError: a tool backend or sandbox). When every attempt
    fails, or a grader cannot read a held-out task's reference (GraderError: retrying would not
    help), the eval is *reported*, not raised: its accuracies are NaN, `eval/failed` = 1, a log
    line says why, and the run that trained for hours goes on. `eval/retries` counts the
    attempts that failed (present when > 0). Any other exception is a bug and propagates."""
    retry, errors = self.cfg.rl.retry, []
    for attempt in range(retry.max_retries + 1):
      if attempt:
        time.sleep(retry.delay(attempt))
      try:
        if learner is not None:
          engine.update_weights(learner.params, version=version)
        out = self.evaluate(engine)
        return {**out, "eval/retries": float(attempt)} if attempt else out
      except (EngineError, EnvInfraError) as e:
        errors.append(f"{type(e).__name__}: {e}")
        self.log(f"held-out eval attempt {attempt + 1}/{retry.max_retries + 1} failed: {errors[-1]}")
      except GraderError as e:
        errors.append(f"{type(e).__name__}: {e}")
        break
    ev = self.cfg.eval
    names = ((["accuracy"] if ev.sampled else []) + (["accuracy_greedy"] if ev.greedy else []))
    self.log(f"held-out eval FAILED after {len(errors)} attempt(s), reported as NaN, training "
             f"goes on: {errors[-1]}")
    return {**{f"eval/{n}": float("nan") for n in names}, "eval/failed": 1.0,
            "eval/retries": float(len(errors))}

  def evaluate(self, engine) -> dict[str, float]:
    """Mean reward on the held-out tasks: sampled at the policy temperature, and greedy."""
    ev = self.cfg.eval
    out = {}
    modes = [("accuracy", ev.temperature, ev.samples_per_prompt)] if ev.sampled else []
    if ev.greedy:
      modes.append(("accuracy_greedy", 0.0, 1))
    if self._multi_turn:  # whole episodes on the held-out tasks (the env's reward)
      episode = self._episode(engine)
      for name, temp, n in modes:
        d = evaluate_episodes_detail(episode, self.held_out, temp, n, seed=12345)
        out[f"eval/{name}"] = _job_mean(d["accuracy"], len(self.held_out))
        for k in ("timeout_frac", "infra_error_frac"):  # why an eval reads low
          out[f"eval/{name}/{k}"] = _job_mean(d[k], len(self.held_out))
      return out
    prompts = [encode_prompt(self.tokenizer, t) for t in self.held_out]
    for name, temp, n in modes:
      sp = SamplingParams(max_tokens=ev.max_tokens, temperature=temp, stop_token_ids=self.stop_ids)
      groups = engine.generate(prompts, sp, n=n, seed=12345)
      rewards = [self.grader(self.tokenizer.decode(c.token_ids, skip_special_tokens=True), t).reward
                 for comps, t in zip(groups, self.held_out) for c in comps]
      out[f"eval/{name}"] = _job_mean(float(np.mean(rewards)) if rewards else float("nan"),
                                      len(rewards))
    return out

  def _engine(self, learner: Learner, base: pathlib.Path):
    """An engine of `rl.engine` serving `base` (the RL start) at version 0."""
    max_prompt, max_tokens = self._engine_limits()
    ctx = EngineContext(model_dir=base, model_config=self.model_cfg, model=learner.model(),
                        graphdef=learner.graphdef, max_prompt_len=max_prompt,
                        max_tokens=max_tokens, pad_id=self.tokenizer.pad_token_id or 0)
    return self.engine_spec.build(self.engine_cfg, ctx)

  def _engine_limits(self) -> tuple[int, int]:
    """(longest prompt, most new tokens) an engine must serve in this run."""
    if self._multi_turn:
      ep = self.cfg.episode_config()
      return ep.max_context_tokens - ep.turn_max_tokens, ep.turn_max_tokens
    max_prompt = max([len(encode_prompt(self.tokenizer, t)) for t in self.held_out[:64]] + [64])
    return max_prompt, max(self.cfg.rl.rollout.max_tokens, self.cfg.eval.max_tokens)

  def _episode(self, engine):
    """An episode of `rl.episode` (single-turn tasks by default) on `engine`."""
    ctx = EpisodeContext(engine=engine, tokenizer=self.tokenizer, grader=self.grader,
                         rollout=self.cfg.rl.rollout, stop_token_ids=self.stop_ids)
    return episode_spec(self.cfg.rl.episode).build(self.cfg.episode_config(), ctx)

  def _mode(self) -> str:
    """The rollout mode the RL phase runs in now: rl.mode, or what "auto" chose (sync until
    it has chosen)."""
    if self.cfg.rl.mode != "auto":
      return self.cfg.rl.mode
    return self.auto["mode"] if self.auto is not None else "sync"

  def _rollout_source(self, learner: Learner, engine, base: pathlib.Path, mode: str):
    cfg = self.cfg.rl
    if mode == "traces":
      self.log(f"training on graded sessions of {cfg.traces.store.path}: off-policy correction "
               f"{getattr(self.loss_cfg, 'correction', 'none')!r} against the recorded "
               "behaviour log-probs")
      if not cfg.traces.online.enabled:
        return TraceRollouts(cfg.traces, self.prompts_per_step, engine=engine)
      # online: a serving engine of its own, on a copy of the weights (the learner donates its
      # buffers while the server samples), swapped every step
      serving = self._engine(learner, base) if not self.engine_spec.shareable else engine
      copy = not self.engine_spec.copies_weights
      if copy:
        serving.update_weights(jax.tree.map(jnp.copy, learner.params), 0)
      server = OnlineServer(cfg.traces.online, serving, self.tokenizer, self.stop_ids,
                            cfg.traces.store)
      self.log(f"online: serving the policy at {server.url}, weights swapped every step")
      return TraceRollouts(cfg.traces, self.prompts_per_step, engine=serving, copy_weights=copy,
                           server=server)
    if mode == "async":  # an engine that is not shareable gets a second instance
      pool_engine = engine if self.engine_spec.shareable else self._engine(learner, base)
      episode = self._episode(pool_engine)
      self.log(f"async rollouts: off-policy correction "
               f"{getattr(self.loss_cfg, 'correction', 'none')!r} on samples up to "
               f"{cfg.replay.max_staleness} versions stale (rl.async_correction)")
      return AsyncRollouts(episode, self.tasks, cfg.rollout.group_size, self.prompts_per_step,
                           seed=self.cfg.seed, replay=cfg.replay, pool=cfg.pool, retry=cfg.retry,
                           copy_weights=not self.engine_spec.copies_weights)
    return SyncRollouts(self._episode(engine), self.tasks, cfg.rollout.group_size,
                        _drawn_per_step(cfg, self.prompts_per_step), seed=self.cfg.seed,
                        retry=cfg.retry)

  def _auto_probe(self, version: int, metrics: dict, out, learner: Learner, engine,
                  base: pathlib.Path, source):
    """rl.mode="auto": records a probe step's times; after `rl.auto.probe_steps` of them (the
    first step, which compiles, left out) measures the overlap and picks the mode for the rest
    of the run (overlap.py). Returns the rollout source to go on with."""
    auto = self.cfg.rl.auto
    if version == 0 or not out.updated:
      return source
    self._probe.append((metrics["time/generate_s"], metrics["time/train_s"]))
    if len(self._probe) < auto.probe_steps:
      return source
    g, t = (float(x) for x in np.median(self._probe, axis=0))   # a step that compiled is out
    rl = self.cfg.rl
    if jax.process_count() > 1:
      d = overlap.Decision("sync", f"{jax.process_count()} processes: rl.mode='async' runs in "
                           "one process", 0.0, g + t, g + t)
    elif rl.replay.min_scored > rl.rollout.group_size:
      d = overlap.Decision("sync", f"async would drop every group: rl.replay.min_scored="
                           f"{rl.replay.min_scored} > rl.rollout.group_size="
                           f"{rl.rollout.group_size}", 0.0, g + t, g + t)
    else:
      sp = self.cfg.rl.rollout.sampling(self.stop_ids)   # the rollouts' (a turn's, multi-turn)
      turn = getattr(self.cfg.episode_config(), "turn_max_tokens", None)
      sp = sp if turn is None else dataclasses.replace(sp, max_tokens=turn)
      prompts = [encode_prompt(self.tokenizer, task) for task in out.tasks]
      # the engine still holds the weights the step's update donated: give it the new ones,
      # as the next step would first (a server engine syncs them once more then)
      source.update_weights(learner.params, version=version + 1)
      n = self.cfg.rl.rollout.group_size
      g1, f, b, k = overlap.measure(lambda: engine.generate(prompts, sp, n=n, seed=version),
                                 lambda: learner.logprobs(out.batch))
      d = overlap.decide(overlap.Probe(g, t, f, g1, b, k), auto.min_gain)
    self.auto = {**d.to_dict(), "version": version + 1}
    self.log(f"rl.mode=auto: {d.mode} from version {version + 1} on: {d.why}")
    if d.mode == "sync":
      return source
    # turn async: the correction for stale samples, and a pool continuing the draws
    if rl.oversample > 0:
      self.log(f"rl.oversample={rl.oversample} applies to sync steps only: the pool draws "
               f"{self.prompts_per_step} tasks a step, filtered by rl.replay.filter="
               f"{rl.replay.filter!r}")
    self.loss_cfg = self.cfg.loss_config("async")
    learner.set_loss_config(self.loss_cfg)
    draw, requeued = source.state()["next_draw"], list(source._requeued)
    source.close()
    new = self._source = self._rollout_source(learner, engine, base, "async")
    new.start_at(draw, requeued)
    return new

  # ------------------------------------------------------------------ phases
  def _sft(self, start: int, resume: bool, bar, writer) -> int:
    cfg = self.cfg.sft
    learner = self._learner(self.model_dir, cfg.learner, restore_step=start if resume else None)
    eos = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
    if self._preempted(start, learner):
      return start
    for step in range(start, cfg.steps):
      t0 = time.perf_counter()
      trajs = []
      for i in range(self.sft_batch_size):
        task = draw_task(self.tasks, step * self.sft_batch_size + i)
        if self._multi_turn:  # the environment's gold chat, stitched like an episode
          trajs.append(demonstration_trajectory(self.tokenizer, task, self.cfg.episode_config(),
                                                self.stop_ids, f"sft{step}/{i}"))
          continue
        answer = self.tokenizer.encode(solution_text(task, cfg.answer_style), add_special_tokens=False)
        trajs.append(batching.sft_trajectory(encode_prompt(self.tokenizer, task), answer + eos,
                                             f"sft{step}/{i}", task.id))
      metrics = learner.step(batching.build_batch(trajs, [0.0] * len(trajs), self.sft_batch))
      metrics = {f"sft/{k}": v for k, v in metrics.items()}
      metrics["data/hash"] = _data_hash([t.task_id for t in trajs])
      metrics["time/step_s"] = time.perf_counter() - t0
      self.train_s += metrics["time/step_s"]
      metrics["time/train_s_total"] = self.train_s
      writer.write(step + 1, metrics)
      bar.update(1)
      bar.set_postfix(phase="sft", loss=f"{metrics['sft/loss']:.3f}")
      if step + 1 == cfg.steps:
        self._export_sft(learner)  # before the boundary checkpoint: the boundary is atomic
        crash_point("export", step + 1)
      if self._preempted(step + 1, learner):
        return step + 1
      self._save(step + 1, learner, force=step + 1 == cfg.steps)
      if self._stop(step + 1):
        return step + 1
    return cfg.steps

  def _export_sft(self, learner: Learner) -> None:
    hf_io.save_hf_model(learner.model(), self.sft_dir, tokenizer_dir=self.model_dir)

  def _ensure_sft_model(self) -> None:
    """At the boundary: re-export sft_model/ from the step-`sft.steps` checkpoint if missing."""
    if (self.sft_dir / "config.json").exists():
      return
    steps = self.cfg.sft.steps
    if self.ckpt.latest_step() != steps:
      raise FileNotFoundError(f"{self.sft_dir} is missing and there is no step-{steps} "
                              f"checkpoint in {self.ckpt.directory} to export it from")
    self.log(f"re-exporting {self.sft_dir} from checkpoint {steps}")
    self._export_sft(self._learner(self.model_dir, self.cfg.sft.learner, restore_step=steps))

  def _rl(self, start: int, resume: bool, bar, writer) -> int:
    cfg = self.cfg.rl
    base = self.sft_dir if self.cfg.sft.steps > 0 else self.model_dir
    learner = self._learner(base, cfg.learner, self.loss_cfg,
                            restore_step=start if resume else None)
    reference = None  # the warm-start weights: a loss term needs them, or a KL is reported
    if "ref_logp" in learner.spec.needs(self.loss_cfg) or cfg.reference_kl:
      reference = self._start_params(learner, resume, base)
    teacher = self._teacher_obj = self._teacher(learner, start if resume else None, reference,
                                                base)
    engine = self._engine_obj = self._engine(learner, base)
    source = self._source = self._rollout_source(learner, engine, base, self._mode())
    if self._source_state:
      source.restore(self._source_state)
    if self.heldout_before is None:
      self.heldout_before = self._timed_eval(engine)
      writer.write(start, dict(self.heldout_before))
      self.log(f"held-out before RL: {_fmt(self.heldout_before)}")
    sft_steps = self.cfg.sft.steps
    if self._preempted(start, learner):
      return start
    for step in range(start, self.end_step):
      version = step - sft_steps
      t0 = time.perf_counter()
      out = rl_step(learner, source, step=step, version=version, advantage=cfg.advantage,
                    batch_cfg=self.rl_batch, update_epochs=cfg.update_epochs,
                    baseline=self.baseline, reference=reference, teacher=teacher,
                    shapes=self.shapes,
                    train_groups=(self.prompts_per_step if cfg.oversample > 0
                                  and self._mode() == "sync" else None))
      self.baseline = out.baseline if out.baseline is not None else self.baseline
      metrics = mean_over_processes(out.metrics)   # each process's rollouts; one row
      if cfg.mode == "auto":
        metrics["rl/async"] = float(self._mode() == "async")
        if self.auto is None:
          source = self._auto_probe(version, metrics, out, learner, engine, base, source)
      self.rewards.append(metrics["reward/mean"])
      step_s = time.perf_counter() - t0
      self.train_s += step_s
      metrics.update({"time/step_s": step_s, "time/train_s_total": self.train_s,
                      "policy_version": version + 1,
                      "data/hash": _data_hash([t.id for t in out.tasks])})
      evaluated = None
      if self.cfg.eval.every_steps and (version + 1) % self.cfg.eval.every_steps == 0 \
          and step + 1 < self.total_steps:
        evaluated = self._timed_eval(engine, learner, version + 1)
        metrics.update(evaluated)
      self.stopped = self._stop_reason(step + 1, evaluated)
      writer.write(step + 1, metrics)
      bar.update(1)
      bar.set_postfix(phase="rl", reward=f"{metrics['reward/mean']:.3f}",
                      loss=f"{metrics.get('loss', float('nan')):.4f}")
      if self.stopped is not None:
        self.end_step = step + 1
        self.log(self._stop_note())
      if self._preempted(step + 1, learner):
        return step + 1
      self._save(step + 1, learner, force=step + 1 == self.end_step)
      if self.stopped is not None:
        break
      if self._stop(step + 1):
        return step + 1
    source.close()
    if self.stopped is not None and self.stopped.get("eval"):
      self.final_eval = dict(self.stopped["eval"])   # the eval that reached the target: its row is written
    else:
      self.final_eval = self._timed_eval(engine, learner, self.end_step - sft_steps)
      writer.write(self.end_step, dict(self.final_eval))
    hf_io.save_hf_model(learner.model(), self.workdir / "final_model", tokenizer_dir=self.model_dir)
    return self.end_step

  def _stop_reason(self, step: int, evaluated: Optional[dict]) -> Optional[dict]:
    """The `stopped` record when the run ends early at `step` (after its in-run eval, if any)."""
    ev, budget = self.cfg.eval, self.cfg.train_budget_s
    if evaluated is not None and ev.target_accuracy is not None:
      value = evaluated.get(f"eval/{ev.target_metric}")
      if value is not None and value >= ev.target_accuracy:
        return {"reason": "target", "step": step, "metric": ev.target_metric, "value": value,
                "target": ev.target_accuracy, "eval": evaluated}
    if budget is not None and self.train_s >= budget:
      return {"reason": "budget", "step": step, "train_s": self.train_s, "budget_s": budget}
    return None

  def _stop_note(self) -> str:
    s = self.stopped
    if s["reason"] == "target":
      return (f"stopped at step {s['step']}: held-out {s['metric']} {s['value']:.4f} reached "
              f"eval.target_accuracy={s['target']} after {self.train_s:.1f} s of training")
    return (f"stopped at step {s['step']}: {s['train_s']:.1f} s of training reached "
            f"train_budget_s={s['budget_s']}")

  def _resume_stop(self, saved: Optional[dict]) -> None:
    """A checkpoint of a stopped run: keep its end if the current config stops there too."""
    if not saved:
      return
    ev, budget = self.cfg.eval, self.cfg.train_budget_s
    holds = (saved["reason"] == "target" and ev.target_accuracy is not None
             and saved["metric"] == ev.target_metric and saved["value"] >= ev.target_accuracy) or (
        saved["reason"] == "budget" and budget is not None and self.train_s >= budget)
    if holds:
      self.stopped, self.end_step = saved, int(saved["step"])
      self.log(f"the run had stopped at step {saved['step']} ({saved['reason']}): finishing it")
    else:
      self.log(f"the run had stopped at step {saved['step']} ({saved['reason']}); the config no "
               "longer stops there: training on")

  def _start_params(self, learner: Learner, resume: bool, base: pathlib.Path):
    """The RL start weights: a fresh learner holds them, so they are copied (it donates its own
    buffers); a resumed one holds trained weights, so they are read again from `base`."""
    if not resume:
      return jax.tree.map(jnp.copy, learner.state.params)
    return nnx.to_pure_dict(nnx.state(self._load(base), nnx.Param))

  def _teacher(self, learner: Learner, restore_step: Optional[int], reference,
               base) -> Optional[SelfTeacher]:
    """The distillation teacher when the loss reads a teacher field (teacher.py), else None.
    Resumed (`restore_step`): an EMA is restored from that checkpoint, a frozen teacher's start
    weights are read again, another checkpoint is loaded again."""
    if not learner.spec.needs(self.loss_cfg) & TEACHER_FIELDS:
      return None
    cfg = self.cfg.rl.teacher
    resume = restore_step is not None
    ema, model = None, None
    if cfg.weights == "ema" and resume:
      if not self.ckpt.has_arrays(restore_step, "teacher"):
        raise ConfigTypeError(
            f"checkpoint {self.ckpt.directory}/{restore_step} holds no EMA teacher (it was "
            "written with another rl.teacher.weights); resume with the saved value or start "
            "over with --noresume")
      ema = self.ckpt.restore_arrays("teacher", learner.params, restore_step)
    elif cfg.weights in ("ema", "frozen"):  # the RL start weights (the reference's, if any)
      ema = (reference if cfg.weights == "frozen" and reference is not None
             else self._start_params(learner, resume, base))
    elif cfg.weights == "checkpoint":       # checked in __init__; sharded like the learner
      model = TeacherModel(self._load(cfg.checkpoint), learner.cfg, learner.put_batch)
    return SelfTeacher(cfg, lambda msgs, tools: encode_messages(self.tokenizer, msgs, tools),
                       self.rl_batch, ema_params=ema, model=model)

  def _stop(self, step: int) -> bool:
    return self.cfg.stop_after_step is not None and step >= self.cfg.stop_after_step

  def _preempted(self, step: int, learner: Optional[Learner]) -> bool:
    """At a step boundary (`step` steps done, before its regular save): if preemption was asked
    for, stop the rollout source, then make sure a finished checkpoint of `step` exists (the
    source's state is taken after it stopped), say so, and return True."""
    if self.preempted_at is not None:
      return True
    if self.preempt is None or not self.preempt.is_set():
      return False
    if self._source is not None:
      self._source.close()    # async: episodes in flight finish (grace) or go back to the backlog
    if self._saved != step:   # (learner None only where the step was just saved)
      self._save(step, learner, force=True)
    self.ckpt.wait()
    self.preempted_at = step
    note = ""
    if isinstance(self._source, AsyncRollouts):
      q = self._source.queue.state()
      note = (f" ({len(q['ready'])} finished groups saved, {len(q['backlog'])} unfinished "
              "tasks saved to re-run)")
    self.log(f"preempted at step {step}: checkpoint written, resume with the same "
             f"command{note}")
    return True

  # ------------------------------------------------------------------ the run
  def run(self) -> Optional[dict]:
    """Runs (or resumes) to the end; returns the result dict (None if stopped early)."""
    from tqdm import tqdm

    t_start = time.perf_counter()
    start, rows = 0, None
    latest = self.ckpt.latest_step()
    if latest is not None:
      extra = self.ckpt.read_extra(latest)
      self._check_resume_config(extra.get("config"))
      start = int(extra["step"])
      self.tasks.set_state_bytes(base64.b64decode(extra["tasks_state"]))
      self.rewards = list(extra["rewards"])
      self.heldout_before = extra["heldout_before"]
      self._source_state = extra.get("rollouts")
      b = extra.get("baseline") or {}
      self.baseline = BaselineState(dict(b.get("task_means", {})), b.get("global_mean"))
      self.shapes = batching.ShapeReuse(self.cfg.rl.batch.shape_slack, state=extra.get("shapes"))
      self.auto = extra.get("auto")
      self.loss_cfg = self.cfg.loss_config(self._mode())
      self._saved = start
      rows = extra.get("metrics_rows")   # None in checkpoints written before it was recorded
      totals = extra.get("time_totals") or {}
      self.train_s, self.eval_s = totals.get("train_s", 0.0), totals.get("eval_s", 0.0)
      self._resume_stop(extra.get("stopped"))
      self.log(f"resumed from {self.ckpt.directory}/{latest} (step {start})")
    writer = self._writer = MetricsWriter(
        self.workdir, resume_step=start if latest is not None else None, resume_rows=rows)
    if jax.process_index() == 0:
      (self.workdir / "config.json").write_text(json.dumps(to_dict(self.cfg), indent=1))
    bar = tqdm(total=self.total_steps, initial=start, desc="train", dynamic_ncols=True,
               disable=jax.process_index() != 0)
    try:
      step = start
      if step < self.cfg.sft.steps:
        step = self._sft(step, latest is not None, bar, writer)
        if step < self.cfg.sft.steps or self._stop(step) or self._preempted(step, None):
          return None
      if self.cfg.sft.steps:
        self._ensure_sft_model()
      # a checkpoint at the boundary holds SFT state: RL starts from sft_model/
      step = self._rl(step, latest is not None and start > self.cfg.sft.steps, bar, writer)
      if step < self.end_step or self.preempted_at is not None:
        return None
    finally:
      if self._source is not None:
        self._source.close()
      if hasattr(self._engine_obj, "close"):
        self._engine_obj.close()  # vLLM: stop its engine-core process now, not at interpreter exit
      bar.close()
      try:
        self.ckpt.wait()  # an async save's write error surfaces here...
      finally:
        writer.close()    # ...and the metrics file is still closed
    return self._finish(time.perf_counter() - t_start)

  def _finish(self, seconds: float) -> dict:
    rows = read_metrics(self.workdir / "metrics.jsonl") if (self.workdir / "metrics.jsonl").exists() else []
    if jax.process_index() == 0 and rows:
      plot_run(rows, self.workdir / "plot.png")
    r = [x for x in self.rewards if x == x]
    # heldout_*: the sampled accuracy, or the greedy one in a greedy-only eval (eval.sampled=False)
    key = "eval/accuracy" if self.cfg.eval.sampled else "eval/accuracy_greedy"
    result = {
        "heldout_before": self.heldout_before.get(key, float("nan")),
        "heldout_after": self.final_eval.get(key, float("nan")),
        "heldout_greedy_before": self.heldout_before.get("eval/accuracy_greedy", float("nan")),
        "heldout_greedy_after": self.final_eval.get("eval/accuracy_greedy", float("nan")),
        "reward_first10": float(np.mean(r[:10])) if r else float("nan"),
        "reward_last10": float(np.mean(r[-10:])) if r else float("nan"),
        "minutes": seconds / 60,
        "train_s_total": self.train_s,
        "eval_s_total": self.eval_s,
        "stopped": self.stopped["reason"] if self.stopped else None,
        "steps": self.end_step,
    }
    if jax.process_index() == 0:
      (self.workdir / "result.json").write_text(json.dumps(result, indent=1))
    return result


def _job_mean(mean: float, count: int) -> float:
  """The mean over every process's held-out shard from each one's (mean, count); one process:
  `mean`."""
  if jax.process_count() == 1:
    return mean
  parts = [(m, c) for m, c in all_gather_json([None if mean != mean else mean, count])
           if c and m is not None]
  total = sum(c for _, c in parts)
  return sum(m * c for m, c in parts) / total if total else float("nan")


def _drawn_per_step(rl, prompts: int) -> int:
  """Tasks a sync RL step draws: `prompts`, more with rl.oversample (rl_step.signal_first);
  the 1e-9 keeps float error (50 · (1 + 0.1) = 55.00000000000001) from drawing one more."""
  return math.ceil(prompts * (1 + rl.oversample) - 1e-9) if rl.oversample > 0 else prompts


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


def _data_hash(task_ids) -> float:
  """A fingerprint of the tasks a step used (logged so resumed runs can be compared)."""
  return float(zlib.crc32("\n".join(task_ids).encode()))


def _fmt(d: dict) -> str:
  return " ".join(f"{k}={v:.4f}" for k, v in d.items())


def result_line(result: dict) -> str:
  """`RESULT heldout_before=… … minutes=…`, then `stopped=<target|budget> steps=<k>` for a run
  that ended early."""
  keys = ("heldout_before", "heldout_after", "reward_first10", "reward_last10", "minutes")
  line = "RESULT " + " ".join(f"{k}={result[k]:.4f}" if k != "minutes" else f"{k}={result[k]:.2f}"
                              for k in keys)
  if result.get("stopped"):
    line += f" stopped={result['stopped']} steps={result['steps']}"
  return line


__all__ = ["Trainer", "result_line", "run_config_from_dict"]
