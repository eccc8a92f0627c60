"""The tool-call sandbox against the real bubblewrap: normal calls, limits, blame, cleanup on
every path (the escape attempts are tests/sandbox/test_sandbox_escapes.py).

Everything that needs bwrap is skipped, naming `apt-get install bubblewrap`, only where bwrap
is not installed; a bwrap that is installed but cannot work fails these tests.
"""
import asyncio
import dataclasses
import logging
import os
import shutil
import signal
import tempfile
import threading
import time

import pytest

from posttrain_jax.sandbox import call as sandbox_call
from posttrain_jax.sandbox.session import Sandbox
from posttrain_jax.sandbox import SandboxConfig, SandboxError, SandboxUnavailableError
from tests.support.sandbox import (  # noqa: F401 (sandbox, marker, session: fixtures)
    CFG, marker, mounted, needs_bwrap, procs_with, sandbox, session)


# --- normal calls, output, blame ---------------------------------------------------------------

@needs_bwrap
def test_python_call_returns_stdout_stderr_and_exit_code(session, marker):
  r = session.run_python("import sys\nprint(sum(map(int, sys.stdin.read().split())), sys.argv[1:])"
                         "\nsys.stderr.write('note\\n')\nsys.exit(4)", stdin="1 2 3", args=[marker])
  assert (r.stdout, r.stderr, r.exit_code, r.limit, r.timed_out) == (
      f"6 ['{marker}']\n", "note\n", 4, None, False)
  assert r.summary() == "exit code 4" and not r.ok
  r = session.run_python("1/0")
  assert r.exit_code == 1 and "ZeroDivisionError" in r.stderr and r.limit is None
  r = session.run_shell("echo $HOME $PWD $TMPDIR; id -un; hostname")
  assert r.ok and r.stdout.split() == ["/work", "/work", "/tmp", "sandbox", "sandbox"], r


@needs_bwrap
def test_files_persist_within_a_session_only(sandbox, session):
  session.write_file("pkg/data.txt", "1 2 3")
  r = session.run_shell("cat pkg/data.txt && echo ' 4' >> pkg/data.txt && echo hi > made.txt")
  assert r.ok and r.stdout == "1 2 3", r
  assert session.read_file("pkg/data.txt") == "1 2 3 4\n"
  assert session.read_file("made.txt") == "hi\n"
  with sandbox.session() as other:
    assert other.run_shell("ls -A").stdout == ""
    assert other.work_dir != session.work_dir


