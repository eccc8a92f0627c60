"""rl.oversample (DAPO's dynamic sampling, one round): which groups a step trains, against
hand-picked groups; a step that trains them against a step given only those groups; the run
that draws the extra prompts and reports what it left out."""

import jax
import numpy as np
import pytest

from posttrain_jax import batching
from posttrain_jax.advantages import AdvantageConfig, compute_advantages
from posttrain_jax.config_io import ConfigTypeError
from posttrain_jax.learner import Learner, LearnerConfig, OptimizerConfig
from posttrain_jax.metrics import read_metrics
from posttrain_jax.run.rl_step import rl_step, signal_first
from posttrain_jax.run_config import run_config_from_dict
from posttrain_jax.run import Trainer
from posttrain_jax.types import Status, Trajectory
from tests.support.learner import VOCAB, FixedSource, small_model
from tests.support.runs import tiny_run


def _group(name, rewards, seed, status=None):
  rng = np.random.default_rng(seed)
  out = []
  for i, r in enumerate(rewards):
    ids = rng.integers(0, VOCAB, 3 + 2 + i % 3).tolist()
    out.append(Trajectory(
        id=f"{name}.{i}", task_id=name, group_id=name, token_ids=ids,
        loss_mask=[0] * 3 + [1] * (len(ids) - 3),
        behaviour_logprobs=[0.0] * 3 + [-1.0] * (len(ids) - 3),
        policy_version=[-1] * 3 + [0] * (len(ids) - 3), reward=r,
        status=status[i] if status else Status.OK))
  return out


# draw order: no signal, signal, no signal, signal (one member an infra error), signal
GROUPS = {"a": [1.0, 1.0, 1.0], "b": [1.0, 0.0, 0.0], "c": [0.0, 0.0, 0.0],
          "d": [0.0, 1.0, None], "e": [0.0, 0.0, 1.0]}


def _drawn():
  out = []
  for k, (name, rewards) in enumerate(GROUPS.items()):
    status = ([Status.OK, Status.OK, Status.INFRA_ERROR] if name == "d" else None)
    out += _group(name, rewards, k, status)
  return out


def _names(trajs, keep):
  return sorted({t.group_id for t, k in zip(trajs, keep) if k})


def test_signal_groups_are_trained_first_in_draw_order_then_the_rest():
  trajs = _drawn()
  adv = compute_advantages(trajs, AdvantageConfig())
  keep, m = signal_first(trajs, adv, 2)
  assert _names(trajs, keep) == ["b", "d"]
  assert m == {"filter/oversample_dropped_frac": 3 / 5, "batch/signal_group_frac": 1.0}
  assert not keep[[t.id for t in trajs].index("d.2")]       # the infra error stays out
  keep, m = signal_first(trajs, adv, 4)                      # 3 with a signal, then "a"
  assert _names(trajs, keep) == ["a", "b", "d", "e"]
  assert m == {"filter/oversample_dropped_frac": 1 / 5, "batch/signal_group_frac": 3 / 4}
  keep, m = signal_first(trajs, adv, 9)                      # more than drawn: all of them
  assert list(keep) == list(adv.keep) and m["filter/oversample_dropped_frac"] == 0.0
  with pytest.raises(ValueError, match="train_groups"):
    signal_first(trajs, adv, 0)


def _learner():
  return Learner(small_model(), LearnerConfig(
      loss="grpo", optimizer=OptimizerConfig(learning_rate=1e-2)))


def test_a_step_trains_the_chosen_groups_as_if_only_they_were_drawn():
  trajs = _drawn()
  only = [t for t in trajs if t.group_id in ("b", "d")]
  cfg = batching.BatchConfig(rows=16, seq_len=16, max_seqs=16, pack=False)
  kw = dict(advantage=AdvantageConfig(), step=0, version=0, batch_cfg=cfg)
  picked, alone = _learner(), _learner()
  a = rl_step(picked, FixedSource(trajs), train_groups=2, **kw)
  b = rl_step(alone, FixedSource(only), **kw)
  for k in ("loss", "pg_loss", "grad_norm", "tokens"):
    assert a.metrics[k] == pytest.approx(b.metrics[k], rel=1e-6), k
  for x, y in zip(jax.tree.leaves(picked.params), jax.tree.leaves(alone.params)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)
  # the reward is the policy's on everything drawn (infra errors apart), not on the picked
  drawn = [r for rs in GROUPS.values() for r in rs if r is not None]
  assert a.metrics["reward/mean"] == pytest.approx(np.mean(drawn))
  assert b.metrics["reward/mean"] != pytest.approx(np.mean(drawn))
  assert a.metrics["filter/oversample_dropped_frac"] == pytest.approx(0.6)


def test_the_run_draws_the_extra_prompts_and_reports_what_it_left_out(tmp_path):
  cfg = tiny_run(tmp_path, sft={"steps": 0},
                 rl={"steps": 2, "prompts_per_step": 2, "oversample": 0.5,
                     "rollout": {"group_size": 4, "max_tokens": 4},
                     "learner": {"loss": "grpo", "optimizer": {"learning_rate": 1e-3}},
                     "batch": {"rows": 8, "seq_len": 32, "max_seqs": 8, "pack": False}},
                 eval={"every_steps": 0, "samples_per_prompt": 1, "max_tokens": 4})
  trainer = Trainer(cfg, log=lambda *_: None)
  trainer.run()
  rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "data/hash" in r]
  assert len(rows) == 2
  for r in rows:   # 3 drawn (ceil(2 · 1.5)), 2 trained: one group of 3 left out, counted
    assert r["filter/oversample_dropped_frac"] == pytest.approx(1 / 3)
    assert 0.0 <= r["batch/signal_group_frac"] <= 1.0
  assert trainer.source._next_draw == 6


@pytest.mark.parametrize("rl, match", [
    ({"oversample": -0.5}, "config.rl: RLPhaseConfig.oversample must be ≥ 0"),
    ({"oversample": 0.5, "mode": "async"}, "config.rl: rl.oversample=0.5 draws extra prompts"),
])
def test_a_bad_oversample_is_one_error_naming_the_field(tmp_path, rl, match):
  with pytest.raises(ConfigTypeError, match=match):
    run_config_from_dict({"workdir": str(tmp_path), "rl": rl})
