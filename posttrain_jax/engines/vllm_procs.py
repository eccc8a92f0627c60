"""The processes behind an in-process `vllm.LLM`: find them, tell whether they are alive, kill
them, and wake a call vLLM left blocked on a dead core (used by vllm_engine.py; see its module
docstring, "Engine death and hangs")."""
from __future__ import annotations

import os
import signal
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
