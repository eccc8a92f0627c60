"""A held-out eval whose engine fails (issue R item 2): retried with rl.retry's backoff; if every
attempt fails, reported (NaN accuracy, eval/failed = 1, a log line) and the run trains on,
instead of a crash that loses hours of training. A bug (any other exception) still raises.

The engine is tests/support's registered "fake": the embedded sampler, failing chosen held-out
eval calls (eval generates with its own seed; rollouts never do)."""
import math

import numpy as np
import pytest

from posttrain_jax.metrics import read_metrics
from posttrain_jax.run import Trainer
from tests.support import fake_engine  # noqa: F401  (registers the "fake" engine)
from tests.support.runs import final_weights, tiny_run


def _run(workdir, fail_calls, max_retries, error="engine", fail_on="eval"):
  log = []
  cfg = tiny_run(workdir, rl={
      "steps": 4, "prompts_per_step": 2, "engine": "fake",
      "engine_config": {"fail_calls": list(fail_calls), "fail_on": fail_on, "error": error},
      "retry": {"backoff_s": 0.0, "max_retries": max_retries},
      "rollout": {"group_size": 4, "max_tokens": 4},
      "learner": {"loss": "grpo", "optimizer": {"learning_rate": 1e-3}},
      "batch": {"rows": 8, "seq_len": 32, "max_seqs": 8, "pack": False}})
  trainer = Trainer(cfg, log=log.append)
  result = trainer.run()
  result = result and {**result, "eval_calls": trainer.engine.counted}
  evals = {r["step"]: r for r in read_metrics(workdir / "metrics.jsonl")
           if any(k.startswith("eval/accuracy") for k in r)}
  return result, evals, log


def _same_weights(workdir, clean_dir):
  a, b = final_weights(workdir / "final_model"), final_weights(clean_dir / "final_model")
  assert a.keys() == b.keys()
  for name in a:
    np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
  d = tmp_path_factory.mktemp("clean")
  return (*_run(d, (), 3), d)


def test_a_failing_eval_is_retried_and_gives_the_same_accuracy(tmp_path, clean):
  # eval calls: 1 = before RL, 2 = after RL step 2 (fails), 3 = its retry (fails), 4 = it again
  result, evals, log = _run(tmp_path, fail_calls=(2, 3), max_retries=3)
  _, clean_evals, _, _ = clean
  assert sorted(evals) == sorted(clean_evals) and len(evals) == 3
  mid = sorted(evals)[1]
  assert evals[mid]["eval/retries"] == 2 and "eval/failed" not in evals[mid]
  assert evals[mid]["eval/accuracy"] == clean_evals[mid]["eval/accuracy"]
  assert result["eval_calls"] == clean[0]["eval_calls"] + 2 == 5
  _same_weights(tmp_path, clean[3])
  assert sum("held-out eval attempt" in line for line in log) == 2


@pytest.mark.slow  # > 30 s: CI's slow stage
def test_an_eval_that_keeps_failing_is_reported_and_the_run_goes_on(tmp_path, clean):
  result, evals, log = _run(tmp_path, fail_calls=(2, 3), max_retries=1)
  mid = sorted(evals)[1]
  assert evals[mid]["eval/failed"] == 1 and evals[mid]["eval/retries"] == 2
  acc = evals[mid]["eval/accuracy"]
  assert acc is None or math.isnan(acc)  # NaN is written as null
  assert any("held-out eval FAILED after 2 attempt(s)" in line and "engine down" in line
             for line in log)
  # training was not touched by the failed eval: same final weights as the clean run, and the
  # final eval ran (call 4)
  assert result is not None and result["eval_calls"] == 4
  assert not math.isnan(result["heldout_after"])
  _same_weights(tmp_path, clean[3])
  steps = [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if "reward/mean" in r]
  assert len(steps) == 4


def test_a_bug_in_eval_still_raises(tmp_path):
  with pytest.raises(ValueError, match="a bug in our code"):
    _run(tmp_path, fail_calls=(1,), max_retries=3, error="bug")


def test_a_failing_rollout_call_is_retried_never_scored_and_trains_the_same_weights(tmp_path, clean):
  """An infrastructure failure during rollouts is not reward 0: the step's failed generate call
  is retried (rl.retry), the metrics of that step say so, and with seeded sampling the run ends
  on the clean run's weights exactly."""
  result, _, _ = _run(tmp_path, fail_calls=(2,), max_retries=3, fail_on="rollout")
  assert result is not None and math.isfinite(result["heldout_after"])
  rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "reward/mean" in r]
  clean_rows = [r for r in read_metrics(clean[3] / "metrics.jsonl") if "reward/mean" in r]
  assert sum(r["rollout/engine_errors"] for r in rows) == 1
  assert sum(r["rollout/retries"] for r in rows) >= 1
  assert [r["reward/mean"] for r in rows] == [r["reward/mean"] for r in clean_rows]
  _same_weights(tmp_path, clean[3])
