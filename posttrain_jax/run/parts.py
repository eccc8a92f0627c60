"""The parts of a run, wired from a RunConfig through the registries (nothing here compares a
name): the model and tokenizer, the mesh, the task bank and its held-out split, this process's
shares of the global counts, the rollout source / engine / episode entries, the lengths the
engine must serve, the providers the loss needs, the grader, and builders for the RL phase's
learner, reference, teacher, engine, episodes and rollout source.

Everything a config can get wrong is checked here, before anything trains: the data budget, the
multi-process rules, the engine's own check (a missing package, a model too long for it) and a
teacher checkpoint that cannot score the student's ids.
"""
from __future__ import annotations

import dataclasses
import pathlib
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain_jax.actors.episode import EpisodeContext, episode_spec
from posttrain_jax.actors.rollout import encode_messages, encode_prompt
from posttrain_jax.config_io import ConfigTypeError
from posttrain_jax.engines.registry import EngineContext, engine_spec
from posttrain_jax.tasks import TaskBank
from posttrain_jax.graders import make_grader
from posttrain_jax.learner import Learner, abstract_train_state
from posttrain_jax.losses import get_loss
from posttrain_jax.models import hf_io
from posttrain_jax.models.gguf_io import resolve_model_path
from posttrain_jax.models.tiny import build_tiny_model
from posttrain_jax.run import checks
from posttrain_jax.run.inputs import required
from posttrain_jax.run.sources import SourceContext, source_spec
from posttrain_jax.sharding import make_mesh
from posttrain_jax.teacher import SelfTeacher, TeacherStart, teacher_weights


