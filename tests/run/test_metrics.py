"""metrics.jsonl survives a kill: a torn last line is dropped on the next resume, any other bad
line is an error naming it, and the resume's rewrite of the file is atomic."""
import json

import pytest

from posttrain_jax.checkpoint import Checkpointer
from posttrain_jax.metrics import MetricsFileError, MetricsWriter, read_metrics
from posttrain_jax.run import Trainer
from tests.support.runs import tiny_run
from tests.support.runs import QUIET, running_run


def test_a_torn_last_line_is_dropped_and_other_bad_lines_are_errors(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.4}\n{"step": 3, "lo')
  assert read_metrics(path) == [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.4}]
  path.write_text('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n')   # not the last line
  with pytest.raises(MetricsFileError, match=r"metrics.jsonl:2: not valid JSON"):
    read_metrics(path)
  path.write_text('{"step": 1}\n{"step": 2, "lo\n')                # ends in a newline: not torn
  with pytest.raises(MetricsFileError, match=r"metrics.jsonl:2: not valid JSON"):
    read_metrics(path)
  path.write_text('{"step": 1}\n[2]\n')
  with pytest.raises(MetricsFileError, match=r"metrics.jsonl:2: not a metrics row"):
    read_metrics(path)


def test_resume_writer_keeps_steps_up_to_the_checkpoint_and_leaves_no_temp_file(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 6)) + '{"step": 6,')
  w = MetricsWriter(tmp_path, tensorboard=False, resume_step=3)
  w.write(4, {"loss": 1.0})
  w.close()
  assert read_metrics(path) == [{"step": 1}, {"step": 2}, {"step": 3}, {"step": 4, "loss": 1.0}]
  assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_resume_rows_keeps_only_the_lines_written_before_the_checkpoint(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in
                          [{"step": 1}, {"step": 2}, {"step": 2, "eval": 0.5}, {"step": 3}]))
  w = MetricsWriter(tmp_path, tensorboard=False, resume_step=2, resume_rows=2)
  assert w.rows == 2
  w.write(2, {"eval": 0.5})
  w.close()
  assert read_metrics(path) == [{"step": 1}, {"step": 2}, {"step": 2, "eval": 0.5}]
  assert w.rows == 3


@pytest.mark.slow  # > 30 s: CI's slow stage
def test_a_kill_after_the_boundary_checkpoint_logs_its_heldout_eval_once(tmp_path):
  """The held-out eval before RL is written after the step-`sft.steps` checkpoint: a run stopped
  (as if killed) before the next checkpoint re-evaluates on resume, and used to keep both rows."""
  run = lambda **k: tiny_run(tmp_path, checkpoint={"every_steps": 4}, **k)  # noqa: E731
  assert Trainer(run(stop_after_step=3), **QUIET).run() is None
  assert Checkpointer(tmp_path / "checkpoints").latest_step() == 2
  assert Trainer(run(), **QUIET).run() is not None
  rows = read_metrics(tmp_path / "metrics.jsonl")
  assert [r["step"] for r in rows if "eval/accuracy" in r] == [2, 4, 6]   # before, every 2, end
  assert [r["step"] for r in rows if "data/hash" in r] == list(range(1, 7))


def test_a_run_killed_mid_line_resumes(tmp_path):
  """Stop at step 3, then tear a half-written step-4 line onto metrics.jsonl (what kill -9 during
  the write leaves): the resumed run finishes and logs every step once."""
  assert Trainer(running_run(tmp_path, stop_after_step=3), **QUIET).run() is None
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 4, "reward/mean": 0.')
  assert Trainer(running_run(tmp_path), **QUIET).run() is not None
  steps = [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if "reward/mean" in r]
  assert steps == [1, 2, 3, 4, 5, 6]


def _tensorboard_scalars(logdir):
  """(step, tag, value) of every scalar in the TFRecord event files under `logdir`."""
  import struct
  from tensorboardX.proto import event_pb2
  out = []
  for f in sorted(logdir.rglob("events.out.tfevents.*")):
    data, i = f.read_bytes(), 0
    while i < len(data):
      (n,) = struct.unpack("<Q", data[i:i + 8])
      event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
      i += 12 + n + 4
      out += [(event.step, v.tag, v.simple_value) for v in event.summary.value]
  return out


def test_tensorboard_holds_every_finite_scalar_of_every_row(tmp_path):
  w = MetricsWriter(tmp_path, tensorboard=True)
  rows = [{"loss": 1.0 / (s + 1), "reward/mean": float(s), "skipped": float("nan")}
          for s in range(200)]
  for s, row in enumerate(rows):
    w.write(s, row)
  w.close()
  got = _tensorboard_scalars(tmp_path / "tensorboard")
  want = [(s, k, v) for s, row in enumerate(rows) for k, v in row.items() if v == v]
  assert sorted(got) == sorted((s, k, pytest.approx(v)) for s, k, v in want)
  assert len(read_metrics(tmp_path / "metrics.jsonl")) == 200
