"""Early stops from the config: a held-out target (checked at in-run evals), a training-time
budget; greedy-only eval; cumulative train / eval seconds in metrics.jsonl. Each survives a
resume: a stopped run resumed finishes without training, unless the config no longer stops
there; the totals continue from the checkpoint."""
import numpy as np
import pytest

from posttrain_jax.checkpoint import Checkpointer
from posttrain_jax.metrics import read_metrics, time_to_target
from posttrain_jax.run import Trainer, result_line
from posttrain_jax.run.evaluation import Evaluator
from tests.support.runs import final_weights, tiny_run

_RL = {"steps": 8, "prompts_per_step": 2, "reference_kl": False,
       "rollout": {"group_size": 4, "max_tokens": 4},
       "learner": {"loss": "grpo", "optimizer": {"learning_rate": 1e-3}},
       "batch": {"rows": 8, "seq_len": 32, "max_seqs": 8, "pack": False}}
_GREEDY = {"every_steps": 2, "samples_per_prompt": 1, "max_tokens": 4, "greedy": True,
           "sampled": False}


def _run(workdir, rl=None, eval=None, **over):
  return tiny_run(workdir, rl={**_RL, **(rl or {})}, eval={**_GREEDY, **(eval or {})}, **over)


_EVALUATE = Evaluator.evaluate


def _scripted(monkeypatch, values):
  """Evaluator.evaluate runs for real, then reports the next scripted greedy accuracy."""
  real, calls = _EVALUATE, []

  def fake(self, engine):
    out = real(self, engine)
    accuracies = {k for k in out if k.count("/") == 1}
    assert accuracies == {"eval/accuracy_greedy"}, out   # greedy only: no sampled eval ran
    out["eval/accuracy_greedy"] = values[len(calls)]
    calls.append(out["eval/accuracy_greedy"])
    return out
  monkeypatch.setattr(Evaluator, "evaluate", fake)
  return calls


def _step_rows(workdir):
  return [r for r in read_metrics(workdir / "metrics.jsonl") if "data/hash" in r]


def _check_totals(workdir):
  """time/train_s_total is the running sum of every logged step's seconds, eval_s grows."""
  rows = read_metrics(workdir / "metrics.jsonl")
  steps = [r for r in rows if "data/hash" in r]
  np.testing.assert_allclose([r["time/train_s_total"] for r in steps],
                             np.cumsum([r["time/step_s"] for r in steps]), rtol=1e-9)
  evals = [r["time/eval_s_total"] for r in rows if "eval/accuracy_greedy" in r]
  assert evals and all(e > 0 for e in evals) and evals == sorted(evals)
  return rows


@pytest.mark.slow  # > 30 s: CI's slow stage
def test_target_stops_the_run_and_a_resume_finishes_it(tmp_path, monkeypatch):
  # evals: before RL, after RL step 2 (global 4), after RL step 4 (global 6): 0.9 >= 0.5 there
  calls = _scripted(monkeypatch, [0.1, 0.3, 0.9, 0.2, 0.97, 0.5])
  logs = []
  a = _run(tmp_path / "a", eval={"target_accuracy": 0.5})
  result = Trainer(a, log=logs.append).run()
  assert calls == [0.1, 0.3, 0.9]            # the eval that reached the target is the final one
  assert result["stopped"] == "target" and result["steps"] == 6
  assert result["heldout_before"] == 0.1 and result["heldout_after"] == 0.9  # greedy-only
  assert result_line(result).endswith(" stopped=target steps=6")
  assert any(line.startswith("stopped at step 6: held-out accuracy_greedy 0.9000 reached "
                             "eval.target_accuracy=0.5") for line in logs), logs
  assert [r["step"] for r in _step_rows(tmp_path / "a")] == list(range(1, 7))
  rows = _check_totals(tmp_path / "a")
  assert [r["step"] for r in rows if "eval/accuracy_greedy" in r] == [2, 4, 6]
  assert all("eval/accuracy" not in r for r in rows)
  extra = Checkpointer(tmp_path / "a" / "checkpoints").read_extra(6)
  assert extra["stopped"]["reason"] == "target" and extra["stopped"]["value"] == 0.9

  # the stopped run's weights are those of a run told to train exactly that far
  monkeypatch.undo()
  Trainer(_run(tmp_path / "b", rl={"steps": 4}, eval={"every_steps": 0}),
          log=lambda *_: None).run()
  wa, wb = final_weights(tmp_path / "a" / "final_model"), final_weights(tmp_path / "b" / "final_model")
  for k in wa:
    np.testing.assert_array_equal(wa[k], wb[k], err_msg=k)

  # resumed with the same config: nothing trained, nothing evaluated, the same result
  before = read_metrics(tmp_path / "a" / "metrics.jsonl")
  calls = _scripted(monkeypatch, [])
  logs = []
  again = Trainer(a, log=logs.append).run()
  assert calls == [] and again["stopped"] == "target" and again["heldout_after"] == 0.9
  assert read_metrics(tmp_path / "a" / "metrics.jsonl") == before
  assert any("had stopped at step 6 (target): finishing it" in line for line in logs), logs

  # a higher target no longer stops there: it trains on (evals at global 8, then the final)
  calls = _scripted(monkeypatch, [0.2, 0.5])
  logs = []
  on = Trainer(_run(tmp_path / "a", eval={"target_accuracy": 0.95}), log=logs.append).run()
  assert calls == [0.2, 0.5] and on["stopped"] is None and on["steps"] == 10
  assert any("no longer stops there: training on" in line for line in logs), logs
  assert [r["step"] for r in _step_rows(tmp_path / "a")] == list(range(1, 11))
  _check_totals(tmp_path / "a")   # the totals continued from the step-6 checkpoint


