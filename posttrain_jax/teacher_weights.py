"""Whose weights a distillation teacher scores with: a registry (`rl.teacher.weights`).

    student     the current parameters (before this step's update)
    ema         θ_T ← θ_T + r (θ − θ_T) after every update (rate `ema_rate`, SDPO's 0.05),
                starting from the RL start weights; saved with every checkpoint, so a resumed
                run continues the same average. With LoRA θ is the adapters alone (A and B
                averaged each, as the optimizer sees them): the base never moves, so its
                average is itself and the teacher scores with the learner's own frozen base
                (no second copy of it, in memory or in the checkpoint)
    frozen      the RL start weights throughout (the reference's own copy when the run has one)
    checkpoint  another model read from `rl.teacher.checkpoint` (an HF directory: its own graph,
                sharded on the learner's mesh, never updated); any size and architecture, but the
                student's vocabulary (and tokenizer, where both directories have one)

An entry is a class with

    start(cfg, ctx: TeacherStart) -> instance    at the start (or resume) of the RL phase
    params(learner)                              what the learner's forward scores with
    score(learner, batch, needs)                 (log T [B, T] | None, hidden [B, T, D_T] | None)
    hidden_size(learner), step_inputs(learner)   a head loss's teacher width and LM head
    after_update(learner)                        follow the student (ema), else nothing
    saved()                                      arrays the checkpoint keeps ({} = none)

and optional `validate(cfg)` (a config that cannot work, at config time) and `check(cfg,
vocab_size, tokenizer)` (before training starts). A new kind of teacher weights is one class
registered here or in a file that imports this one, plus its test.
"""
from __future__ import annotations

import dataclasses
import functools
import pathlib
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain_jax.errors import UserError
from posttrain_jax.learner import LearnerConfig, hidden_states, token_logprobs
from posttrain_jax.models import hf_io, lora
from posttrain_jax.models.decoder import Decoder
from posttrain_jax.registry import Registry
from posttrain_jax.types import TrainBatch


class TeacherCheckpointError(UserError, ValueError):
  """rl.teacher.checkpoint names a model that cannot score the student's tokens."""


@dataclasses.dataclass(frozen=True)
class TeacherStart:
  """What the run gives an entry's `start`."""
  learner: Any                                  # the RL learner (mesh, graphdef, params)
  start_params: Callable[[], Any]               # the RL start weights (a copy)
  restored: Callable[[str], Optional[Any]]      # arrays saved under a name at the resumed
                                                # checkpoint, shaped like the learner's trained
                                                # params (TrainState.params: with LoRA the
                                                # adapters); None when not resuming; raises
                                                # when a resumed checkpoint lacks them
  load: Callable[[str], Decoder]                # an HF directory -> a Decoder on the mesh


TEACHER_WEIGHTS: Registry[type] = Registry("teacher weights")


def teacher_weights(name: str) -> type:
  return TEACHER_WEIGHTS.get(name)


class _Own:
  """Scores with the learner's graph under some params of the student's shape."""
  reads_checkpoint = False

  def __init__(self, params: Any = None):
    self._params = params

  def params(self, learner):
    return self._params

  def score(self, learner, tb: TrainBatch, needs):
    params = self.params(learner)
    logp = learner.logprobs(tb, params) if "teacher_logp" in needs else None
    hidden = learner.hidden(tb, params) if "teacher_hidden" in needs else None
    return (None if logp is None else np.asarray(logp),
            None if hidden is None else np.asarray(hidden))

  def hidden_size(self, learner) -> int:
    return learner.model().cfg.hidden_size

  def step_inputs(self, learner) -> dict:
    if not learner.spec.head:
      return {}
    w, _ = nnx.merge(learner.graphdef, self.params(learner)).head()
    return {"teacher_w": w}

  def after_update(self, learner) -> None:
    del learner

  def saved(self) -> dict:
    return {}


@TEACHER_WEIGHTS.register("student")
class Student(_Own):
  """The current weights: nothing of its own."""

  @staticmethod
  def validate(cfg) -> None:
    if cfg.context == "none":
      raise ValueError("TeacherConfig.context='none' with weights='student': the teacher would "
                       "be the student itself, scoring its own tokens (no signal); use weights "
                       "'checkpoint', 'ema' or 'frozen', or a privileged context")

  @classmethod
  def start(cls, cfg, ctx: TeacherStart) -> "Student":
    return cls()

  def params(self, learner):
    return learner.params

  def step_inputs(self, learner) -> dict:
    return {}       # the student's own head


@TEACHER_WEIGHTS.register("frozen")
class Frozen(_Own):
  """The RL start weights, never updated (re-read on resume)."""

  @classmethod
  def start(cls, cfg, ctx: TeacherStart) -> "Frozen":
    return cls(ctx.start_params())


@TEACHER_WEIGHTS.register("ema")
class Ema(_Own):
  """An exponential moving average of the student's trained parameters (TrainState.params:
  with LoRA the adapters alone, joined to the learner's frozen base to score), saved with every
  checkpoint."""

  def __init__(self, params: Any = None, rate: float = 0.05):
    super().__init__(params)
    self.rate = rate

  @classmethod
  def start(cls, cfg, ctx: TeacherStart) -> "Ema":
    restored = ctx.restored("teacher")
    if restored is None:
      learner = ctx.learner
      # the RL start: with LoRA the fresh adapters (copied: the learner donates its buffers)
      restored = (ctx.start_params() if learner.frozen is None
                  else jax.tree.map(jnp.copy, learner.state.params))
    return cls(restored, cfg.ema_rate)

  def params(self, learner):
    return lora.join(learner.frozen, self._params)

  def after_update(self, learner) -> None:
    self._params = ema_update(self._params, learner.state.params, self.rate)

  def saved(self) -> dict:
    return {"teacher": self._params}


