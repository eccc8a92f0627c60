"""Shared-prefix rows (batching.BatchConfig.share_prefix) against the plain layout: one task's
sequences attend one copy of their prompt, and the loss, every metric and the gradient are the
plain layout's (through each loss family, multi-turn masks, groups split over several rows,
micro-batches and a whole rl_step); a control shows the comparison fails when the branches
cannot see the prefix."""
import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from posttrain_jax import batching
from posttrain_jax.advantages import AdvantageConfig
from posttrain_jax.learner import Learner, LearnerConfig, OptimizerConfig
from posttrain_jax.losses import FullDistillConfig, GRPOConfig, GSPOConfig, M2POConfig, get_loss
from posttrain_jax.run.rl_step import rl_step
from posttrain_jax.types import Trajectory
from tests.support.learner import (CFG, VOCAB, FixedSource, assert_same_training, grads,
                                   small_model, with_scored_fields)

PLAIN = batching.BatchConfig(rows=32, seq_len=48, max_seqs=32, pack=False, share_prefix=False)
SHARED = dataclasses.replace(PLAIN, share_prefix=True)


def _traj(i, task, prompt, pieces, rng):
  """A trajectory of `prompt` then `pieces` [(n, sampled)]: sampled runs have loss mask 1 and
  behaviour log-probs, the others (a tool's output) mask 0."""
  ids, mask, beh = list(prompt), [0] * len(prompt), [0.0] * len(prompt)
  for n, sampled in pieces:
    ids += rng.integers(0, VOCAB, n).tolist()
    mask += [int(sampled)] * n
    beh += (-rng.random(n) * 4 - 1).tolist() if sampled else [0.0] * n
  return Trajectory(id=f"t{i}", task_id=task, group_id=task, token_ids=ids, loss_mask=mask,
                    behaviour_logprobs=beh, policy_version=[0 if m else -1 for m in mask],
                    reward=float(rng.integers(0, 2)))


def group_trajectories(seed=0):
  """Four groups: 6 single-turn answers to one prompt; 5 multi-turn episodes (sampled, a tool's
  output, sampled); 4 whose prompts part after 2 tokens; and a group of one."""
  rng = np.random.default_rng(seed)
  out = []
  p = rng.integers(0, VOCAB, 9).tolist()
  out += [_traj(len(out), "single", p, [(int(rng.integers(1, 6)), True)], rng) for _ in range(6)]
  p = rng.integers(0, VOCAB, 7).tolist()
  out += [_traj(len(out), "multi", p, [(int(rng.integers(1, 4)), True), (3, False),
                                       (int(rng.integers(1, 4)), True)], rng) for _ in range(5)]
  p = rng.integers(0, VOCAB, 8).tolist()
  for k in range(4):
    q = list(p)
    q[2] = (p[2] + k) % VOCAB           # the prompts agree on their first 2 tokens only
    out.append(_traj(len(out), "parted", q, [(int(rng.integers(1, 5)), True)], rng))
  out.append(_traj(len(out), "alone", rng.integers(0, VOCAB, 6).tolist(), [(4, True)], rng))
  return out


def _sampled(batch):
  """{(sequence, position): (target, advantage, behaviour logp)} over the sampled targets."""
  m = np.asarray(batch.loss_mask) > 0
  keys = zip(np.asarray(batch.seq_ids)[m], np.asarray(batch.positions)[m])
  vals = zip(np.asarray(batch.target_ids)[m], np.asarray(batch.advantages)[m],
             np.asarray(batch.behaviour_logp)[m])
  return {(int(s), int(p)): (int(t), float(a), float(b)) for (s, p), (t, a, b) in zip(keys, vals)}


def _carry_scores(plain, shared):
  """`shared` with plain's optional per-token fields moved to the same (sequence, position)."""
  fields = ("old_logp", "ref_logp", "teacher_logp", "teacher_mask", "teacher_hidden")
  where = {k: np.asarray(a) for k, a in
           zip(("sid", "pos", "mask"), (plain.seq_ids, plain.positions, plain.loss_mask))}
  at = {(int(s), int(p)): rc for s, p, rc in zip(
      where["sid"][where["mask"] > 0], where["pos"][where["mask"] > 0],
      zip(*np.nonzero(where["mask"] > 0)))}
  out = {}
  for f in fields:
    src = np.asarray(getattr(plain, f))
    dst = np.zeros(np.shape(shared.loss_mask) + src.shape[2:], src.dtype)
    m = np.asarray(shared.loss_mask) > 0
    for r, c in zip(*np.nonzero(m)):
      dst[r, c] = src[at[(int(shared.seq_ids[r, c]), int(shared.positions[r, c]))]]
    out[f] = dst
  return dataclasses.replace(shared, **out)


def _layouts(cfg=SHARED, seed=0):
  trajs = group_trajectories(seed)
  adv = np.random.default_rng(seed + 1).normal(size=len(trajs)).tolist()
  plain = with_scored_fields(batching.build_batch(trajs, adv, PLAIN), seed=seed)
  return trajs, plain, _carry_scores(plain, batching.build_batch(trajs, adv, cfg))


