"""Trajectories -> a packed `TrainBatch` of static shape.

A trajectory of L tokens becomes one training sequence of L - 1 positions: input_ids =
tokens[:-1], target_ids = tokens[1:], loss_mask = loss_mask[1:] (1 only where the *target* was
sampled by the policy), behaviour log-probs shifted the same way. The token ids are the ones
the engine sampled: nothing is re-tokenised here.

Packing is first-fit decreasing (longest sequence first) into `rows` rows of `seq_len` positions; each sequence
gets its own segment id (positions restart at 0) and a global `seq_ids` index, so sequence-level
losses give the same value packed or not. Shapes are fixed by the config, so the learner's jit
compiles once. Sequences that do not fit are an error naming the trajectory (never truncated:
that would train on a different sequence than the one graded).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

from posttrain_jax.types import TrainBatch, Trajectory


class BatchError(ValueError):
  """Trajectories that cannot be laid out in the configured batch shape."""


@dataclasses.dataclass(frozen=True)
class BatchConfig:
  """Static shape of one learner batch."""
  rows: int = 8               # rows per batch (a multiple of the data-parallel size)
  seq_len: int = 128          # positions per row
  max_seqs: int = 64          # sequences per batch (size of seq_valid)
  pack: bool = True           # several sequences per row; False = one per row


def build_batch(trajs: Sequence[Trajectory], advantages: Sequence[float], cfg: BatchConfig,
                with_behaviour: bool = True) -> TrainBatch:
  """Packs `trajs` (each with its scalar advantage) into one TrainBatch."""
  if len(trajs) != len(advantages):
    raise BatchError(f"{len(trajs)} trajectories but {len(advantages)} advantages")
  if len(trajs) > cfg.max_seqs:
    raise BatchError(f"{len(trajs)} sequences exceed BatchConfig.max_seqs={cfg.max_seqs}")
  r, t = cfg.rows, cfg.seq_len
  f32 = lambda: np.zeros((r, t), np.float32)
  i32 = lambda: np.zeros((r, t), np.int32)
  inp, tgt, pos, seg, sid = i32(), i32(), i32(), i32(), i32()
  mask, adv, beh = f32(), f32(), f32()
  fill = [0] * r
  nseg = [0] * r
  order = sorted(range(len(trajs)), key=lambda i: -len(trajs[i].token_ids))
  for s in order:
    traj, a = trajs[s], advantages[s]
    n = len(traj.token_ids) - 1
    if n < 1:
      raise BatchError(f"trajectory {traj.id!r} has {n + 1} tokens; need at least 2")
    if n > t:
      raise BatchError(f"trajectory {traj.id!r} needs {n} positions > BatchConfig.seq_len={t}")
    row = next((i for i in range(r) if (fill[i] + n <= t) and (cfg.pack or fill[i] == 0)), None)
    if row is None:
      raise BatchError(f"trajectory {traj.id!r} does not fit: {len(trajs)} sequences need more "
                       f"than rows={r} x seq_len={t}")
    sl = slice(fill[row], fill[row] + n)
    toks = np.asarray(traj.token_ids, np.int32)
    inp[row, sl], tgt[row, sl] = toks[:-1], toks[1:]
    pos[row, sl] = np.arange(n)
    nseg[row] += 1
    seg[row, sl] = nseg[row]
    sid[row, sl] = s
    mask[row, sl] = np.asarray(traj.loss_mask[1:], np.float32)
    adv[row, sl] = a
    beh[row, sl] = np.asarray(traj.behaviour_logprobs[1:], np.float32)
    fill[row] += n
  valid = np.zeros((cfg.max_seqs,), np.float32)
  valid[:len(trajs)] = 1.0
  return TrainBatch(input_ids=inp, target_ids=tgt, loss_mask=mask, positions=pos,
                    segment_ids=seg, seq_ids=sid, seq_valid=valid, advantages=adv,
                    behaviour_logp=beh if with_behaviour else None)


def sft_trajectory(prompt_ids: Sequence[int], answer_ids: Sequence[int], tid: str,
                   task_id: Optional[str] = None) -> Trajectory:
  """A supervised example as a trajectory: loss on the answer tokens only."""
  ids = list(prompt_ids) + list(answer_ids)
  return Trajectory(id=tid, task_id=task_id or tid, token_ids=ids,
                    loss_mask=[0] * len(prompt_ids) + [1] * len(answer_ids),
                    behaviour_logprobs=[0.0] * len(ids), policy_version=[-1] * len(ids))