@TEACHER_WEIGHTS.register("checkpoint")
class Checkpoint:
  """Another model (its own graph and parameters), loaded sharded on the learner's mesh."""
  reads_checkpoint = True

  def __init__(self, model: "TeacherModel"):
    self.model = model
    self._head = None     # its head in the student's layout (step_inputs), put there once

  @staticmethod
  def validate(cfg) -> None:
    if not cfg.checkpoint:
      raise ValueError("TeacherConfig.checkpoint (rl.teacher.checkpoint) is empty: weights="
                       "'checkpoint' needs the teacher's HF model directory, e.g. "
                       "--config.rl.teacher.checkpoint=DIR")

  @staticmethod
  def check(cfg, vocab_size: int, tokenizer) -> None:
    check_teacher_checkpoint(cfg.checkpoint, vocab_size, tokenizer)

  @classmethod
  def start(cls, cfg, ctx: TeacherStart) -> "Checkpoint":
    learner = ctx.learner
    return cls(TeacherModel(ctx.load(cfg.checkpoint), learner.cfg, learner.put_batch))

  def params(self, learner):
    return self.model.params

  def score(self, learner, tb: TrainBatch, needs):
    logp = self.model.logprobs(tb) if "teacher_logp" in needs else None
    hidden = self.model.hidden(tb) if "teacher_hidden" in needs else None
    return (None if logp is None else np.asarray(logp),
            None if hidden is None else np.asarray(hidden))

  def hidden_size(self, learner) -> int:
    return self.model.cfg.hidden_size

  def step_inputs(self, learner) -> dict:
    if not learner.spec.head:
      return {}
    if self._head is None:
      self._head = self.model.head(transposed=learner.model().head()[1])
    return {"teacher_w": self._head}

  def after_update(self, learner) -> None:
    del learner

  def saved(self) -> dict:
    return {}


@jax.jit
def ema_update(teacher_params, params, rate):
  """θ_T + r (θ − θ_T), leaf by leaf."""
  return jax.tree.map(lambda t, p: t + rate * (p.astype(t.dtype) - t), teacher_params, params)


class TeacherModel:
  """Another model's forward pass (weights="checkpoint"): its own graph and parameters (loaded
  sharded on the learner's mesh), scored with the learner's temperature and LM-head kernel.

  `put_batch` moves a host batch onto the mesh (`Learner.put_batch`).
  """

  def __init__(self, model: Decoder, learner_cfg: LearnerConfig,
               put_batch: Callable[[TrainBatch], TrainBatch]):
    self.cfg = model.cfg
    self.graphdef, params = nnx.split(model, nnx.Param)
    self.params = nnx.to_pure_dict(params)
    self.put_batch = put_batch
    self._logprobs = jax.jit(functools.partial(token_logprobs, self.graphdef,
                                               temperature=learner_cfg.temperature,
                                               impl=learner_cfg.logprob_impl))
    self._hidden = jax.jit(functools.partial(hidden_states, self.graphdef))

  def logprobs(self, batch: TrainBatch) -> jax.Array:
    """log T(target_t) [B, T] (0 where loss_mask = 0)."""
    return self._logprobs(self.params, self.put_batch(batch))

  def hidden(self, batch: TrainBatch) -> jax.Array:
    """The teacher's final hidden states [B, T, D_T]."""
    return self._hidden(self.params, self.put_batch(batch))

  def head(self, transposed: bool) -> jax.Array:
    """The teacher's LM head in the layout `transposed` says ([V, D_T] if True, else [D_T, V])."""
    w, t = nnx.merge(self.graphdef, self.params).head()
    return w if t == transposed else w.T


def check_teacher_checkpoint(path: str, student_vocab: int, student_tokenizer=None):
  """The teacher's ModelConfig, after checking it can score the student's ids: the same
  vocabulary size and, when `student_tokenizer` is given and `path` has tokenizer files, the
  same token -> id map. Raises TeacherCheckpointError naming rl.teacher.checkpoint."""
  where = f"rl.teacher.checkpoint={path!r}"
  try:
    cfg = hf_io.read_model_config(path)
  except UserError as e:
    raise TeacherCheckpointError(f"{where}: {e}") from None
  if cfg.vocab_size != student_vocab:
    raise TeacherCheckpointError(
        f"{where}: the teacher's vocabulary has {cfg.vocab_size} tokens, the student's "
        f"{student_vocab}; distillation scores the student's token ids, so the teacher must share "
        "the student's vocabulary (and tokenizer)")
  d = pathlib.Path(path)
  if student_tokenizer is not None and any((d / f).exists() for f in ("tokenizer.json",
                                                                      "tokenizer_config.json")):
    theirs, ours = hf_io.load_tokenizer(d).get_vocab(), student_tokenizer.get_vocab()
    if theirs != ours:
      diff = sorted(set(theirs.items()) ^ set(ours.items()))
      tok = diff[0][0]
      raise TeacherCheckpointError(
          f"{where}: the teacher's tokenizer differs from the student's ({len(theirs)} vs "
          f"{len(ours)} tokens; e.g. {tok!r} is id {ours.get(tok)} for the student and "
          f"{theirs.get(tok)} for the teacher); both must map text to the same ids")
  return cfg


