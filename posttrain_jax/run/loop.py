"""The run: optional SFT warm-start, then RL on graded samples, with held-out eval.

    for step in SFT steps:   the episode type's demonstrations -> learner(sft)
    export the warm-start model (the RL start and the KL reference), then checkpoint
    for step in RL steps:    rl_step(learner, source, inputs)           (rl_step.py)
                             source.after_step(result, learner)          (auto: its probe)
                             the loss follows source.off_policy          (a correction)
                             eval every eval.every_steps, stop, save

The loop knows no engine, rollout mode, episode type, teacher or loss by name: each is a
registry entry (engines/registry.py, run/sources/, actors/episode.py, teacher_weights.py,
losses/) that says what the run needs to know of it, and the loss's declared inputs decide
which providers (a reference, a teacher) the run builds (run/inputs.py).

Global step numbering runs through both phases, so one checkpoint series, one metrics file
and one progress bar cover the run. A checkpoint holds the TrainState, a teacher's arrays and
the run state (run/state.py: the task iterator, the rollout source's state, the running
baseline, rewards, the "before" eval, time totals, an early stop, the config); sampling seeds
derive from (seed, step), so a resumed sync run replays exactly the steps an uninterrupted one
takes. Resuming reads the run state first and compares its config (checks.py: fields that
change what the saved state means are refused); the TrainState is restored into abstract
shapes. The SFT -> RL boundary is atomic: `sft_model/` is exported before the step-`sft.steps`
checkpoint is written, and re-exported from that checkpoint if it is missing. At the end the
model goes to `final_model/` (LoRA merged into it) and, with LoRA, its adapters alone to
`final_adapter/` (PEFT's format; base_model_name_or_path: the RL start, `sft_model/` or the
model); per tenant (`lora.tenants`), `final_model/` is the shared base and each tenant's
adapters go to `final_adapter/<tenant>/`.

Preemption (`preempt`, a threading.Event: launch/train.py sets it on SIGTERM / SIGINT): the run
stops at the next step boundary, closes the rollout source (async: in-flight episodes finish
within `rl.pool.shutdown_grace_s` and are saved), writes a checkpoint at the current step unless
one is there, logs "preempted at step k: checkpoint written, resume with the same command" and
returns None (`preempted_at` = k). Early stops (a target accuracy, a training budget): stops.py.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
import threading
import time
import zlib
from typing import TYPE_CHECKING, Callable, Optional

import jax

from posttrain_jax import batching
from posttrain_jax.actors.episode import DemoContext
from posttrain_jax.actors.rollout import draw_task
from posttrain_jax.checkpoint import Checkpointer, crash_point
from posttrain_jax.config_io import to_dict
from posttrain_jax.errors import DiskWriteError, disk_cause, disk_errno, disk_fix, free_note
from posttrain_jax.learner import Learner
from posttrain_jax.metrics import MetricsWriter, plot_run, read_metrics
from posttrain_jax.models import hf_io, peft_io
from posttrain_jax.multihost import mean_over_processes
from posttrain_jax.run import checks, stops
from posttrain_jax.run.evaluation import Evaluator
from posttrain_jax.run.inputs import BatchInputs
from posttrain_jax.run.parts import Parts
from posttrain_jax.run.result import result, result_line
from posttrain_jax.run.rl_step import rl_step
from posttrain_jax.run.state import RunState, encode_task_state

if TYPE_CHECKING:
  from posttrain_jax.run_config import RunConfig

__all__ = ["Trainer", "result_line"]


class Trainer:
  """Wires the parts of a RunConfig together and runs it (resuming from the workdir).
  `wrap_source(source) -> source`: a hook around the RL phase's rollout source (benchmarks
  count what it yields); it must keep the protocol (actors/source.py)."""

  def __init__(self, cfg: RunConfig, log=None, preempt: Optional[threading.Event] = None,
               wrap_source: Optional[Callable] = None):
    from tqdm import tqdm
    self.cfg, self.preempt, self.wrap_source = cfg, preempt, wrap_source
    self.log = log or tqdm.write   # a line above the progress bar, not inside it
    self.preempted_at: Optional[int] = None   # the step a preempted run checkpointed and stopped
    self.workdir = pathlib.Path(cfg.workdir)
    self.parts = parts = Parts(cfg, self.log)   # the checks run here: a bad config fails now
    self.tasks, self.stop_ids, self.tokenizer = parts.tasks, parts.stop_ids, parts.tokenizer
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
    self.state = RunState(config=to_dict(cfg))
    self.shapes = batching.ShapeReuse(cfg.rl.batch.shape_slack)  # the RL step's compiled shapes
    self.evaluate = Evaluator(cfg, parts.episode_spec, parts.episode, parts.held_out, self.log)
    self.engine = self.source = self.inputs = None   # the RL phase's parts
    self.final_eval: dict = {}
    self._saved: Optional[int] = None          # the step of the last checkpoint (written or read)
    self._writer: Optional[MetricsWriter] = None

  @property
  def end_step(self) -> int:
    """The step the run ends at: the last one, or where it stopped early."""
    return int(self.state.stopped["step"]) if self.state.stopped else self.total_steps

  # ------------------------------------------------------------------ the run
  def run(self) -> Optional[dict]:
    """Runs (or resumes) to the end; returns the result dict (None if stopped early)."""
    from tqdm import tqdm
    t_start, latest = time.perf_counter(), self.ckpt.latest_step()
    if latest is not None:
      self._resume(latest)
    writer = self._writer = MetricsWriter(
        self.workdir, resume_step=self.state.step if latest is not None else None,
        resume_rows=self.state.metrics_rows)
    if jax.process_index() == 0:
      (self.workdir / "config.json").write_text(json.dumps(to_dict(self.cfg), indent=1))
    bar = tqdm(total=self.total_steps, initial=self.state.step, desc="train", dynamic_ncols=True,
               disable=jax.process_index() != 0)
    sft_steps = self.cfg.sft.steps
    try:
      step = self.state.step
      if step < sft_steps:
        step = self._sft(step, latest is not None, bar, writer)
        if step < sft_steps or self._stop(step) or self._preempted(step, None):
          return None
      if sft_steps:
        self._ensure_sft_model()
      # a checkpoint at the boundary holds SFT state: RL starts from sft_model/
      step = self._rl(step, latest is not None and step > sft_steps, bar, writer)
      if step < self.end_step or self.preempted_at is not None:
        return None
    finally:
      if self.source is not None:
        self.source.close()
      if hasattr(self.engine, "close"):
        self.engine.close()  # vLLM: stop its engine-core process now, not at interpreter exit
      bar.close()
      try:
        self.ckpt.wait()  # an async save's write error surfaces here...
      finally:
        writer.close()    # ...and the metrics file is still closed
    return self._finish(time.perf_counter() - t_start)

  def _resume(self, latest: int) -> None:
    saved = RunState.from_json(self.ckpt.read_extra(latest))
    checks.check_resume_config(self.cfg, saved.config, self.ckpt.directory, self.log)
    self.tasks.set_state_bytes(saved.task_bytes)
    self.shapes = batching.ShapeReuse(self.cfg.rl.batch.shape_slack, state=saved.shapes)
    self.state = dataclasses.replace(saved, config=to_dict(self.cfg))
    self._saved = saved.step
    if saved.stopped:
      if stops.still_stops(self.cfg, saved.stopped, saved.train_s):
        self.log(f"the run had stopped at step {saved.stopped['step']} "
                 f"({saved.stopped['reason']}): finishing it")
      else:
        self.log(f"the run had stopped at step {saved.stopped['step']} "
                 f"({saved.stopped['reason']}); the config no longer stops there: training on")
        self.state = dataclasses.replace(self.state, stopped=None)
    self.log(f"resumed from {self.ckpt.directory}/{latest} (step {saved.step})")

  # ------------------------------------------------------------------ SFT
  def _sft(self, start: int, resume: bool, bar, writer) -> int:
    cfg, shares = self.cfg.sft, self.parts.shares
    learner = self.parts.learner(self.parts.model_dir, cfg.learner, ckpt=self.ckpt,
                                 restore_step=start if resume else None)
    demo, parts = DemoContext(self.tokenizer, self.stop_ids, cfg.answer_style), self.parts
    if self._preempted(start, learner):
      return start
    for step in range(start, cfg.steps):
      t0 = time.perf_counter()
      trajs = [parts.episode_spec.demonstration(
          parts.episode_cfg, demo, draw_task(self.tasks, step * shares.sft_batch_size + i),
          f"sft{step}/{i}") for i in range(shares.sft_batch_size)]
      metrics = learner.step(batching.build_batch(trajs, [0.0] * len(trajs), shares.sft_batch))
      metrics = {f"sft/{k}": v for k, v in metrics.items()}
      metrics["data/hash"] = _data_hash([t.task_id for t in trajs])
      metrics["time/step_s"] = time.perf_counter() - t0
      self.state = dataclasses.replace(self.state, train_s=self.state.train_s
                                       + metrics["time/step_s"])
      metrics["time/train_s_total"] = self.state.train_s
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
    hf_io.save_hf_model(learner.model(), self.sft_dir, tokenizer_dir=self.parts.model_dir,
                        chat_template=self.parts.chat_template)

  def _ensure_sft_model(self) -> None:
    """At the boundary: re-export sft_model/ from the step-`sft.steps` checkpoint if missing."""
    if (self.sft_dir / "config.json").exists():
      return
    steps = self.cfg.sft.steps
    if self.ckpt.latest_step() != steps:
      raise FileNotFoundError(f"{self.sft_dir} is missing and there is no step-{steps} "
                              f"checkpoint in {self.ckpt.directory} to export it from")
    self.log(f"re-exporting {self.sft_dir} from checkpoint {steps}")
    self._export_sft(self.parts.learner(self.parts.model_dir, self.cfg.sft.learner,
                                        ckpt=self.ckpt, restore_step=steps))

  # ------------------------------------------------------------------ RL
  def _rl(self, start: int, resume: bool, bar, writer) -> int:
    cfg, parts = self.cfg.rl, self.parts
    base = self.sft_dir if self.cfg.sft.steps > 0 else parts.model_dir
    learner = parts.learner(base, cfg.learner, parts.loss_cfg, ckpt=self.ckpt,
                            restore_step=start if resume else None)
    reference = parts.start_params(learner, resume, base) if parts.needs["reference"] else None
    teacher = (parts.teacher(learner, self.ckpt, start if resume else None, reference, base,
                             parts.shares.rl_batch) if parts.needs["teacher"] else None)
    self.inputs = BatchInputs(reference, teacher, cfg.update_epochs)
    engine = self.engine = parts.engine(learner, base)
    source = self.source = parts.source(learner, engine, base, self.wrap_source)
    source.restore(self.state.rollouts or {})
    self._follow(source, learner)
    if self.state.heldout_before is None:
      before = self._timed_eval(engine)
      self.state = dataclasses.replace(self.state, heldout_before=before)
      writer.write(start, dict(before))
      self.log(f"held-out before RL: {_fmt(before)}")
    sft_steps = self.cfg.sft.steps
    if self._preempted(start, learner):
      return start
    for step in range(start, self.end_step):
      version, t0 = step - sft_steps, time.perf_counter()
      out = rl_step(learner, source, step=step, version=version, advantage=cfg.advantage,
                    batch_cfg=parts.shares.rl_batch, baseline=self.state.baseline,
                    inputs=self.inputs, shapes=self.shapes, train_groups=source.train_groups,
                    per_task_baseline=source.repeats_tasks,
                    baseline_key=source.baseline_key)
      source.after_step(out, learner)
      self._follow(source, learner)
      metrics = mean_over_processes(out.metrics)   # each process's rollouts; one row
      step_s = time.perf_counter() - t0
      self.state = dataclasses.replace(
          self.state, baseline=out.baseline, rewards=self.state.rewards + (metrics["reward/mean"],),
          train_s=self.state.train_s + step_s)
      metrics.update({"time/step_s": step_s, "time/train_s_total": self.state.train_s,
                      "policy_version": version + 1,
                      "data/hash": _data_hash([t.id for t in out.tasks])})
      evaluated = None
      if self.cfg.eval.every_steps and (version + 1) % self.cfg.eval.every_steps == 0 \
          and step + 1 < self.total_steps:
        evaluated = self._timed_eval(engine, learner, version + 1)
        metrics.update(evaluated)
      stopped = stops.stop_reason(self.cfg, step + 1, evaluated, self.state.train_s)
      self.state = dataclasses.replace(self.state, stopped=stopped)
      writer.write(step + 1, metrics)
      bar.update(1)
      bar.set_postfix(phase="rl", reward=f"{metrics['reward/mean']:.3f}",
                      loss=f"{metrics.get('loss', float('nan')):.4f}")
      if stopped is not None:
        self.log(stops.stop_note(stopped, self.state.train_s))
      if self._preempted(step + 1, learner):
        return step + 1
      self._save(step + 1, learner, force=step + 1 == self.end_step)
      if stopped is not None:
        break
      if self._stop(step + 1):
        return step + 1
    source.close()
    stopped = self.state.stopped
    if stopped is not None and stopped.get("eval"):
      self.final_eval = dict(stopped["eval"])   # the eval that reached the target: its row is written
    else:
      self.final_eval = self._timed_eval(engine, learner, self.end_step - sft_steps)
      writer.write(self.end_step, dict(self.final_eval))
    hf_io.save_hf_model(learner.shared_model(), self.workdir / "final_model",
                        tokenizer_dir=parts.model_dir, chat_template=parts.chat_template)
    lora = cfg.learner.lora
    for tenant in (learner.tenants or ("",)) if lora.enabled else ():
      if tenant:   # per tenant: final_adapter/<tenant>/
        learner.select(tenant)
      # the adapters alone, in PEFT's format, on top of `base`
      peft_io.save_peft_adapter(learner.model(), self.workdir / "final_adapter" / tenant,
                                alpha=lora.alpha, dropout=lora.dropout,
                                base_model_name_or_path=str(base.resolve()))
    return self.end_step

  def _follow(self, source, learner: Learner) -> None:
    """The loss corrects off-policy samples whenever the source yields them (auto may turn)."""
    learner.set_loss_config(self.cfg.loss_config(off_policy=source.off_policy))

  def _timed_eval(self, engine, learner: Optional[Learner] = None,
                  version: Optional[int] = None) -> dict[str, float]:
    """The held-out eval, its seconds added to `time/eval_s_total`."""
    out, seconds = self.evaluate(engine, learner, version)
    self.state = dataclasses.replace(self.state, eval_s=self.state.eval_s + seconds)
    return {**out, "time/eval_s_total": self.state.eval_s,
            "time/train_s_total": self.state.train_s}

  # ------------------------------------------------------------------ boundaries
  def _save(self, step: int, learner: Learner, force: bool = False) -> None:
    if not (force or self.ckpt.should_save(step)):
      return
    teacher = self.inputs.teacher if self.inputs is not None else None
    record = dataclasses.replace(
        self.state, step=step, tasks_state=encode_task_state(self.tasks.get_state_bytes()),
        rollouts=self.source.state() if self.source is not None else self.state.rollouts,
        shapes=self.shapes.state(),
        metrics_rows=self._writer.rows if self._writer is not None else None)
    self.ckpt.save(step, learner.state, record.to_json(),
                   arrays=(teacher.saved() or None) if teacher is not None else None)
    self._saved = step

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
    if self.source is not None:
      self.source.close()     # async: episodes in flight finish (grace) or go back to the backlog
    if self._saved != step:   # (learner None only where the step was just saved)
      self._save(step, learner, force=True)
    self.ckpt.wait()
    self.preempted_at = step
    note = self.source.saved_note() if self.source is not None else ""
    self.log(f"preempted at step {step}: checkpoint written, resume with the same "
             f"command{f' ({note})' if note else ''}")
    return True

  def _finish(self, seconds: float) -> dict:
    metrics_file = self.workdir / "metrics.jsonl"
    rows = read_metrics(metrics_file) if metrics_file.exists() else []
    if jax.process_index() == 0 and rows:
      plot_run(rows, self.workdir / "plot.png")
    out = result(self.cfg, self.state, self.final_eval, self.end_step, seconds)
    if jax.process_index() == 0:
      (self.workdir / "result.json").write_text(json.dumps(out, indent=1))
    return out


def _data_hash(task_ids) -> float:
  """A fingerprint of the tasks a step used (logged so resumed runs can be compared)."""
  return float(zlib.crc32("\n".join(task_ids).encode()))


def _fmt(d: dict) -> str:
  return " ".join(f"{k}={v:.4f}" for k, v in d.items())
