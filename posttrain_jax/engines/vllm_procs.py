"""The processes behind an in-process `vllm.LLM`: find them, tell whether they are alive, kill
them, wake a call vLLM left blocked on a dead core (used by vllm_engine.py; see its module
docstring, "Engine death and hangs"), and kill them when this process dies without closing the
engine (`Reaper`: a kill -9 of the trainer left vLLM's core and worker computing on).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Optional, Sequence

POLL_S = 0.2  # how often a watched call checks the core's health


def core_procs(llm) -> list:
  core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
  manager = getattr(getattr(core, "resources", None), "engine_manager", None)
  return list(getattr(manager, "processes", None) or [])


def family(llm) -> list[int]:
  """Live pids of `llm`'s engine-core processes and all their descendants."""
  import psutil
  pids = []
  for proc in core_procs(llm):
    try:
      p = psutil.Process(proc.pid)
      pids += [p.pid] + [c.pid for c in p.children(recursive=True)]
    except psutil.Error:
      continue
  return pids


def why_dead(llm, watched: Sequence[int]) -> Optional[str]:
  """None while `llm`'s engine core looks alive, else what is wrong with it. `watched`: the
  core and worker pids seen at start-up (not every descendant: a worker's own short-lived
  helpers come and go)."""
  import psutil
  core = getattr(llm.llm_engine, "engine_core", None)
  if getattr(getattr(core, "resources", None), "engine_dead", False):
    return "vLLM marked its engine core dead"
  for pid in watched:
    try:
      if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        continue
    except psutil.NoSuchProcess:
      pass
    except psutil.Error:
      continue
    return f"vLLM engine process {pid} (the engine core or a worker) exited"
  return None


def wake(llm) -> None:
  """Unblocks a call abandoned in a dead `llm` (vLLM's queue otherwise waits forever)."""
  core = getattr(llm.llm_engine, "engine_core", None)
  queue = getattr(core, "outputs_queue", None)
  if queue is not None and hasattr(queue, "put_nowait"):
    try:
      from vllm.v1.engine.exceptions import EngineDeadError
      queue.put_nowait(EngineDeadError())
    except Exception:  # best effort: the abandoned thread is a daemon either way
      pass


def kill(pids: Sequence[int], sig: int = signal.SIGKILL) -> None:
  """Sends `sig` to each of `pids` that still exists."""
  for pid in pids:
    try:
      os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
      pass


# The reaper: reads "pid starttime" lines, then "done" (the engine stopped its processes) or
# EOF, which without "done" means this process died (the kernel closes the pipe even after a
# kill -9): it then kills every watched pid whose start time is still the one it was given (a
# pid reused since is left alone). Its own session, so a signal to our group does not end it
# before it has reaped.
_REAPER = r"""
import os, signal, sys
watched, done = [], False
for line in sys.stdin:
  if line.strip() == "done":
    done = True
    break
  try:
    pid, start = line.split()
    watched.append((int(pid), start))
  except ValueError:
    continue
if not done:
  for pid, start in watched:
    try:
      with open(f"/proc/{pid}/stat") as f:
        if f.read().rsplit(")", 1)[1].split()[19] == start:
          os.kill(pid, signal.SIGKILL)
    except (OSError, IndexError):
      pass
"""


def _start_time(pid: int) -> Optional[str]:
  """Field 22 of /proc/pid/stat (ticks since boot): a pid and this name one process."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[19]
  except (OSError, IndexError):
    return None


class Reaper:
  """Kills `watch()`ed processes if this process ends before `close()` (module docstring).
  Start it after the processes it watches: a process forked later without an exec (vLLM
  forks its core; a second engine's core inherits the first engine's pipe) holds the pipe open
  past our death, and this reaper acts only once that one is gone too (the second engine's
  reaper sees to it). Children that exec close the pipe (it is close-on-exec)."""

  def __init__(self):
    self._proc = subprocess.Popen([sys.executable, "-c", _REAPER], stdin=subprocess.PIPE,
                                  text=True, start_new_session=True)

  def watch(self, pids: Sequence[int]) -> None:
    for pid in pids:
      start = _start_time(pid)
      if start is not None:
        self._proc.stdin.write(f"{pid} {start}\n")
    self._proc.stdin.flush()

  def close(self) -> None:
    """The watched processes are stopped (or ours to stop): the reaper exits, killing nothing."""
    try:
      self._proc.stdin.write("done\n")
      self._proc.stdin.close()
    except (BrokenPipeError, ValueError):
      pass
    try:
      self._proc.wait(10)
    except subprocess.TimeoutExpired:
      self._proc.kill()
      self._proc.wait()
