"""vllm_procs.Reaper without vLLM: the processes it watches die with the process that started it,
however it dies (kill -9 included), and live on when it closes the reaper first. The same on the
real vLLM: test_engine_failures_vllm.py, the in-process engine and a killed trainer."""
import os
import signal
import subprocess
import sys
import time

from tests.support.engines import server_alive

# A "trainer": starts a long-lived child (vLLM's core stands in), a reaper watching it, prints
# the child's pid, then closes the reaper or not, and waits to be killed.
_TRAINER = """
import subprocess, sys, time
from posttrain_jax.engines.vllm_procs import Reaper
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                         start_new_session=True)
reaper = Reaper()
reaper.watch([child.pid])
if sys.argv[1] == "close":
  reaper.close()
print(child.pid, flush=True)
time.sleep(600)
"""


def _child_after_kill(mode: str, wait_s: float) -> tuple[int, bool]:
  trainer = subprocess.Popen([sys.executable, "-c", _TRAINER, mode], stdout=subprocess.PIPE,
                             text=True)
  pid = int(trainer.stdout.readline())
  assert server_alive(pid)
  trainer.send_signal(signal.SIGKILL)
  trainer.wait()
  t0 = time.monotonic()
  while server_alive(pid) and time.monotonic() - t0 < wait_s:
    time.sleep(0.05)
  return pid, server_alive(pid)


def test_watched_processes_die_with_a_killed_trainer():
  pid, alive = _child_after_kill("keep", wait_s=10.0)
  if alive:
    os.kill(pid, signal.SIGKILL)
  assert not alive, "the watched process outlived its killed trainer"


def test_a_closed_reaper_kills_nothing():
  pid, alive = _child_after_kill("close", wait_s=2.0)
  os.kill(pid, signal.SIGKILL)
  assert alive, "a closed reaper killed the process it no longer watches"
