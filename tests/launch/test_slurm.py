"""launch/slurm.sbatch under fake `srun` / `scancel` commands: SLURM's advance SIGTERM
(`--signal=B:TERM@120`) goes to the batch shell only; the script must pass it to every training
task (each then checkpoints and exits 0) and wait for them, exiting with their status."""
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
TASKS = 3

# srun: starts one stand-in training task per node (a process that, like launch/train.py, turns
# SIGTERM into "checkpoint, exit 0"), records their pids, exits with the worst task status.
SRUN = f"""#!/bin/bash
pids=()
for k in $(seq 0 {TASKS - 1}); do
  SLURM_PROCID=$k "{sys.executable}" "$FAKE_DIR/task.py" "$k" &
  pids+=($!)
  echo $! >> "$FAKE_DIR/pids"
done
rc=0
for p in "${{pids[@]}}"; do wait "$p" || rc=$?; done
exit $rc
"""
# scancel --signal=SIG JOB: what SLURM does, to every task of the job's steps (not the shell).
SCANCEL = """#!/bin/bash
sig=${1#--signal=}
echo "scancel $*" >> "$FAKE_DIR/scancel.log"
while read -r p; do kill -s "$sig" "$p" 2>/dev/null || true; done < "$FAKE_DIR/pids"
"""
TASK = """import pathlib, signal, sys, time
k, here = sys.argv[1], pathlib.Path(__file__).parent
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
(here / f"started{k}").write_text("")
while not stop:
  time.sleep(0.02)
time.sleep(0.3)   # finish the step, write the checkpoint
(here / f"checkpointed{k}").write_text("")
"""


@pytest.fixture
def fake_slurm(tmp_path):
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  for name, text in (("srun", SRUN), ("scancel", SCANCEL)):
    (bin_dir / name).write_text(text)
    (bin_dir / name).chmod(0o755)
  (tmp_path / "task.py").write_text(TASK)
  env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_DIR": str(tmp_path),
         "SLURM_JOB_ID": "4242", "POSTTRAIN_JAX_DIR": str(ROOT)}
  return tmp_path, env


def _wait(cond, timeout=30.0):
  deadline = time.monotonic() + timeout
  while not cond():
    if time.monotonic() > deadline:
      raise TimeoutError
    time.sleep(0.05)


def test_the_advance_sigterm_reaches_every_training_task(fake_slurm):
  tmp, env = fake_slurm
  script = subprocess.Popen(["bash", str(ROOT / "launch" / "slurm.sbatch"), "--config.x=1"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    _wait(lambda: all((tmp / f"started{k}").exists() for k in range(TASKS)))
    script.send_signal(signal.SIGTERM)          # what --signal=B:TERM@120 does
    rc = script.wait(timeout=30)
  finally:
    pids = [int(p) for p in (tmp / "pids").read_text().split()] if (tmp / "pids").exists() else []
    for p in pids:   # a task the script failed to stop would otherwise outlive the test
      try:
        os.kill(p, signal.SIGKILL)
      except ProcessLookupError:
        pass
    if script.poll() is None:
      script.kill()
  err = script.stderr.read()
  assert "scancel --signal=TERM 4242" in (tmp / "scancel.log").read_text()
  assert all((tmp / f"checkpointed{k}").exists() for k in range(TASKS)), err
  assert rc == 0, err    # the script waited for the tasks and exits with their status
