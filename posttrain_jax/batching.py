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

`fit_shape` then cuts what no sequence uses (RL batches, `BatchConfig.trim`): 64 short
sequences in configs/default.py's RL shape [128, 32] would make the learner compute 4096
positions for ~1060 real ones (1536 once cut). Rows and positions are rounded up to
buckets: multiples of `unit · 2^k / 4` (unit = row_multiple for rows, seq_bucket for
positions), i.e. four sizes per octave, at most 25% padding kept and ~4·log2(size / unit)
shapes each way, which bounds the recompiles (28 position buckets up to 2048; a run whose
sequence count is fixed, pack=False, sees one row bucket); never above the configured shape.

Exact: only padding is removed (segment id 0, loss mask 0, which no loss, attention or
segment sum reads; seq_valid, per sequence, is kept whole), so the loss, its gradient and
every metric are unchanged; a shape that would cut a used row or position is refused.
Kernels: no LM-head implementation constrains N = rows · positions (kernels/: the chunked
path pads N to its token chunk, pallas_gpu masks loads against N, pallas_tpu takes
block_n = min(block_n, N) and masks a partial edge block), so any bucket is valid; rows stay
a multiple of row_multiple (the row shards × micro-batches, which must divide them).
Multi-process: every process must feed the jitted step the same shape, so the shape must not
come from one host's rows alone: `agree` maps this process's shape to the job's (rl_step
passes multihost.max_over_processes, an all-gather of the two ints), a shape every process
computes identically.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

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
  trim: bool = True           # RL: cut unused rows / positions to a bucket (fit_shape; exact)
  seq_bucket: int = 8         # with trim: the smallest position bucket (buckets: 4 per octave)


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


def bucket(n: int, unit: int, cap: int) -> int:
  """The smallest multiple of `unit · 2^k / 4` (k: n's octave in units) that is ≥ n, capped."""
  units = -(-max(int(n), 1) // int(unit))
  step = max(1, (1 << (units.bit_length() - 1)) // 4)
  return min(cap, -(-units // step) * step * unit)


def fitted_shape(batch: TrainBatch, row_multiple: int, seq_bucket: int = 8) -> tuple[int, int]:
  """(rows, positions) `fit_shape` cuts `batch` to, before any agreement across processes."""
  rows, seq_len = np.shape(batch.segment_ids)
  used_bt = np.asarray(batch.segment_ids) > 0
  used_rows = int(np.max(np.nonzero(used_bt.any(1))[0], initial=-1)) + 1
  used_len = int(np.max(np.nonzero(used_bt.any(0))[0], initial=-1)) + 1
  multiple = max(row_multiple, 1)
  r = bucket(used_rows, multiple, rows) if rows % multiple == 0 else rows
  return r, bucket(used_len, max(seq_bucket, 1), seq_len)


def fit_shape(batch: TrainBatch, row_multiple: int, seq_bucket: int = 8,
              agree: Optional[Callable[[tuple[int, int]], Sequence[int]]] = None) -> TrainBatch:
  """`batch` without its unused trailing rows and positions (see the module docstring).

  row_multiple: rows stay a multiple of this (data-parallel shards × micro-batches); a batch
  whose configured rows are not a multiple keeps them. agree: maps this process's shape to
  the one every process uses (≥ it, e.g. the max over processes). seq_valid is unchanged.
  """
  own = fitted_shape(batch, row_multiple, seq_bucket)
  r, t = own if agree is None else (int(x) for x in agree(own))
  rows, seq_len = np.shape(batch.segment_ids)
  if not (own[0] <= r <= rows and own[1] <= t <= seq_len):
    raise ValueError(f"fit_shape: the agreed shape {(r, t)} would cut this batch's used "
                     f"rows / positions {own} or exceed its shape {(rows, seq_len)}; `agree` "
                     "must return at least its input (e.g. the max over processes)")
  if (r, t) == (rows, seq_len):
    return batch

  def cut(name, x):   # [B, T] and [B, T, D] fields; seq_valid [S] is per sequence
    return x if x is None or name == "seq_valid" else np.asarray(x)[:r, :t]
  return TrainBatch(**{f.name: cut(f.name, getattr(batch, f.name))
                       for f in dataclasses.fields(batch)})


def sft_trajectory(prompt_ids: Sequence[int], answer_ids: Sequence[int], tid: str,
                   task_id: Optional[str] = None) -> Trajectory:
  """A supervised example as a trajectory: loss on the answer tokens only."""
  ids = list(prompt_ids) + list(answer_ids)
  return Trajectory(id=tid, task_id=task_id or tid, token_ids=ids,
                    loss_mask=[0] * len(prompt_ids) + [1] * len(answer_ids),
                    behaviour_logprobs=[0.0] * len(ids), policy_version=[-1] * len(ids))
