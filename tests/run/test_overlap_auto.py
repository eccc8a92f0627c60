"""rl.mode="auto": the bound (overlap.decide) against hand-computed figures, and the run that
measures it: sync probe steps, the choice in the log, the checkpoint and metrics.jsonl, and a
turn to async that continues the task draws and trains with the off-policy correction."""
import dataclasses

import pytest

from posttrain_jax import overlap
from posttrain_jax.checkpoint import Checkpointer, CheckpointConfig
from posttrain_jax.metrics import read_metrics
from posttrain_jax.run import Trainer
from tests.support.runs import tiny_run


def test_the_bound_turns_async_only_where_the_devices_overlap():
  # separate devices (a vLLM server): both at once take as long as the longer one, o = 1;
  # async ≈ g + t + f − min(g, t + f) = 0.05 + 0.05 + 0.02 − 0.05 = 0.07 vs sync 0.10
  apart = overlap.Probe(generate_s=0.05, train_s=0.05, forward_s=0.02, generate_alone_s=0.05,
                        together_s=0.05)
  d = overlap.decide(apart, min_gain=0.1)
  assert d.mode == "async" and d.overlap == 1.0
  assert d.async_step_s == pytest.approx(0.07) and d.sync_step_s == pytest.approx(0.10)
  assert "overlap 1.00" in d.why and "+30.0%" in d.why
  # one set of cores (this CPU's embedded sampler): at once = one after the other, o = 0, and
  # async only adds the correction's forward
  shared = dataclasses.replace(apart, together_s=0.07)
  d = overlap.decide(shared, min_gain=0.1)
  assert d.mode == "sync" and d.overlap == 0.0 and d.async_step_s == pytest.approx(0.12)
  # half the shorter one overlaps: 0.12 − 0.5 · 0.05 = 0.095, a 5% gain: under a 10% bar,
  # over a 4% one
  half = dataclasses.replace(apart, together_s=0.06)
  assert overlap.decide(half, 0.1).mode == "sync"
  assert overlap.decide(half, 0.04).mode == "async"
  assert overlap.decide(half, 0.04).async_step_s == pytest.approx(0.095)
  # k forwards beside the generation: 2 × 0.02 = 0.04 of forward work; at once 0.07 of 0.09
  # saves 0.02 of the shorter 0.04: o = 0.5 again
  reps = dataclasses.replace(apart, together_s=0.07, forward_reps=2)
  assert overlap.decide(reps, 0.1).overlap == pytest.approx(0.5)
  with pytest.raises(ValueError, match="probe_steps"):
    overlap.AutoModeConfig(probe_steps=0)


def test_measure_times_each_alone_then_both_at_once():
  calls = []
  g1, f, b, k = overlap.measure(lambda: calls.append("g"), lambda: calls.append("f"), rounds=2)
  # one untimed call each (compiles), 2 rounds alone, then 2 rounds of one generation beside
  # k = round(g1 / f) forwards
  assert calls[:6] == ["g", "f"] * 3 and k >= 1
  assert sorted(calls[6:]) == ["f"] * (2 * k) + ["g"] * 2
  assert min(g1, f, b) >= 0
  with pytest.raises(RuntimeError, match="engine down"):
    overlap.measure(lambda: (_ for _ in ()).throw(RuntimeError("engine down")), lambda: None)


def _auto_run(workdir, **rl):
  return tiny_run(
      workdir, sft={"steps": 0},
      rl={"mode": "auto", "steps": 7, "prompts_per_step": 2,
          "auto": {"probe_steps": 3, "min_gain": 0.1},
          "replay": {"max_staleness": 1, "capacity": 8},
          "pool": {"concurrency": 2, "tasks_per_episode": 1},
          "rollout": {"group_size": 4, "max_tokens": 4},
          "learner": {"loss": "grpo", "optimizer": {"learning_rate": 1e-3}},
          "batch": {"rows": 8, "seq_len": 32, "max_seqs": 8, "pack": False}, **rl},
      eval={"every_steps": 0, "samples_per_prompt": 1, "max_tokens": 4, "greedy": False},
      checkpoint={"every_steps": 2})


@pytest.mark.parametrize("chosen", ["measured", "async"])
def test_auto_probes_then_runs_the_mode_it_chose(tmp_path, monkeypatch, chosen):
  """Probe steps are versions 1 to 3 (0 compiles; their median); the choice is logged with its figures,
  checkpointed and in every row after it. "async" forces the bound's answer to exercise the
  turn: the pool continues the draws (no task of the sync steps again) and the loss gets
  rl.async_correction (its importance-weight metrics appear)."""
  decide = overlap.decide
  if chosen == "async":
    monkeypatch.setattr(overlap, "decide", lambda p, g: dataclasses.replace(
        decide(p, g), mode="async", why="forced by the test"))
  logs = []
  result = Trainer(_auto_run(tmp_path), log=logs.append).run()
  assert result is not None
  said = [m for m in logs if m.startswith("rl.mode=auto:")]
  assert len(said) == 1, logs
  print("\n" + said[0])
  mode = said[0].split()[1]
  assert said[0].startswith(f"rl.mode=auto: {mode} from version 4 on: ")
  if chosen == "async":
    assert mode == "async"
  else:   # the embedded sampler shares the learner's 2 cores: measured, not forced
    assert "sync step" in said[0] and "overlap" in said[0]
  rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "rl/async" in r]
  assert [r["rl/async"] for r in rows] == [0.0] * 4 + [float(mode == "async")] * 3
  extra = Checkpointer(tmp_path / "checkpoints", CheckpointConfig()).read_extra(7)
  auto = extra["rollouts"]
  assert auto["kind"] == "auto" and auto["decision"]["mode"] == mode
  assert auto["decision"]["version"] == 4
  assert auto["inner"]["kind"] == ("async" if mode == "async" else "sync")
  corrected = ["correction/is_weight_mean" in r for r in rows]
  assert corrected == [False] * 4 + [mode == "async"] * 3
  seen = [r["data/hash"] for r in rows]
  assert len(set(seen)) == len(seen)       # every step trained tasks of its own draw
  if mode == "async":   # a resume keeps the choice: the async pool and the corrected loss
    logs.clear()
    more = dataclasses.replace(_auto_run(tmp_path), rl=dataclasses.replace(
        _auto_run(tmp_path).rl, steps=9))
    assert Trainer(more, log=logs.append).run() is not None
    assert not [m for m in logs if m.startswith("rl.mode=auto:")]
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "rl/async" in r]
    assert [r["rl/async"] for r in rows[7:]] == [1.0, 1.0]
    assert all("correction/is_weight_mean" in r for r in rows[7:])
