"""The run with a self-distillation loss: the teacher wired through RunConfig, rl_step and the
trainer, on the hidden-rule task whose grader gives free-text feedback (tasks/hidden_rule.py)."""
import jax
import numpy as np
import pytest
from flax import nnx

from posttrain_jax.metrics import read_metrics
from posttrain_jax.models import hf_io
from posttrain_jax.run_config import run_config_from_dict
from posttrain_jax.run import Trainer
from tests.support.runs import distill_run




def _rl_rows(workdir):
  return [r for r in read_metrics(workdir / "metrics.jsonl") if "distill/no_context_frac" in r]


def test_every_graded_attempt_with_feedback_is_scored_by_the_teacher(tmp_path):
  Trainer(distill_run(tmp_path / "a"), log=lambda *_: None).run()
  rows = _rl_rows(tmp_path / "a")
  assert [r["step"] for r in rows] == [1, 2]
  for r in rows:   # the hidden_rule grader gives feedback on every attempt
    assert r["distill/no_context_frac"] == 0.0 and r["distill/teacher_token_frac"] == 1.0
    # scored: a finite value (x == x held for ±inf too), and not 0: the teacher saw the feedback
    assert np.isfinite(r["distill/reverse_kl"]) and r["distill/reverse_kl"] != 0.0
    assert r["skipped_update"] == 0.0


def test_attempts_without_feedback_have_no_teacher_and_are_counted(tmp_path):
  # exact_match grades the same tasks but says nothing: no context, so no distillation term
  Trainer(distill_run(tmp_path / "b", grader="exact_match"), log=lambda *_: None).run()
  for r in _rl_rows(tmp_path / "b"):
    assert r["distill/no_context_frac"] == 1.0 and r["distill/teacher_token_frac"] == 0.0


@pytest.mark.parametrize("loss, lora", [("sampled_distill", None), ("full_distill", None),
                                        ("full_distill", {"rank": 4, "alpha": 8.0})])
@pytest.mark.slow  # > 30 s: CI's slow stage
def test_an_ema_teacher_resumes_bit_for_bit(tmp_path, loss, lora):
  """Stop at step 2 of 4 and resume: the EMA saved with the checkpoint is restored, so the EMA
  and the final weights equal an uninterrupted run's exactly (and the EMA is not the student).
  With LoRA the EMA (and its checkpoint item) is the adapters alone."""
  from posttrain_jax.checkpoint import Checkpointer
  from posttrain_jax.learner import abstract_train_state
  from tests.support.runs import final_weights
  teacher = {"weights": "ema", "ema_rate": 0.5, "template": "{context} | {prompt}",
             "feedback_template": "{text}", "seq_len": 48}
  learner = {"loss": loss, "optimizer": {"learning_rate": 1e-3 if lora is None else 3e-2}}
  if lora is not None:
    learner["lora"] = lora
  over = dict(steps=4, teacher=teacher, learner=learner,
              loss={"topk": 8} if loss == "full_distill" else None)
  cfg = lambda d, **kw: run_config_from_dict({**_as_dict(distill_run(tmp_path / d, **over)),
                                              "checkpoint": {"every_steps": 2}, **kw})
  straight = Trainer(cfg("a"), log=lambda *_: None)
  assert straight.run() is not None
  assert Trainer(cfg("b", stop_after_step=2), log=lambda *_: None).run() is None
  resumed = Trainer(cfg("b"), log=lambda *_: None)
  assert resumed.run() is not None
  a, b = final_weights(tmp_path / "a" / "final_model"), final_weights(tmp_path / "b" / "final_model")
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)
  model = hf_io.load_hf_model(straight.parts.model_dir)
  like = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  if lora is not None:   # the adapters' shapes; the start: the learner's fresh adapters
    like = abstract_train_state(model, straight.cfg.rl.learner).params
    assert all(str(p[-1].key).startswith("lora_") for p, _ in jax.tree.leaves_with_path(like))
  ema = {d: Checkpointer(tmp_path / d / "checkpoints").restore_arrays("teacher", like, 4)
         for d in ("a", "b")}
  start = (jax.tree.leaves(like) if lora is None else
           jax.tree.leaves(Checkpointer(tmp_path / "a" / "checkpoints").restore_arrays(
               "teacher", like, 2)))   # the EMA at step 2 (it moves on after)
  moved = False
  for ea, eb, s0 in zip(jax.tree.leaves(ema["a"]), jax.tree.leaves(ema["b"]), start):
    np.testing.assert_array_equal(np.asarray(ea), np.asarray(eb))
    moved |= not np.array_equal(np.asarray(ea), np.asarray(s0))
  assert moved                                     # the EMA followed the updates
  losses = [[r["loss"] for r in _rl_rows(tmp_path / d)] for d in ("a", "b")]
  assert len(losses[0]) == 4 and losses[0] == losses[1]


def test_an_ema_teacher_does_not_resume_a_checkpoint_without_one(tmp_path):
  """A run started with another teacher is refused by the config check (rl.teacher.weights is
  fixed on resume); an EMA checkpoint whose teacher item is gone is refused by name."""
  import shutil
  from posttrain_jax.config_io import ConfigTypeError
  assert Trainer(run_config_from_dict({**_as_dict(distill_run(tmp_path / "s", steps=3)),
                                       "stop_after_step": 1}), log=lambda *_: None).run() is None
  ema = {"weights": "ema", "template": "{context} | {prompt}", "feedback_template": "{text}",
         "seq_len": 48}
  with pytest.raises(ConfigTypeError, match="rl.teacher.weights: 'student' vs 'ema'"):
    Trainer(distill_run(tmp_path / "s", steps=3, teacher=ema), log=lambda *_: None).run()
  assert Trainer(run_config_from_dict({**_as_dict(distill_run(tmp_path / "e", steps=3,
                                                              teacher=ema)),
                                       "stop_after_step": 1}), log=lambda *_: None).run() is None
  shutil.rmtree(tmp_path / "e" / "checkpoints" / "1" / "teacher")
  with pytest.raises(ConfigTypeError, match="holds no saved 'ema' teacher"):
    Trainer(distill_run(tmp_path / "e", steps=3, teacher=ema), log=lambda *_: None).run()


def _as_dict(cfg):
  from posttrain_jax.config_io import to_dict
  return to_dict(cfg)


@pytest.mark.parametrize("weights", ["student", "ema"])
def test_full_distribution_distillation_runs(tmp_path, weights):
  loss = {"learner": {"loss": "full_distill", "optimizer": {"learning_rate": 1e-3}},
          "loss": {"topk": 8}}
  teacher = {"weights": weights, "template": "{context} | {prompt}", "feedback_template": "{text}",
             "seq_len": 48}
  Trainer(distill_run(tmp_path / weights, teacher=teacher, **loss), log=lambda *_: None).run()
  rows = _rl_rows(tmp_path / weights)
  assert [r["step"] for r in rows] == [1, 2]
  assert all(r["distill/teacher_token_frac"] == 1.0 and r["distill/divergence"] > 0 for r in rows)


@pytest.mark.parametrize("over, match", [
    (dict(learner={"loss": "kl"}, loss={"against": "teacher"}), "teacher_mask"),
    (dict(update_epochs=2), "update_epochs")])
def test_distillation_configs_the_teacher_cannot_serve_are_refused(tmp_path, over, match):
  from posttrain_jax.config_io import ConfigTypeError
  with pytest.raises((ConfigTypeError, ValueError), match=match):
    distill_run(tmp_path / "f", **over)