@needs_bwrap
def test_stdout_is_truncated_with_a_marker(session):
  r = session.run_python("print('A' * 10000 + 'B' * 10000 + 'END')")
  assert r.truncated and r.limit is None and r.ok
  head, tail = r.stdout.split("\n[... ", 1)
  assert head == "A" * (CFG.max_output_bytes // 2)
  dropped = 20004 - CFG.max_output_bytes
  assert tail == f"{dropped} bytes truncated by the sandbox ...]\n" + ("B" * 10000 + "END\n")[
      -(CFG.max_output_bytes // 2):]


@needs_bwrap
def test_endless_output_is_killed(session):
  r = session.run_python("import sys\nwhile True: sys.stdout.write('y' * 65536)")
  assert r.limit == "output" and r.exit_code == -signal.SIGKILL and r.truncated, r
  assert len(r.stdout) < 2 * CFG.max_output_bytes


@needs_bwrap
def test_wall_clock_timeout_reports_wall(session, marker):
  r = session.run_shell("sleep 30", args=[marker], timeout_s=0.5)
  assert r.timed_out and r.limit == "wall" and r.summary().startswith("killed: wall-clock")
  assert r.wall_s >= 0.5


@needs_bwrap
def test_a_missing_program_is_our_failure(session):
  with pytest.raises(SandboxError, match="no executable 'no-such-tool'"):
    session.run(["no-such-tool"])


@needs_bwrap
def test_a_sandbox_that_cannot_start_is_our_failure():
  with pytest.raises(SandboxUnavailableError, match="execvp /nonexistent/python3"):
    Sandbox(dataclasses.replace(CFG, python="/nonexistent/python3"))


def test_missing_bwrap_is_one_clear_error():
  with pytest.raises(SandboxUnavailableError) as e:
    Sandbox(SandboxConfig(bwrap="/nonexistent/bwrap"))
  msg = str(e.value)
  assert "bubblewrap not found" in msg and "apt-get install bubblewrap" in msg
  assert "allow_unsandboxed=True" in msg


def test_unsandboxed_warns_and_still_limits(caplog, marker):
  with caplog.at_level(logging.WARNING, logger="posttrain_jax.sandbox.session"):
    sb = Sandbox(dataclasses.replace(CFG, bwrap="/nonexistent/bwrap", allow_unsandboxed=True))
  assert not sb.sandboxed
  assert any("WITHOUT a sandbox" in r.getMessage() for r in caplog.records), caplog.text
  with sb.session() as s:
    r = s.run_python("import os; print(6 * 7, os.getcwd())", args=[marker])
    assert r.ok and r.stdout == f"42 {s.work_dir}\n", r
    r = s.run_python("import os, time\nif os.fork() == 0:\n  os.setsid()\n  if os.fork() == 0:\n"
                     "    time.sleep(30)\n  os._exit(0)\nprint('ok')", args=[marker])
    assert r.ok and not procs_with(marker), procs_with(marker)  # the daemon was found too
    r = s.run_python("import time; time.sleep(30)", args=[marker], timeout_s=0.3)
    assert r.limit == "wall", r
    assert s.run_python("while True: pass", args=[marker]).limit == "cpu"
    work_dir = s.work_dir
  assert not work_dir.exists()


# --- cleanup on every path ---------------------------------------------------------------------

@needs_bwrap
def test_exception_in_the_session_block_cleans_up(sandbox):
  with pytest.raises(RuntimeError, match="boom"):
    with sandbox.session() as s:
      s.write_file("x", "y")
      work_dir = s.work_dir
      raise RuntimeError("boom")
  assert not work_dir.exists() and not mounted(work_dir)


@needs_bwrap
def test_cancelled_arun_kills_the_call(session, marker):
  async def main():
    task = asyncio.create_task(session.arun_python("import time; time.sleep(30)", args=[marker]))
    await asyncio.sleep(0.3)
    assert procs_with(marker)  # it is running
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
      await task
  asyncio.run(main())
  assert not procs_with(marker)


@needs_bwrap
def test_keyboard_interrupt_kills_the_call(session, marker):
  """SIGINT once the command runs (its argv carries the marker), not on a fixed clock: a call
  that ended early would otherwise read as a swallowed interrupt, and say nothing of why.
  Ctrl-C as a user's process gets it: Python's default SIGINT handler, set for this test (CI
  once saw the call run to its wall limit, i.e. the SIGINT had no effect at all: asyncio.run
  turns SIGINT into a cancellation only where the handler is Python's default)."""
  done = threading.Event()
  before = signal.getsignal(signal.SIGINT)
  signal.signal(signal.SIGINT, signal.default_int_handler)

  def interrupt():
    while not done.is_set():
      if procs_with(marker):
        os.kill(os.getpid(), signal.SIGINT)
        return
      time.sleep(0.01)
  sender = threading.Thread(target=interrupt, daemon=True)
  sender.start()
  try:
    r = session.run_python("import time; time.sleep(30)", args=[marker])
  except KeyboardInterrupt:
    r = None
  finally:
    done.set()
    sender.join()
    signal.signal(signal.SIGINT, before)
  assert r is None, (f"the call returned instead of being interrupted: {r} (SIGINT handler "
                     f"before this test: {before!r})")
  assert not procs_with(marker)


@needs_bwrap
def test_close_kills_calls_in_flight(sandbox, marker):
  s = sandbox.session()

  async def main():
    task = asyncio.create_task(s.arun_shell("sleep 30", args=[marker]))
    await asyncio.sleep(0.3)
    s.close()
    return await task
  r = asyncio.run(main())
  assert r.exit_code == -signal.SIGKILL and not procs_with(marker)
  assert not s.work_dir.exists()


@needs_bwrap
def test_an_init_that_ignores_sigterm_is_killed(session, marker, monkeypatch, caplog):
  real_signal = sandbox_call._signal
  monkeypatch.setattr(sandbox_call, "_signal",  # the init never hears the SIGTERM
                      lambda fd, sig: None if sig == signal.SIGTERM else real_signal(fd, sig))
  monkeypatch.setattr(sandbox_call, "_STOP_GRACE_S", 0.2)
  r = session.run_python("import time; time.sleep(30)", args=[marker], timeout_s=0.3)
  assert r.limit == "wall" and r.exit_code == -signal.SIGKILL, r
  assert "SIGKILL to the call" in caplog.text


@needs_bwrap
def test_arun_calls_run_concurrently(session):
  """4 calls that each wait for all 4 to have started (a barrier of files in the work dir):
  only calls that run at the same time get past it (one after another, the first would wait
  out its 20 s deadline)."""
  code = ("import os, sys, time\n"
          "open(f'started.{sys.argv[1]}', 'w').close()\n"
          "deadline = time.monotonic() + 20\n"
          "while len([f for f in os.listdir('.') if f.startswith('started.')]) < 4:\n"
          "  if time.monotonic() > deadline: sys.exit('barrier not reached')\n"
          "  time.sleep(0.01)\n"
          "print(sys.argv[1])\n")

  async def main():
    return await asyncio.gather(*(session.arun_python(code, args=[str(i)], timeout_s=60)
                                  for i in range(4)))
  results = asyncio.run(main())
  assert [(r.exit_code, r.stdout) for r in results] == [(0, f"{i}\n") for i in range(4)]


@pytest.fixture
def slow_bwrap():
  """A bwrap that takes 1.5 s to start (a loaded machine) while the flag file exists: a script
  that sleeps, then execs the real one (in a directory the calls' uid may enter)."""
  d = tempfile.mkdtemp(prefix="slow_bwrap_")
  os.chmod(d, 0o755)
  script, flag = os.path.join(d, "bwrap"), os.path.join(d, "slow")
  with open(script, "w") as f:
    f.write(f"#!/bin/sh\n[ -e {flag} ] && sleep 1.5\nexec {shutil.which('bwrap')} \"$@\"\n")
  os.chmod(script, 0o755)
  yield script, flag
  shutil.rmtree(d)


@needs_bwrap
def test_the_sandboxs_start_up_is_not_on_the_commands_wall_clock(slow_bwrap, marker):
  """A call whose sandbox takes 1.5 s to start still gets its whole 1 s wall clock (before,
  the clock ran from the spawn, and the policy's program was killed as "wall" before it ran:
  a tool_timeout charged to the policy for our slow start); a start past startup_seconds is
  our failure, SandboxError, not the policy's timeout."""
  script, flag = slow_bwrap
  fast = Sandbox(dataclasses.replace(CFG, bwrap=script, wall_seconds=1.0))
  tight = Sandbox(dataclasses.replace(CFG, bwrap=script, startup_seconds=0.5))
  open(flag, "w").close()
  with fast.session() as s:
    t0 = time.monotonic()
    r = s.run_python("import time; time.sleep(0.5); print('done')", args=[marker])
    assert r.ok and r.stdout == "done\n" and r.limit is None, r
    assert time.monotonic() - t0 >= 1.5 + 0.5 and 0.5 <= r.wall_s < 1.5, r.wall_s
    r = s.run_python("import time; time.sleep(30)", args=[marker])
    assert r.limit == "wall" and 1.0 <= r.wall_s < 1.5, r  # the command's own second
  with tight.session() as s:
    with pytest.raises(SandboxError, match=r"did not start within .*startup_seconds=0.5"):
      s.run_python("print('never')", args=[marker])
    assert not procs_with(marker)


def test_config_rejects_nonpositive_limits():
  with pytest.raises(ValueError, match="SandboxConfig.wall_seconds=0"):
    SandboxConfig(wall_seconds=0)