def test_budget_stops_after_the_step_that_spends_it(tmp_path):
  logs = []
  # any step takes more than a microsecond: the SFT steps spend it, RL stops after one step
  cfg = _run(tmp_path, train_budget_s=1e-6, checkpoint={"every_steps": 100})
  result = Trainer(cfg, log=logs.append).run()
  assert result["stopped"] == "budget" and result["steps"] == 3
  assert result_line(result).endswith(" stopped=budget steps=3")
  assert any(line.startswith("stopped at step 3: ") and "train_budget_s=1e-06" in line
             for line in logs), logs
  rows = _check_totals(tmp_path)
  assert [r["step"] for r in _step_rows(tmp_path)] == [1, 2, 3]
  assert [r["step"] for r in rows if "eval/accuracy_greedy" in r] == [2, 3]  # before, final
  assert result["train_s_total"] == rows[-2]["time/train_s_total"]
  assert Checkpointer(tmp_path / "checkpoints").latest_step() == 3

  # resumed as is: finishes again without a step (the final eval's row is not doubled)
  assert Trainer(cfg, log=lambda *_: None).run()["stopped"] == "budget"
  assert [r["step"] for r in _step_rows(tmp_path)] == [1, 2, 3]
  assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")
          if "eval/accuracy_greedy" in r] == [2, 3]
  # without a budget it trains on to the end, the totals continuing
  done = Trainer(_run(tmp_path, checkpoint={"every_steps": 100}), log=lambda *_: None).run()
  assert done["stopped"] is None and done["steps"] == 10
  assert [r["step"] for r in _step_rows(tmp_path)] == list(range(1, 11))
  _check_totals(tmp_path)


def test_time_to_target_reads_the_first_row_at_the_target():
  rows = [{"step": 0, "eval/accuracy_greedy": 0.3, "time/train_s_total": 0.0},
          {"step": 5, "time/train_s_total": 4.0},
          {"step": 10, "eval/accuracy_greedy": 0.55, "time/train_s_total": 9.0},
          {"step": 15, "eval/accuracy_greedy": 0.5, "time/train_s_total": 13.0},
          {"step": 20, "eval/accuracy_greedy": 0.71, "time/train_s_total": 18.0}]
  assert time_to_target(rows, "eval/accuracy_greedy", 0.5) == (10, 9.0)
  assert time_to_target(rows, "eval/accuracy_greedy", 0.7) == (20, 18.0)
  assert time_to_target(rows, "eval/accuracy_greedy", 0.8) is None
  with pytest.raises(KeyError, match="time/train_s_total"):
    time_to_target([{"step": 3, "eval/accuracy_greedy": 0.9}], "eval/accuracy_greedy", 0.5)
