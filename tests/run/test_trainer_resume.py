"""Resume and run-level defects: the running baseline threads through the run and the
checkpoint, the SFT -> RL boundary resumes, a changed config is refused or reported, an async
checkpoint is never resumed in sync mode, and resume restores into abstract shapes."""
import numpy as np
import pytest

from posttrain_jax.checkpoint import Checkpointer
from posttrain_jax.config_io import ConfigTypeError
from posttrain_jax.metrics import read_metrics
from posttrain_jax.models import hf_io
from posttrain_jax.run import Trainer
from tests.support.runs import final_weights, tiny_run
from tests.support.runs import QUIET, running_run





def _baseline(workdir, step):
  return Checkpointer(workdir / "checkpoints").read_extra(step)["baseline"]


def test_running_baseline_gives_nonzero_advantages_and_survives_resume(tmp_path):
  straight = Trainer(running_run(tmp_path / "a"), **QUIET)
  assert straight.run() is not None
  rows = [r for r in read_metrics(tmp_path / "a" / "metrics.jsonl") if "baseline/tasks" in r]
  assert len(rows) == 6 and rows[-1]["baseline/tasks"] > 0
  # advantages were not all zero: the policy moved (with A = 0 every gradient is 0 and AdamW
  # leaves the weights exactly where they started)
  start = final_weights(straight.parts.model_dir)
  end = final_weights(tmp_path / "a" / "final_model")
  assert any(not np.array_equal(start[k], end[k]) for k in start)
  assert any(r["grad_norm"] > 0 for r in rows)
  # stop at 3, resume to 6: the baseline is restored bit for bit and the run is identical
  assert Trainer(running_run(tmp_path / "b", stop_after_step=3), **QUIET).run() is None
  saved = _baseline(tmp_path / "b", 3)
  assert saved == _baseline(tmp_path / "a", 3) and saved["task_means"]
  assert Trainer(running_run(tmp_path / "b"), **QUIET).run() is not None
  assert _baseline(tmp_path / "b", 6) == _baseline(tmp_path / "a", 6)
  b = final_weights(tmp_path / "b" / "final_model")
  for k in end:
    np.testing.assert_array_equal(end[k], b[k], err_msg=k)


@pytest.mark.slow  # > 30 s: CI's slow stage
def test_resume_at_the_sft_to_rl_boundary(tmp_path):
  """A stop right after the step-`sft.steps` checkpoint resumes, and equals a straight run; a
  boundary checkpoint whose sft_model/ went missing is re-exported from the checkpoint."""
  straight = Trainer(tiny_run(tmp_path / "a"), **QUIET).run()
  assert Trainer(tiny_run(tmp_path / "b", stop_after_step=2), **QUIET).run() is None
  assert (tmp_path / "b" / "sft_model" / "config.json").exists()  # exported before the save
  import shutil
  shutil.rmtree(tmp_path / "b" / "sft_model")                    # as if killed before export
  resumed = Trainer(tiny_run(tmp_path / "b"), **QUIET).run()
  assert resumed is not None
  a, b = final_weights(tmp_path / "a" / "final_model"), final_weights(tmp_path / "b" / "final_model")
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)
  assert resumed["reward_last10"] == pytest.approx(straight["reward_last10"])


def test_changed_config_on_resume_is_refused_or_reported(tmp_path):
  assert Trainer(tiny_run(tmp_path, stop_after_step=3), **QUIET).run() is None
  with pytest.raises(ConfigTypeError, match=r"rl\.rollout\.group_size: 4 vs 2"):
    Trainer(tiny_run(tmp_path, rl={**_rl(), "rollout": {"group_size": 2, "max_tokens": 4}}),
            **QUIET).run()
  with pytest.raises(ConfigTypeError, match=r"rl\.teacher\.weights: 'student' vs 'frozen'"):
    Trainer(tiny_run(tmp_path, rl={**_rl(), "teacher": {"weights": "frozen"}}), **QUIET).run()
  logs = []
  rl = _rl()
  rl["learner"] = {"loss": "grpo", "optimizer": {"learning_rate": 5e-4}}
  Trainer(tiny_run(tmp_path, rl=rl, stop_after_step=4), log=logs.append).run()
  assert any("rl.learner.optimizer.learning_rate: 0.001 -> 0.0005" in m for m in logs), logs


def _rl():
  """tiny_run's RL section (to change one field of it)."""
  return {"steps": 4, "prompts_per_step": 2, "rollout": {"group_size": 4, "max_tokens": 4},
          "learner": {"loss": "grpo", "optimizer": {"learning_rate": 1e-3}},
          "batch": {"rows": 8, "seq_len": 32, "max_seqs": 8, "pack": False}}


def test_async_checkpoint_is_not_resumed_in_sync_mode(tmp_path):
  """The async checkpoint holds queued groups and unfinished work: a sync resume would drop
  them silently."""
  from tests.support.runs import async_run
  assert Trainer(async_run(tmp_path, stop_after_step=2), **QUIET).run() is None
  assert Checkpointer(tmp_path / "checkpoints").read_extra(2)["rollouts"]["kind"] == "async"
  sync = tiny_run(tmp_path, sft={"steps": 0}, rl={**_rl(), "steps": 5},
                  eval={"every_steps": 0, "samples_per_prompt": 1, "max_tokens": 4,
                        "greedy": False}, checkpoint={"every_steps": 2})
  with pytest.raises(ConfigTypeError, match=r"different .*rl\.mode.*'async' vs 'sync'"):
    Trainer(sync, **QUIET).run()


def test_resume_restores_into_abstract_shapes(tmp_path, monkeypatch):
  """Resuming the RL phase builds no TrainState from the HF weights besides the restored one
  (the old code built a whole Learner only to get the checkpoint's shapes)."""
  cfg = running_run(tmp_path)
  assert Trainer(running_run(tmp_path, stop_after_step=3), **QUIET).run() is None
  loads = []
  real = hf_io.load_hf_model
  monkeypatch.setattr(hf_io, "load_hf_model", lambda *a, **k: loads.append(a) or real(*a, **k))
  assert Trainer(cfg, **QUIET).run() is not None
  assert loads == []      # reference_kl off: nothing needs the start weights on resume
