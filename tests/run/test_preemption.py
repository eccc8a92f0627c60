"""SIGTERM / SIGINT: the run finishes the step in progress, writes a checkpoint at that step,
logs "preempted at step k: checkpoint written, resume with the same command" and exits 0;
rerunning the same command resumes there and (sync) ends with the params of an uninterrupted
run bit for bit; async: in-flight episodes are finished and saved or saved as unfinished work,
so no trajectory is lost or trained twice. A second signal during that shutdown exits at once."""
import pathlib
import signal
import threading

import pytest

from posttrain_jax.checkpoint import Checkpointer
from posttrain_jax.metrics import MetricsWriter, read_metrics
from posttrain_jax.run import Trainer
from tests.support import chaos as ct
from tests.support.runs import final_weights, tiny_run
from tests.support.runs import G, P, async_run

LINE = "preempted at step {}: checkpoint written, resume with the same command"


def _preempt_after(monkeypatch, step: int) -> threading.Event:
  """An Event set while step `step`'s training row is written (as a signal would be)."""
  event, write = threading.Event(), MetricsWriter.write

  def write_then_set(self, s, metrics):
    write(self, s, metrics)
    if s == step and "data/hash" in metrics:
      event.set()

  monkeypatch.setattr(MetricsWriter, "write", write_then_set)
  return event


@pytest.mark.slow  # > 30 s: CI's slow stage
def test_preempted_run_checkpoints_its_step_and_resumes_bit_for_bit(tmp_path, monkeypatch):
  quiet = dict(log=lambda *_: None)
  assert Trainer(tiny_run(tmp_path / "a"), **quiet).run() is not None
  logs = []
  # step 4 is not a scheduled save (checkpoint.every_steps=3): the preemption writes it
  trainer = Trainer(tiny_run(tmp_path / "b"), log=logs.append,
                    preempt=_preempt_after(monkeypatch, 4))
  assert trainer.run() is None and trainer.preempted_at == 4
  assert logs[-1] == LINE.format(4), logs
  assert Checkpointer(tmp_path / "b" / "checkpoints").latest_step() == 4
  monkeypatch.undo()
  logs.clear()
  assert Trainer(tiny_run(tmp_path / "b"), log=logs.append).run() is not None
  assert any(m.endswith("(step 4)") and m.startswith("resumed from") for m in logs), logs
  a, b = final_weights(tmp_path / "a" / "final_model"), final_weights(tmp_path / "b" / "final_model")
  assert ct.same_weights(a, b)
  steps = [r["step"] for r in read_metrics(tmp_path / "b" / "metrics.jsonl") if "data/hash" in r]
  assert steps == list(range(1, 7))


def test_preempted_async_run_loses_and_duplicates_no_trajectory(tmp_path, monkeypatch):
  logs = []
  trainer = Trainer(async_run(tmp_path), log=logs.append, preempt=_preempt_after(monkeypatch, 3))
  assert trainer.run() is None and trainer.preempted_at == 3
  assert logs[-1].startswith(LINE.format(3) + " (") and "unfinished tasks saved" in logs[-1]
  saved = Checkpointer(tmp_path / "checkpoints").read_extra(3)["rollouts"]["queue"]
  monkeypatch.undo()
  assert Trainer(async_run(tmp_path), log=lambda *_: None).run() is not None
  acc = ct.async_accounting(tmp_path, rl_steps=5, p=P, g=G)
  assert acc["lost"] == acc["duplicated"] == 0, acc
  assert acc["trained"] == 5 * P * G
  assert saved["total"]["trained"] == 3 * P * G


# ------------------------------------------------------------------ real signals (slow)

@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """The uninterrupted sync run's final weights (one run for the session: ct.straight_run)."""
  return ct.weights(ct.straight_run(tmp_path_factory))


def _tail(workdir) -> str:
  return pathlib.Path(f"{workdir}.err").read_text()[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("sig,after", [(signal.SIGTERM, 2), (signal.SIGINT, ct.SFT_STEPS + 2)])
def test_signal_stops_with_a_checkpoint_and_the_rerun_resumes_bit_for_bit(tmp_path, reference,
                                                                         sig, after):
  workdir = tmp_path / "run"
  p = ct.start(workdir)
  assert ct.wait_for(p, lambda: ct.last_step(workdir) >= after), _tail(workdir)
  assert ct.kill(p, sig) == 0, _tail(workdir)
  out = pathlib.Path(f"{workdir}.out").read_text()
  k = ct.preempted_at(out)
  assert k is not None and k >= after, out
  assert ct.committed(workdir)[-1] == k and ct.temp_dirs(workdir) == []
  assert f"{sig.name}: stopping after this step" in _tail(workdir)
  rc, out = ct.run(workdir)
  assert rc == 0 and ct.resumed_from(out) == k, out
  assert ct.same_weights(ct.weights(workdir), reference)


@pytest.mark.slow
def test_a_second_sigterm_exits_at_once(tmp_path, reference):
  """Signalled right after the held-out eval before RL: the second signal, sent as soon as the
  first is acknowledged, ends the process by SIGTERM (not exit 0). Where the first signal lands
  is a race (usually inside the first RL step's compile; on a fast machine before that step
  starts, when the boundary checkpoint is already there and the shutdown is only the exit): any
  checkpoint that exists is complete, and the rerun resumes from the latest one bit for bit."""
  workdir = tmp_path / "run"
  p = ct.start(workdir)
  assert ct.wait_for(p, lambda: ct.has_row(workdir, ct.SFT_STEPS, "eval/accuracy"))
  p.send_signal(signal.SIGTERM)
  assert ct.wait_for(p, lambda: "SIGTERM: stopping" in _tail(workdir))
  assert ct.kill(p, signal.SIGTERM) == -signal.SIGTERM, _tail(workdir)
  latest = ct.committed(workdir)[-1]
  assert latest in (ct.SFT_STEPS, ct.SFT_STEPS + 1)  # (a save cut by the second signal: a temp dir)
  assert ct.preempted_at(pathlib.Path(f"{workdir}.out").read_text()) in (None, latest)
  rc, out = ct.run(workdir)
  assert rc == 0 and ct.resumed_from(out) == latest, out
  assert ct.same_weights(ct.weights(workdir), reference)
