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

Shared prefixes (`BatchConfig.share_prefix`): the G sequences of one task (same `task_id`)
begin with the same prompt, which a plain layout computes G times (14 of a tiny arithmetic
sequence's ~17 positions). When their first L tokens agree and no target among them is
sampled (loss mask 0), they share them: one prefix segment holds positions 0 .. L-2 (inputs
tokens[:L-1]; its targets are unmasked prompt tokens), and each sequence's own segment holds
positions L-1 .. len-2 (inputs tokens[L-1:-1], targets tokens[L:]), with `prefix_ids` naming
the prefix segment, which the model lets it attend as well (models/decoder.py). Position
L-1 stays in every branch because its target (the first sampled token) differs. A query in
a branch thus sees exactly the keys / values it would see unshared (the prefix's do not
depend on the branches), so log-probs are the same and the gradient is the same sum, with
(L-1)(G-1) fewer positions computed. A group longer than a row is split into several units,
each with a copy of the prefix; `pack=False` puts one unit per row.

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

`ShapeReuse` (the trainer's RL phase) then picks the compiled shape a trimmed batch runs in:
the smallest already compiled one that holds it, within `shape_slack` × its positions, so a
step that dropped a group does not compile a program for one row fewer (see the class).
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
  share_prefix: bool = True   # one task's sequences share their prompt's positions (exact)
  shape_slack: float = 2.0    # with trim: run in a compiled shape of up to this x the positions
                              # (ShapeReuse; 1 = every bucket its own program)


def shared_prefix_len(trajs: Sequence[Trajectory]) -> int:
  """L: the number of leading tokens all of `trajs` share that sit before every sampled target
  (token i is shared only when no trajectory's loss_mask[i] is 1), and that leave each at least
  one position of its own (L < its length); 0 for fewer than two trajectories."""
  if len(trajs) < 2:
    return 0
  first = trajs[0].token_ids
  cap = min(len(t.token_ids) for t in trajs) - 1
  for t in trajs:
    ones = [i for i, m in enumerate(t.loss_mask) if m]
    cap = min(cap, ones[0] if ones else cap)
  n = 0
  while n < cap and all(t.token_ids[n] == first[n] for t in trajs[1:]):
    n += 1
  return n


def _units(trajs: Sequence[Trajectory], cfg: BatchConfig) -> list[tuple[int, list[int]]]:
  """(L, members): what one row segment group holds. L > 1: members share the L - 1 prefix
  positions and each adds len - L of its own; L = 1: one member, unshared (len - 1 positions).
  A group too long for a row is split into several units, each with its own prefix copy."""
  if not cfg.share_prefix:
    return [(1, [i]) for i in range(len(trajs))]
  groups: dict[str, list[int]] = {}
  for i, t in enumerate(trajs):
    groups.setdefault(t.task_id, []).append(i)
  units = []
  for members in groups.values():
    L = shared_prefix_len([trajs[i] for i in members])
    if L < 2:
      units += [(1, [i]) for i in members]
      continue
    cur, used = [], L - 1
    for i in members:
      n = len(trajs[i].token_ids) - L
      if cur and used + n > cfg.seq_len:
        units.append((L, cur))
        cur, used = [], L - 1
      cur.append(i)
      used += n
    units.append((L, cur))
  return units


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
  inp, tgt, pos, seg, sid, pre = i32(), i32(), i32(), i32(), i32(), i32()
  mask, adv, beh = f32(), f32(), f32()
  fill = [0] * r
  nseg = [0] * r
  for traj in trajs:
    n = len(traj.token_ids) - 1
    if n < 1:
      raise BatchError(f"trajectory {traj.id!r} has {n + 1} tokens; need at least 2")
    if n > t:
      raise BatchError(f"trajectory {traj.id!r} needs {n} positions > BatchConfig.seq_len={t}")
  units = _units(trajs, cfg)
  size = [L - 1 + sum(len(trajs[i].token_ids) - L for i in m) for L, m in units]
  for u in sorted(range(len(units)), key=lambda u: -size[u]):
    (L, members), n = units[u], size[u]
    row = next((i for i in range(r) if (fill[i] + n <= t) and (cfg.pack or fill[i] == 0)), None)
    if row is None:
      raise BatchError(f"trajectory {trajs[members[0]].id!r} does not fit: {len(trajs)} "
                       f"sequences need more than rows={r} x seq_len={t}")
    shared = 0
    if L > 1:   # the prefix: the shared tokens' positions, no sampled target among them
      toks = np.asarray(trajs[members[0]].token_ids[:L], np.int32)
      sl = slice(fill[row], fill[row] + L - 1)
      inp[row, sl], tgt[row, sl], pos[row, sl] = toks[:-1], toks[1:], np.arange(L - 1)
      nseg[row] += 1
      seg[row, sl] = shared = nseg[row]
      sid[row, sl] = members[0]
      fill[row] += L - 1
    for s in members:
      traj, k = trajs[s], len(trajs[s].token_ids) - L
      sl = slice(fill[row], fill[row] + k)
      toks = np.asarray(traj.token_ids[L - 1:], np.int32)
      inp[row, sl], tgt[row, sl] = toks[:-1], toks[1:]
      pos[row, sl] = np.arange(L - 1, L - 1 + k)
      nseg[row] += 1
      seg[row, sl] = nseg[row]
      pre[row, sl] = shared
      sid[row, sl] = s
      mask[row, sl] = np.asarray(traj.loss_mask[L:], np.float32)
      adv[row, sl] = advantages[s]
      beh[row, sl] = np.asarray(traj.behaviour_logprobs[L:], np.float32)
      fill[row] += k
  valid = np.zeros((cfg.max_seqs,), np.float32)
  valid[:len(trajs)] = 1.0
  # prefix_ids only where a prefix is shared: a batch with none is the unshared program
  return TrainBatch(input_ids=inp, target_ids=tgt, loss_mask=mask, positions=pos,
                    segment_ids=seg, seq_ids=sid, seq_valid=valid, advantages=adv,
                    behaviour_logp=beh if with_behaviour else None,
                    prefix_ids=pre if pre.any() else None)


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


class ShapeReuse:
  """The trimmed shapes the learner has compiled, and which one a batch runs in.

  Each new (rows, positions) is a new XLA program: ~2.5 s to compile the tiny model's train
  step on this 2-core CPU, ~35 of its steps. A GRPO batch's rows move with the groups a step
  drops (zero variance: 5, 6, 7 of 8 rows) and its positions with the completion lengths, so
  bucketing alone compiled a program for most of those combinations. `choose(own)` instead:

    1. the smallest compiled shape that holds `own` (≥ in both), if its area is at most
       `slack` × own's (the padding costs at most (slack - 1) × the step's compute) and `own`
       has run padded fewer than `rebuy_after` times (then it gets its own program: a shape
       that keeps coming back is worth its compile);
    2. else a new shape (max(rows, the most rows compiled), positions): a row count seen
       before is likely again, at any length, so one longer program serves both.

  Exact like fit_shape (only padding is added back). Deterministic in the shapes it is given,
  so every process picks the same one from the agreed shape, and a resumed run picks what the
  uninterrupted one did from the checkpointed `state()`.
  """

  def __init__(self, slack: float = 2.0, rebuy_after: int = 16,
               state: Optional[dict] = None):
    self.slack, self.rebuy_after = float(slack), int(rebuy_after)
    state = state or {}
    self.compiled: list[tuple[int, int]] = [tuple(s) for s in state.get("compiled", [])]
    self.padded_runs: dict[tuple[int, int], int] = {
        tuple(int(x) for x in k.split("x")): int(v) for k, v in state.get("padded", {}).items()}
    self.last_padding = 0.0

  def choose(self, own: Sequence[int]) -> tuple[int, int]:
    r, t = (int(x) for x in own)
    covers = [s for s in self.compiled if s[0] >= r and s[1] >= t]
    if covers:
      best = min(covers, key=lambda s: (s[0] * s[1], s))
      if best == (r, t):
        self.last_padding = 0.0
        return best
      if (best[0] * best[1] <= self.slack * r * t
          and self.padded_runs.get((r, t), 0) < self.rebuy_after):
        self.padded_runs[(r, t)] = self.padded_runs.get((r, t), 0) + 1
        self.last_padding = 1.0 - r * t / (best[0] * best[1])
        return best
    rows = max([r] + [s[0] for s in self.compiled]) if not covers else r
    new = (rows, t)
    self.compiled.append(new)
    self.last_padding = 1.0 - r * t / (rows * t)
    return new

  def state(self) -> dict:
    return {"compiled": [list(s) for s in self.compiled],
            "padded": {f"{r}x{t}": n for (r, t), n in self.padded_runs.items()}}

  def metrics(self) -> dict[str, float]:
    return {"batch/shapes_compiled": float(len(self.compiled)),
            "batch/shape_padding_frac": self.last_padding}


def sft_trajectory(prompt_ids: Sequence[int], answer_ids: Sequence[int], tid: str,
                   task_id: Optional[str] = None) -> Trajectory:
  """A supervised example as a trajectory: loss on the answer tokens only."""
  ids = list(prompt_ids) + list(answer_ids)
  return Trajectory(id=tid, task_id=task_id or tid, token_ids=ids,
                    loss_mask=[0] * len(prompt_ids) + [1] * len(answer_ids),
                    behaviour_logprobs=[0.0] * len(ids), policy_version=[-1] * len(ids))