def test_shared_prefix_len_stops_at_the_first_sampled_target_and_at_a_difference():
  trajs = group_trajectories()
  single, multi, parted = trajs[:6], trajs[6:11], trajs[11:15]
  assert batching.shared_prefix_len(single) == 9            # the whole prompt
  assert batching.shared_prefix_len(multi) == 7             # not into the tool's output
  assert batching.shared_prefix_len(parted) == 2
  assert batching.shared_prefix_len(trajs[15:]) == 0        # alone
  twin = dataclasses.replace(single[0], id="twin")          # identical sampled tokens too
  assert batching.shared_prefix_len([single[0], twin]) == 9


def test_the_shared_layout_holds_every_sampled_target_once_in_fewer_positions():
  trajs, plain, shared = _layouts()
  assert _sampled(shared) == _sampled(plain)
  used = lambda b: int((np.asarray(b.segment_ids) > 0).sum())
  n = [len(t.token_ids) - 1 for t in trajs]
  saved = 8 * 5 + 6 * 4 + 1 * 3                # (L - 1)(G - 1): single, multi, parted
  assert used(plain) == sum(n) and used(shared) == sum(n) - saved
  # each branch attends its own prefix: prefix_ids name a segment of the same row, 0 elsewhere
  pre, seg = np.asarray(shared.prefix_ids), np.asarray(shared.segment_ids)
  for r, c in zip(*np.nonzero(pre)):
    assert pre[r, c] in seg[r, :c] and pre[r, c] != seg[r, c]
  assert batching.build_batch(trajs, [0.0] * len(trajs), PLAIN).prefix_ids is None


LOSS_CASES = [
    ("grpo", GRPOConfig(aggregation="token_mean")),
    ("grpo", GRPOConfig(aggregation="seq_mean_token_sum_norm", max_len=9, kl_coef=0.1)),
    ("gspo", GSPOConfig()),
    ("m2po", M2POConfig(tau=0.5, ratio_base="behaviour")),
    ("full_distill", FullDistillConfig(topk=None, impl="chunked")),
]


@pytest.mark.parametrize("name,loss_cfg", LOSS_CASES,
                         ids=[f"{n}-{i}" for i, (n, _) in enumerate(LOSS_CASES)])
def test_a_shared_prefix_batch_trains_like_the_plain_one(name, loss_cfg):
  _, plain, shared = _layouts()
  assert assert_same_training(plain, shared, name, loss_cfg) != 0


@pytest.mark.parametrize("pack", [False, True])
def test_a_group_longer_than_a_row_is_split_and_still_trains_alike(pack):
  cfg = dataclasses.replace(SHARED, seq_len=20, pack=pack)
  trajs, plain, shared = _layouts(cfg)
  assert _sampled(shared) == _sampled(plain)
  seg, pre = np.asarray(shared.segment_ids), np.asarray(shared.prefix_ids)
  prefixes = {(r, s) for r, s in zip(*np.nonzero(pre)) for s in [pre[r, s]]}
  assert len({r for r, _ in prefixes}) > 3, "the 4 shared groups should need more rows"
  assert int(seg.shape[1]) == 20
  assert_same_training(plain, shared, "grpo", GRPOConfig())


def test_the_comparison_fails_when_the_branches_cannot_see_the_prefix():
  """The check above can fail: with prefix_ids cleared, a branch attends only its own tokens."""
  _, plain, shared = _layouts()
  blind = dataclasses.replace(shared, prefix_ids=np.zeros_like(shared.prefix_ids))
  graphdef, params = nnx.split(small_model(), nnx.Param)
  kw = dict(graphdef=graphdef, spec=get_loss("grpo"), loss_cfg=GRPOConfig(),
            cfg=LearnerConfig(loss="grpo"))
  params = nnx.to_pure_dict(params)
  (_, m_plain), (_, m_blind) = grads(params, plain, kw), grads(params, blind, kw)
  assert float(m_blind["loss"][1]) == float(m_plain["loss"][1])   # same tokens counted
  assert not np.isclose(float(m_blind["loss"][0]), float(m_plain["loss"][0]), rtol=1e-4)


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_rl_step_with_shared_prefixes_updates_like_the_plain_layout(micro_batches):
  source = FixedSource(group_trajectories(seed=4))
  out = {}
  for cfg in (PLAIN, SHARED):
    learner = Learner(small_model(), LearnerConfig(
        loss="grpo", micro_batches=micro_batches, optimizer=OptimizerConfig(learning_rate=1e-2)))
    metrics = rl_step(learner, source, batch_cfg=cfg, advantage=AdvantageConfig(), step=0,
                      version=0).metrics
    out[cfg.share_prefix] = metrics, [np.asarray(x) for x in jax.tree.leaves(learner.params)]
  for k in ("loss", "pg_loss", "grad_norm", "tokens"):
    np.testing.assert_allclose(out[True][0][k], out[False][0][k], rtol=1e-5, err_msg=k)
  # Adam divides by sqrt(v): where a gradient is ~0 a 1e-9 difference in it (summation order)
  # moves that element by up to ~1e-5 of one 1e-2 step; atol is 1% of a step
  for a, b in zip(out[False][1], out[True][1]):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-4)
  first = [np.asarray(x) for x in jax.tree.leaves(nnx.state(small_model(), nnx.Param))]
  moved = any(not np.allclose(a, b) for a, b in zip(first, out[True][1]))
  assert moved, "the step did not train: the comparison would be vacuous"
