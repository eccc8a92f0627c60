"""Per-step episode signals, against counts done by hand."""
import pytest

from posttrain_jax.step_metrics import episode_signals
from posttrain_jax.types import Status, Trajectory


def traj(i, status=Status.OK, mask=(0, 1), **metrics):
  return Trajectory(id=f"t{i}", task_id="x", token_ids=[1] * len(mask), loss_mask=list(mask),
                    behaviour_logprobs=[0.0] * len(mask), policy_version=[0] * len(mask),
                    reward=None if status is Status.INFRA_ERROR else 0.0, status=status,
                    metrics=metrics)


def test_signals_by_hand():
  trajs = [
      traj(0, turns=2, tool_calls=1, difficulty="hard"),
      traj(1, Status.TIMEOUT, turns=4, tool_calls=4, **{"tool_errors/malformed": 2.0},
           difficulty="hard"),
      traj(2, Status.TIMEOUT, turns=3, tool_calls=3, difficulty="easy"),
      traj(3, Status.INFRA_ERROR, turns=1, tool_calls=0, difficulty="easy"),
      traj(4, Status.TRUNCATED, mask=(0, 0), turns=1, tool_calls=0, difficulty="easy"),
      traj(5, turns=9, sample_index=1),          # a second sample of episode 1: not counted again
  ]
  s = episode_signals(trajs)
  assert s["status/timeout_frac"] == pytest.approx(2 / 5)
  assert s["status/timeout_frac/hard"] == pytest.approx(1 / 2)
  assert s["status/timeout_frac/easy"] == pytest.approx(1 / 3)
  assert s["status/infra_error_frac"] == s["filter/infra_error_frac"] == pytest.approx(1 / 5)
  assert s["filter/truncated_mask_frac"] == pytest.approx(1 / 5)
  assert s["episode/turns"] == pytest.approx(11 / 5)
  assert s["episode/tool_calls"] == pytest.approx(8 / 5)
  assert s["episode/tool_call_rate"] == pytest.approx(8 / 11)
  assert s["episode/malformed_call_rate"] == pytest.approx(2 / 11)
  assert s["episode/tool_errors/malformed"] == pytest.approx(2 / 5)


def test_single_turn_has_no_episode_signals():
  s = episode_signals([traj(0), traj(1, Status.TRUNCATED)])
  assert s["status/truncated_frac"] == 0.5 and not any(k.startswith("episode/") for k in s)
  assert episode_signals([]) == {}
