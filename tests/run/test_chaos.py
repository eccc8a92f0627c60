"""kill -9 at the worst moments: a save interrupted after every file but before orbax's commit
rename is never read as complete (the previous checkpoint stays the latest, the resume works,
the temporary directory is cleaned up), an async save's side-car is the state at the save, and
real `launch/train.py` runs killed during a save, at the SFT -> GRPO boundary, with an async
save in flight, or in async mode resume from the last complete checkpoint (sync: the final
params equal an uninterrupted run's bit for bit; async: no trajectory lost or trained twice).
benchmarks/chaos_resume.py runs many more of these at random times."""
import pathlib
import random
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain_jax.checkpoint import CheckpointConfig, Checkpointer
from posttrain_jax.types import TrainState
from tests.support import chaos as ct

_SAVER = """
import sys, jax, jax.numpy as jnp
from posttrain_jax.checkpoint import Checkpointer, CheckpointConfig
from posttrain_jax.types import TrainState
ck = Checkpointer(sys.argv[1], CheckpointConfig(every_steps=1, async_save=sys.argv[2] == "1"))
for s in (1, 2, 3):
  ck.save(s, TrainState(params={"w": jnp.full((4,), float(s))}, opt_state=(),
                        step=jnp.int32(s), rng=jax.random.key(s)), {"step": s})
  print("returned", s, flush=True)
ck.wait()
"""


def _state(value: float, n: int = 4) -> TrainState:
  return TrainState(params={"w": jnp.full((n,), value)}, opt_state=(), step=jnp.int32(0),
                    rng=jax.random.key(0))


@pytest.mark.parametrize("async_save", [False, True])
def test_a_save_killed_before_its_commit_is_never_read_as_complete(tmp_path, async_save):
  out = subprocess.run([sys.executable, "-c", _SAVER, str(tmp_path), str(int(async_save))],
                       env=ct.env("save:2"), capture_output=True, text=True, timeout=300,
                       cwd=ct.ROOT)
  assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
  # killed inside the save of step 2 (async: after save() returned, the write in flight)
  assert out.stdout.split() == (["returned", "1", "returned", "2"] if async_save
                                else ["returned", "1"]), out.stdout
  tmp = tmp_path / "2.orbax-checkpoint-tmp"
  assert (tmp / "commit_success.txt").exists() and (tmp / "state").is_dir()  # all but the rename
  ck = Checkpointer(tmp_path, CheckpointConfig(every_steps=1))
  assert ck.latest_step() == 1
  state, extra = ck.restore(_state(0.0))
  assert extra == {"step": 1}
  np.testing.assert_array_equal(np.asarray(state.params["w"]), np.ones(4))
  ck.save(2, state, {"step": 2})     # the resumed run saves step 2 again
  ck.close()
  assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2"]


def test_an_async_saves_side_car_is_its_value_at_the_save(tmp_path):
  """orbax writes the JSON side-car in its background thread: the trainer's reward list,
  appended after the next step, could land in the previous checkpoint (seen without the copy)."""
  ck = Checkpointer(tmp_path, CheckpointConfig(every_steps=1, async_save=True, max_to_keep=8))
  big = TrainState(params={f"w{i}": jnp.zeros((256, 1024)) for i in range(16)}, opt_state=(),
                   step=jnp.int32(0), rng=jax.random.key(0))
  for step in range(1, 7):
    rewards = [0.5] * step
    ck.save(step, big, {"step": step, "rewards": rewards})
    rewards.append(9.0)
  ck.close()
  assert [ck.read_extra(s)["rewards"] for s in range(1, 7)] == [[0.5] * s for s in range(1, 7)]


# ------------------------------------------------------------------ real runs, killed (slow)

@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """The uninterrupted sync run's final weights (one run for the session: ct.straight_run)."""
  return ct.weights(ct.straight_run(tmp_path_factory))


def _tail(workdir) -> str:
  return pathlib.Path(f"{workdir}.err").read_text()[-3000:]


def _killed_then_resumed(workdir, flags, crash_at):
  """Runs to the crash point, checks what the kill left, resumes; the resumed stdout."""
  rc, _ = ct.run(workdir, flags, crash_at=crash_at)
  assert rc == -signal.SIGKILL, _tail(workdir)
  point, step = crash_at.split(":")
  kept = ct.committed(workdir)
  if point == "save":      # all written but the commit: the previous checkpoint is the latest
    assert ct.temp_dirs(workdir) == [f"{step}.orbax-checkpoint-tmp"]
    assert int(step) not in kept and kept and kept[-1] < int(step)
  rc, out = ct.run(workdir, flags)
  assert rc == 0, _tail(workdir)
  assert ct.resumed_from(out) == kept[-1], out
  assert ct.temp_dirs(workdir) == []
  return out


@pytest.mark.slow
@pytest.mark.parametrize("crash_at,flags", [
    ("save:6", ct.SYNC),                     # mid-save in the RL phase
    (f"save:{ct.SFT_STEPS}", ct.SYNC),      # mid-save of the SFT -> GRPO boundary checkpoint
    (f"export:{ct.SFT_STEPS}", ct.SYNC),    # sft_model/ exported, boundary checkpoint not yet
    ("save:8", ct.SYNC + ct.ASYNC_SAVE),    # killed in the background with the save in flight
], ids=["mid-save", "boundary-save", "boundary-export", "async-save-in-flight"])
def test_killed_run_resumes_and_equals_the_uninterrupted_one(tmp_path, reference, crash_at,
                                                            flags):
  _killed_then_resumed(tmp_path / "run", flags, crash_at)
  assert ct.same_weights(ct.weights(tmp_path / "run"), reference)


@pytest.mark.slow
def test_async_mode_killed_twice_loses_and_duplicates_no_trajectory(tmp_path):
  """Once mid-save, once at a random moment of the RL phase; then to the end."""
  workdir = tmp_path / "run"
  _killed_then_resumed(workdir, ct.ASYNC, "save:6")
  p = ct.start(workdir, ct.ASYNC)
  assert ct.wait_for(p, lambda: ct.last_step(workdir) >= 7)
  ct.wait_for(p, lambda: False, timeout=random.Random(0).uniform(0, 1.5))
  ct.kill(p)
  kept = ct.committed(workdir)[-1]
  rc, out = ct.run(workdir, ct.ASYNC)
  assert rc == 0 and ct.resumed_from(out) == kept, out
  acc = ct.async_accounting(workdir)
  assert acc["lost"] == acc["duplicated"] == 0, acc
  assert acc["trained"] == ct.RL_STEPS * ct.P * ct.G, acc
