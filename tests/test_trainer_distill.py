"""The run with a self-distillation loss: the teacher wired through RunConfig, rl_step and the
trainer, on the hidden-rule task whose grader gives free-text feedback (envs/hidden_rule.py)."""
import pytest

from posttrain_jax.metrics import read_metrics
from posttrain_jax.run_config import run_config_from_dict
from posttrain_jax.trainer import Trainer


def distill_run(workdir, grader="hidden_rule", **rl):
  return run_config_from_dict({
      "workdir": str(workdir), "seed": 0, "grader": grader,
      "model": {"tiny": {"vocab_size": 320, "hidden_size": 32, "intermediate_size": 64,
                         "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8,
                         "corpus_lines": 500}},
      "tasks": {"source": "synthetic", "generator": "string_rule", "eval_fraction": 0.2,
                "eval_size": 4, "generator_config": {"stated_frac": 0.0}},
      "rl": {"steps": 2, "prompts_per_step": 4, "rollout": {"group_size": 1, "max_tokens": 4},
             "advantage": {"estimator": "running"},
             "learner": {"loss": "sampled_distill", "optimizer": {"learning_rate": 1e-3}},
             "teacher": {"template": "{context} | {prompt}", "feedback_template": "{text}",
                         "seq_len": 48},
             "batch": {"rows": 8, "seq_len": 32, "max_seqs": 8, "pack": False}, **rl},
      "eval": {"every_steps": 0, "samples_per_prompt": 1, "max_tokens": 4, "greedy": False},
      "checkpoint": {"every_steps": 1},
  })


def _rl_rows(workdir):
  return [r for r in read_metrics(workdir / "metrics.jsonl") if "distill/no_context_frac" in r]


def test_every_graded_attempt_with_feedback_is_scored_by_the_teacher(tmp_path):
  Trainer(distill_run(tmp_path / "a"), log=lambda *_: None).run()
  rows = _rl_rows(tmp_path / "a")
  assert [r["step"] for r in rows] == [1, 2]
  for r in rows:   # the hidden_rule grader gives feedback on every attempt
    assert r["distill/no_context_frac"] == 0.0 and r["distill/teacher_token_frac"] == 1.0
    assert r["distill/reverse_kl"] == r["distill/reverse_kl"]   # finite: scored, not NaN
    assert r["skipped_update"] == 0.0


def test_attempts_without_feedback_have_no_teacher_and_are_counted(tmp_path):
  # exact_match grades the same tasks but says nothing: no context, so no distillation term
  Trainer(distill_run(tmp_path / "b", grader="exact_match"), log=lambda *_: None).run()
  for r in _rl_rows(tmp_path / "b"):
    assert r["distill/no_context_frac"] == 1.0 and r["distill/teacher_token_frac"] == 0.0


def test_an_ema_teacher_refuses_to_resume_instead_of_restarting_its_average(tmp_path):
  cfg = distill_run(tmp_path / "c", teacher={"weights": "ema", "template": "{context} | {prompt}",
                                             "feedback_template": "{text}", "seq_len": 48})
  assert Trainer(run_config_from_dict({**_as_dict(cfg), "stop_after_step": 1}),
                 log=lambda *_: None).run() is None
  with pytest.raises(ValueError, match="EMA.*not checkpointed"):
    Trainer(cfg, log=lambda *_: None).run()


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
