"""Local multi-process JAX jobs for tests: N Python processes joined by `jax.distributed`.

Each process runs `code` with `devices` CPU devices of its own
(`--xla_force_host_platform_device_count`), the project on its path, and the environment that
`sharding.initialize_distributed()` reads; together they form one job of N x devices devices.
A job that has not finished within `timeout` seconds is killed and the test fails (a
collective that one process never enters hangs the others: that must fail, not hang).

jaxlib's Gloo CPU collectives write `[Gloo] Rank i is connected to ...` to stdout (C++
std::cout, not through Python) whenever a connection handshake is slow, e.g. on a loaded
machine: after the worker's own last line (CI stop 22 failed on one), or in pieces between
which a Python line lands (a stray "1" line, a JSON line cut in two: 2 of 8 runs of
test_checkpoint_multihost here). So each worker starts with `_PRELUDE`: C++'s fd 1 goes to
stderr and Python's `sys.stdout` to the pipe the test reads, which then holds only what the
worker printed; lines starting "[Gloo] " are still dropped, should any arrive.
"""
import os
import pathlib
import socket
import subprocess
import sys
from typing import Sequence

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


_PRELUDE = """\
import os as _os, sys as _sys
_fd = _os.dup(1)      # the pipe the test reads: Python's prints only
_os.dup2(2, 1)        # C/C++ writes to fd 1 (Gloo's std::cout) go to stderr
_sys.stdout = _os.fdopen(_fd, "w", buffering=1)
"""


def run_processes(code: str, cwd: os.PathLike, *, processes: int = 2, devices: int = 2,
                  args: Sequence[str] = (), timeout: float = 120) -> list[str]:
  """Runs `code` (`python -c code *args`) as processes 0..N-1 of one JAX job; returns each
  one's stdout, in process order. Fails the test, with every process's stderr tail, if one
  exits non-zero or the job outlives `timeout`."""
  port = free_port()
  base = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  procs = []
  for i in range(processes):
    env = {**base, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
           "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": str(processes),
           "JAX_PROCESS_ID": str(i), "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(ROOT), base.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    procs.append(subprocess.Popen([sys.executable, "-c", _PRELUDE + code, *args], env=env,
                                  cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
  outs, timed_out = [], False
  for p in procs:
    try:
      outs.append(p.communicate(timeout=timeout if not timed_out else 5))
    except subprocess.TimeoutExpired:
      timed_out = True
      for q in procs:
        q.kill()
      outs.append(p.communicate())
  report = "\n".join(f"--- process {i} (exit {p.returncode}) stderr tail:\n{err[-1500:]}"
                     for i, (p, (_, err)) in enumerate(zip(procs, outs)))
  if timed_out:
    pytest.fail(f"the {processes}-process job did not finish within {timeout} s\n{report}",
                pytrace=False)
  if any(p.returncode for p in procs):
    pytest.fail(f"a process of the {processes}-process job failed\n{report}", pytrace=False)
  return [_without_gloo_chatter(out) for out, _ in outs]


def _without_gloo_chatter(stdout: str) -> str:
  return "".join(line for line in stdout.splitlines(keepends=True)
                 if not line.startswith("[Gloo] "))