class Parts:
  """The wired parts of a run (module docstring); `log(line)` for what the builders report."""

  def __init__(self, cfg, log: Callable[[str], None]):
    self.cfg, self.log = cfg, log
    self.model_dir = (resolve_model_path(cfg.model.path) if cfg.model.path
                      else build_tiny_model(cfg.model.tiny))
    self.tokenizer = hf_io.load_tokenizer(self.model_dir, cfg.model.chat_template)
    # the template the run renders with, when it replaces the checkpoint's: exported with it
    self.chat_template = self.tokenizer.chat_template if cfg.model.chat_template else None
    self.model_cfg = hf_io.read_model_config(self.model_dir)
    eos = self.model_cfg.eos_token_id
    stop = tuple(eos) if isinstance(eos, tuple) else ((eos,) if eos is not None else ())
    if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in stop:
      stop = (self.tokenizer.eos_token_id,) + stop
    self.stop_ids = stop
    self.source_spec, self.engine_spec = source_spec(cfg.rl.mode), engine_spec(cfg.rl.engine)
    self.episode_spec, self.episode_cfg = episode_spec(cfg.rl.episode), cfg.episode_config()
    self.engine_cfg, self.loss_cfg = cfg.engine_config(), cfg.loss_config()
    self.mesh = make_mesh(cfg.mesh)
    self.bank = TaskBank(dataclasses.replace(cfg.tasks, process_index=jax.process_index(),
                                             process_count=jax.process_count()))
    checks.check_data_budget(cfg, self.bank, self.source_spec.draws_per_step)
    self.tasks = self.bank.iterator()
    self.held_out = self.bank.eval_tasks(shard=jax.process_count() > 1)
    self.shares = checks.process_shares(cfg, self.source_spec, self.engine_spec, self.episode_spec)
    self.limits = self.episode_spec.limits(
        self.episode_cfg, cfg.rl.rollout, cfg.eval.max_tokens,
        lambda: max([len(encode_prompt(self.tokenizer, t)) for t in self.held_out[:64]] + [64]))
    if self.source_spec.serves:   # a harness's prompts are its own (tools, history), not the
      # bank's: serve any prompt a batch row can still train, within the model's context
      row = min(cfg.rl.batch.seq_len, self.model_cfg.max_position_embeddings)
      self.limits = dataclasses.replace(
          self.limits, max_prompt=max(self.limits.max_prompt, row - self.limits.max_tokens))
    self.needs = required(get_loss(cfg.rl.learner.loss), self.loss_cfg,
                          report_kl=cfg.rl.reference_kl)
    if cfg.rl.steps and self.engine_spec.check is not None:   # fails now, not after SFT
      self.engine_spec.check(self.engine_cfg, self.model_cfg, self.limits.max_tokens)
    weights = teacher_weights(cfg.rl.teacher.weights)
    if cfg.rl.steps and self.needs["teacher"] and hasattr(weights, "check"):
      weights.check(cfg.rl.teacher, self.model_cfg.vocab_size, self.tokenizer)
    self.grader = make_grader(cfg.grader, cfg.grader_cfg())

  def load(self, path) -> "hf_io.Decoder":
    m = self.cfg.model
    return hf_io.load_hf_model(path, mesh=self.mesh, param_dtype=m.param_dtype,
                               compute_dtype=m.compute_dtype, remat=m.remat)

  def learner(self, base: pathlib.Path, learner_cfg, loss_cfg=None, ckpt=None,
              restore_step: Optional[int] = None) -> Learner:
    """A learner starting from the HF weights in `base`, or from `ckpt`'s step `restore_step`
    (restored into abstract shapes: no initial state is built beside it)."""
    if restore_step is None:
      return Learner(self.load(base), learner_cfg, loss_cfg, mesh=self.mesh)
    m = self.cfg.model
    if learner_cfg.lora.enabled:   # the checkpoint holds the adapters; the base is `base`'s
      model = self.load(base)
    else:
      model = hf_io.abstract_model(hf_io.read_model_config(
          base, param_dtype=m.param_dtype, compute_dtype=m.compute_dtype, remat=m.remat),
          self.mesh)
    state, _ = ckpt.restore(abstract_train_state(model, learner_cfg, self.mesh), restore_step)
    return Learner(model, learner_cfg, loss_cfg, mesh=self.mesh, state=state)

  def start_params(self, learner: Learner, resume: bool, base: pathlib.Path):
    """The RL start weights: a fresh learner holds them, so they are copied (it donates its own
    buffers); a resumed one holds trained weights, so they are read again from `base`. With
    LoRA: the base with adapters off, fresh or resumed (no second copy of the weights)."""
    if learner.frozen is not None:
      return learner.adapters_off()
    if not resume:
      return jax.tree.map(jnp.copy, learner.state.params)
    return nnx.to_pure_dict(nnx.state(self.load(base), nnx.Param))

  def teacher(self, learner: Learner, ckpt, restore_step: Optional[int], reference,
              base: pathlib.Path, batch_cfg) -> SelfTeacher:
    """The distillation teacher, its weights from the registry entry rl.teacher.weights."""
    def restored(name: str):
      if restore_step is None:
        return None
      if not ckpt.has_arrays(restore_step, name):
        raise ConfigTypeError(
            f"checkpoint {ckpt.directory}/{restore_step} holds no saved "
            f"{self.cfg.rl.teacher.weights!r} teacher (no {name!r} arrays: it was written with "
            "another rl.teacher.weights); resume with the saved value or start over with "
            "--noresume")
      return ckpt.restore_arrays(name, learner.state.params, restore_step)  # LoRA: adapters

    def start_params():
      if reference is not None:
        return reference
      return self.start_params(learner, restore_step is not None, base)

    encode = lambda msgs, tools: encode_messages(self.tokenizer, msgs, tools)  # noqa: E731
    return SelfTeacher.start(self.cfg.rl.teacher, encode, batch_cfg,
                             TeacherStart(learner, start_params, restored, self.load))

  def engine(self, learner: Learner, base: pathlib.Path):
    """An engine of `rl.engine` serving `base` (the RL start) at version 0."""
    ctx = EngineContext(model_dir=base, model_config=self.model_cfg, model=learner.model(),
                        graphdef=learner.graphdef, max_prompt_len=self.limits.max_prompt,
                        max_tokens=self.limits.max_tokens, pad_id=self.tokenizer.pad_token_id or 0,
                        lora=learner.cfg.lora)
    return self.engine_spec.build(self.engine_cfg, ctx)

  def episode(self, engine):
    """An episode of `rl.episode` on `engine`."""
    ctx = EpisodeContext(engine=engine, tokenizer=self.tokenizer, grader=self.grader,
                         rollout=self.cfg.rl.rollout, stop_token_ids=self.stop_ids)
    return self.episode_spec.build(self.episode_cfg, ctx)

  def source(self, learner: Learner, engine, base: pathlib.Path,
             wrap: Optional[Callable] = None):
    """The rollout source of `rl.mode` (run/sources/), wrapped by `wrap` if given."""
    def build(name: str):
      return source_spec(name).build(ctx)
    ctx = SourceContext(
        cfg=self.cfg, learner=learner, engine=engine,
        new_engine=lambda: self.engine(learner, base), episode=self.episode, tasks=self.tasks,
        prompts_per_step=self.shares.prompts_per_step, tokenizer=self.tokenizer,
        stop_ids=self.stop_ids, sample_tokens=self.limits.sample_tokens,
        shareable=self.engine_spec.shareable, copies_weights=self.engine_spec.copies_weights,
        log=self.log, build=build)
    source = build(self.cfg.rl.mode)
    return wrap(source) if wrap is not None else source
