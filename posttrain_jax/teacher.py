"""Distillation teachers: a model scoring the student's sampled tokens, with privileged context
(self-distillation) or without (on-policy distillation from another checkpoint).

For a trajectory whose prompt is the chat x and whose sampled span is y (every token from the
first sampled one on, tool results and template glue included, as the engine's ids), the
teacher sequence is

    teacher ids = render(x with context c added to its last user message, x's tools) ++ y

and the teacher's log-prob of each *sampled* token of y, log T(y_t | x, c, y_<t), is computed by
the learner's forward pass under the teacher's weights. The prompt is rendered with the tools the
student saw (Trajectory.tools), so a tool-using trajectory's teacher sees the same tools block.
The response span is the same ids (never re-rendered from text), so the teacher's sampled
positions line up one to one with the student's; `align` verifies that token by token (same
count, same target id at each position) and raises `AlignmentError` otherwise — a shifted
alignment can never train silently.

Context c (a registered `CONTEXTS` function of the trajectory, its group and its task):
  feedback   the grader's / user's free text on this attempt (Trajectory.feedback)
  reference  the task's reference solution: task.metadata["reference"], else its "solution"
             (the SFT target), else task.answer ("reference" is for a task whose SFT target is
             not a correct solution: the hidden-rule task's unstated prompts teach a prior)
  sibling    a successful sibling's answer (same group, reward ≥ success_reward, not itself)
  sdpo       sibling when there is one, else feedback (SDPO's rule, arXiv 2601.20802)
  none       no context: the teacher reads the student's own ids (classic on-policy
             distillation from another model, Agarwal et al. 2024 GKD; every sample is scored)
A trajectory without context gets teacher_mask 0 on every token: the distillation term skips
it, and `distill/no_context_frac` counts it. A context function returning "" (`none`) means the
student's prompt ids unchanged, not a re-rendered chat.

Weights (teacher_weights.py, a registry: `rl.teacher.weights`): "student" scores with the
current parameters (before this step's update), "ema" with a moving average of them, "frozen"
with the RL start weights, "checkpoint" with another model of the student's vocabulary.

A teacher that shares the current weights moves with every update, and a full-distribution loss
can then pull student and teacher together to a degenerate agreement (measured on the
hidden-rule task at lr 1e-3: JSD 0.36 -> 0.002 while both emitted max-length junk and held-out
accuracy fell to 0); the EMA is SDPO's remedy. For a head loss the teacher's own LM head goes to
the learner's step (`step_inputs`); another checkpoint's head is put in the student's layout, and
teacher_hidden is [B, T, D_T] in its hidden size (kernels/teacher.py takes D_T ≠ D).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import numpy as np

from posttrain_jax import batching
from posttrain_jax.registry import Registry
from posttrain_jax.teacher_weights import (TEACHER_WEIGHTS, Student, TeacherCheckpointError,
                                           TeacherModel, TeacherStart, check_teacher_checkpoint,
                                           ema_update, teacher_weights)
from posttrain_jax.types import TrainBatch, Trajectory

ContextFn = Callable[[Trajectory, Sequence[Trajectory], Any, "TeacherConfig"], Optional[str]]
CONTEXTS: Registry[ContextFn] = Registry("teacher context")
FIELDS = frozenset({"teacher_logp", "teacher_mask", "teacher_hidden"})  # the TrainBatch fields it fills


class AlignmentError(ValueError):
  """The teacher's sampled positions do not match the student's token for token."""


@dataclasses.dataclass(frozen=True)
class TeacherConfig:
  """The distillation teacher: which privileged context, how it is shown, which weights."""
  context: str = "feedback"       # a name in CONTEXTS: feedback | reference | sibling | sdpo | none
  template: str = "{prompt}\n\n{context}"  # the teacher's last user message ({prompt}: the student's)
  feedback_template: str = "Feedback on an earlier attempt: {text}"
  reference_template: str = "A correct solution: {text}"
  sibling_template: str = "A correct answer: {text}"
  success_reward: float = 1.0     # a sibling with reward ≥ this is successful
  weights: str = "student"        # a name in TEACHER_WEIGHTS (teacher_weights.py): "student"
                                  # (current weights) | "ema" | "frozen" | "checkpoint"
  ema_rate: float = 0.05          # r in θ_T ← θ_T + r (θ − θ_T), weights="ema" only
                                  # ("frozen": the RL start weights, never updated)
  checkpoint: str = ""            # weights="checkpoint": the teacher's HF model directory (any
                                  # size / architecture, the student's vocabulary)
  seq_len: int = 256              # positions per row of the teacher's batch (prompt + context + y)

  def __post_init__(self):
    CONTEXTS.get(self.context)
    try:
      spec = TEACHER_WEIGHTS.get(self.weights)
    except KeyError as e:
      raise ValueError(f"TeacherConfig.weights: {e.args[0]}") from None
    if self.checkpoint and not spec.reads_checkpoint:
      raise ValueError(f"TeacherConfig.checkpoint (rl.teacher.checkpoint) is "
                       f"{self.checkpoint!r} but weights is {self.weights!r}, which reads no "
                       "checkpoint: set rl.teacher.weights='checkpoint' to distill from it, or "
                       "clear it")
    if hasattr(spec, "validate"):
      spec.validate(self)
    if not 0.0 < self.ema_rate <= 1.0:
      raise ValueError(f"TeacherConfig.ema_rate must be in (0, 1], got {self.ema_rate}")
    if "{prompt}" not in self.template or "{context}" not in self.template:
      raise ValueError("TeacherConfig.template must contain {prompt} and {context}, got "
                       f"{self.template!r}")


def _answer_text(traj: Trajectory) -> Optional[str]:
  for m in reversed(traj.messages):
    if m.get("role") == "assistant" and isinstance(m.get("content"), str):
      return m["content"]
  return None


@CONTEXTS.register("feedback")
def _feedback(traj, group, task, cfg):
  return cfg.feedback_template.format(text=traj.feedback) if traj.feedback else None


@CONTEXTS.register("reference")
def _reference(traj, group, task, cfg):
  if task is None:
    return None
  text = task.metadata.get("reference") or task.metadata.get("solution") or task.answer
  return cfg.reference_template.format(text=text) if text else None


@CONTEXTS.register("sibling")
def _sibling(traj, group, task, cfg):
  for other in group:
    if (other.id != traj.id and other.reward is not None and other.reward >= cfg.success_reward
        and _answer_text(other)):
      return cfg.sibling_template.format(text=_answer_text(other))
  return None


@CONTEXTS.register("sdpo")
def _sdpo(traj, group, task, cfg):
  return _sibling(traj, group, task, cfg) or _feedback(traj, group, task, cfg)


@CONTEXTS.register("none")
def _none(traj, group, task, cfg):
  return ""       # no context: the student's own prompt ids (SelfTeacher.sequences)


def teacher_messages(messages: Sequence[dict], context: str, template: str) -> Optional[list]:
  """The prompt (the messages before the first assistant turn) with `context` added to its last
  user message through `template`; None when the prompt has no user message."""
  prompt = []
  for m in messages:
    if m.get("role") == "assistant":
      break
    prompt.append(dict(m))
  users = [i for i, m in enumerate(prompt) if m.get("role") == "user"
           and isinstance(m.get("content"), str)]
  if not users:
    return None
  last = prompt[users[-1]]
  last["content"] = template.format(prompt=last["content"], context=context)
  return prompt


def teacher_trajectory(traj: Trajectory, prompt_ids: Sequence[int]) -> Trajectory:
  """`prompt_ids` ++ the trajectory's span from its first sampled token on (ids, mask and
  behaviour log-probs copied, not re-rendered)."""
  p = traj.prompt_len
  n = len(prompt_ids)
  return dataclasses.replace(
      traj, id=f"{traj.id}#teacher", token_ids=list(prompt_ids) + traj.token_ids[p:],
      loss_mask=[0] * n + traj.loss_mask[p:],
      behaviour_logprobs=[0.0] * n + traj.behaviour_logprobs[p:],
      policy_version=[-1] * n + traj.policy_version[p:], messages=[])


def _sampled_positions(batch_like: TrainBatch, n_seqs: int) -> list[tuple[np.ndarray, np.ndarray]]:
  """Per sequence s < n_seqs: (rows, cols) of its sampled targets, in sequence order."""
  mask = np.asarray(batch_like.loss_mask) > 0
  rows, cols = np.nonzero(mask)                      # row-major: in order within a sequence
  sid = np.asarray(batch_like.seq_ids)[rows, cols]
  out = []
  for s in range(n_seqs):
    sel = sid == s
    out.append((rows[sel], cols[sel]))
  return out


def align(student: TrainBatch, teacher: TrainBatch, owners: Sequence[int],
          teacher_logp_bt: Optional[np.ndarray], ids: Sequence[str] = (),
          teacher_hidden_btd: Optional[np.ndarray] = None):
  """Scatters the teacher's per-token values onto the student's layout.

  Teacher sequence k belongs to student sequence owners[k]. Returns (teacher_logp [B, T],
  teacher_mask [B, T], teacher_hidden [B, T, D] or None) in the student's shape (`ids`: the
  student trajectories' ids, for errors; a None input gives a None or zero output). Raises
  AlignmentError unless, for every k, the two sequences have the same number of sampled targets
  with the same ids in the same order.
  """
  n_student = int(np.max(owners)) + 1 if len(owners) else 0
  s_pos = _sampled_positions(student, max(n_student, 1))
  t_pos = _sampled_positions(teacher, len(owners))
  s_tgt, t_tgt = np.asarray(student.target_ids), np.asarray(teacher.target_ids)
  shape = np.shape(student.loss_mask)
  logp, mask = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
  hidden = (None if teacher_hidden_btd is None else
            np.zeros((*shape, np.shape(teacher_hidden_btd)[-1]), np.float32))
  for k, s in enumerate(owners):
    (sr, sc), (tr, tc) = s_pos[s], t_pos[k]
    name = f"trajectory {ids[s]!r}" if s < len(ids) else f"sequence {s}"
    if len(sr) != len(tr):
      raise AlignmentError(f"{name}: the student has {len(sr)} sampled tokens, its teacher "
                           f"sequence {len(tr)}")
    bad = np.nonzero(s_tgt[sr, sc] != t_tgt[tr, tc])[0]
    if len(bad):
      i = int(bad[0])
      raise AlignmentError(f"{name}: sampled token {i} is id {int(s_tgt[sr[i], sc[i]])} for the "
                           f"student but {int(t_tgt[tr[i], tc[i]])} in the teacher sequence")
    if teacher_logp_bt is not None:
      logp[sr, sc] = np.asarray(teacher_logp_bt)[tr, tc]
    if hidden is not None:
      hidden[sr, sc] = np.asarray(teacher_hidden_btd)[tr, tc]
    mask[sr, sc] = 1.0
  return logp, mask, hidden


class SelfTeacher:
  """Fills `teacher_logp` / `teacher_mask` of a student batch (see the module docstring).

  `encode(messages, tools) -> prompt ids` renders a chat with the generation prompt and the
  tools (None: no tools), the same rendering the rollouts use; `tasks` maps task ids to Task
  records for the "reference" context. `weights`: whose weights score (teacher_weights.py; the
  student's current ones by default).
  """

  def __init__(self, cfg: TeacherConfig, encode: Callable[[list, Optional[list]], list[int]],
               student_batch: batching.BatchConfig, weights: Any = None):
    self.cfg = cfg
    self.encode = encode
    self.batch_cfg = dataclasses.replace(student_batch, seq_len=cfg.seq_len)
    self.context_fn = CONTEXTS.get(cfg.context)
    self.weights = weights if weights is not None else Student()

  @classmethod
  def start(cls, cfg: TeacherConfig, encode, student_batch, ctx: TeacherStart) -> "SelfTeacher":
    """The teacher of an RL phase: its weights from the registry entry `cfg.weights`."""
    return cls(cfg, encode, student_batch, teacher_weights(cfg.weights).start(cfg, ctx))

  def params(self, learner):
    """The teacher's parameters (the other checkpoint's for weights="checkpoint")."""
    return self.weights.params(learner)

  def step_inputs(self, learner) -> dict:
    """Extra arguments of learner.step: a head loss's teacher head when it is not the student's."""
    return self.weights.step_inputs(learner)

  def hidden_size(self, learner) -> int:
    """D_T: the width of teacher_hidden."""
    return self.weights.hidden_size(learner)

  def after_update(self, learner) -> None:
    """Moves an EMA towards the student's new weights (nothing for the others)."""
    self.weights.after_update(learner)

  def saved(self) -> dict:
    """Arrays the checkpoint keeps for this teacher (an EMA's), by name."""
    return self.weights.saved()

  def sequences(self, trajs: Sequence[Trajectory], tasks: Optional[dict] = None
                ) -> tuple[list[int], list[Trajectory], int]:
    """(owners, teacher trajectories, how many had context but no user message): teacher
    trajectory k is the teacher sequence of trajs[owners[k]], its prompt rendered with that
    trajectory's tools; trajectories without context have none."""
    groups: dict[Any, list[Trajectory]] = {}
    for t in trajs:
      groups.setdefault(t.group_id or t.id, []).append(t)
    owners, teacher_trajs = [], []
    no_prompt = 0
    for s, traj in enumerate(trajs):
      task = (tasks or {}).get(traj.task_id)
      context = self.context_fn(traj, groups[traj.group_id or traj.id], task, self.cfg)
      if context is None:
        continue
      if context == "":           # no context: the student's own prompt, as it was sampled
        prompt_ids = traj.token_ids[:traj.prompt_len]
      else:
        msgs = teacher_messages(traj.messages, context, self.cfg.template)
        if msgs is None:
          no_prompt += 1
          continue
        prompt_ids = self.encode(msgs, traj.tools)
      owners.append(s)
      teacher_trajs.append(teacher_trajectory(traj, prompt_ids))
    return owners, teacher_trajs, no_prompt

  def fill(self, learner, trajs: Sequence[Trajectory], batch: TrainBatch,
           tasks: Optional[dict] = None, needs=("teacher_logp", "teacher_mask")
           ) -> tuple[TrainBatch, dict[str, float]]:
    """`batch` (built from `trajs`, in order) with teacher_mask and, as `needs` says,
    teacher_logp (the teacher's log-prob of each sampled token) and teacher_hidden (its final
    hidden state there, for full-distribution losses) filled."""
    owners, teacher_trajs, no_prompt = self.sequences(trajs, tasks)
    shape = np.shape(batch.loss_mask)
    logp, mask, hidden = np.zeros(shape, np.float32), np.zeros(shape, np.float32), None
    want_hidden = "teacher_hidden" in needs
    if teacher_trajs:
      try:
        tb = batching.build_batch(teacher_trajs, [0.0] * len(teacher_trajs), self.batch_cfg,
                                  with_behaviour=False)
      except batching.BatchError as e:
        raise batching.BatchError(f"the teacher's batch (rl.teacher.seq_len={self.cfg.seq_len}, "
                                  f"rows={self.batch_cfg.rows}): {e}") from None
      t_logp, t_hidden = self.weights.score(learner, tb, needs)
      logp, mask, hidden = align(batch, tb, owners, t_logp, [t.id for t in trajs], t_hidden)
    elif want_hidden:   # nothing scored: an all-zero state beside an all-zero mask
      hidden = np.zeros((*shape, self.hidden_size(learner)), np.float32)
    n = max(len(trajs), 1)
    metrics = {"distill/no_context_frac": 1.0 - len(owners) / n,
               "distill/no_prompt_frac": no_prompt / n}
    return dataclasses.replace(batch, teacher_logp=logp if "teacher_logp" in needs else None,
                               teacher_mask=mask, teacher_hidden=hidden), metrics


__all__ = ["AlignmentError", "CONTEXTS", "FIELDS", "SelfTeacher", "TeacherConfig",
           "TeacherStart", "align", "teacher_messages", "teacher_trajectory",
           # whose weights (teacher_weights.py), re-exported for callers of this module
           "TEACHER_WEIGHTS", "TeacherCheckpointError", "TeacherModel",
           "check_teacher_checkpoint", "ema_update", "teacher_weights"]
