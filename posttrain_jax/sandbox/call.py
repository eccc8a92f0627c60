"""One tool call's process tree (sandbox.py has the isolation and the API).

`_INIT` is the init each call runs as pid 1 of its namespaces; `_Call` spawns bwrap (or, with
no sandbox, the init directly), feeds stdin, drains stdout / stderr into `_Capture`s (head and
tail kept), enforces the wall clock and the output limit, and stops and reaps on every path:
SIGTERM to the init, SIGKILL after `_STOP_GRACE_S`. Only SandboxSession (sandbox.py) uses it.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import pathlib
import select
import signal
import subprocess
import threading
import time
from typing import TYPE_CHECKING, Optional

from posttrain_jax.sandbox.config import SANDBOX_PATH, ExecResult, SandboxError

if TYPE_CHECKING:
  from posttrain_jax.sandbox.session import SandboxSession

log = logging.getLogger(__name__)

_STOP_GRACE_S = 5.0  # how long a stopped call's init may take before SIGKILL

# For a non-zero exit, the end of stderr names the limit a syscall refused (first match wins).
# "... limit exceeded" is how a shell reports a child killed by SIGXCPU / SIGXFSZ.
_STDERR_LIMITS = (
    (b"MemoryError", "memory"), (b"Cannot allocate memory", "memory"),
    (b"std::bad_alloc", "memory"), (b"out of memory", "memory"),
    (b"CPU time limit exceeded", "cpu"),
    (b"File too large", "file_size"), (b"File size limit exceeded", "file_size"),
    (b"No space left on device", "disk"), (b"Disk quota exceeded", "disk"),
)

# The sandbox's init: pid 1 of the call's namespaces (bwrap --as-pid-1), or, unsandboxed, our
# direct child and a child subreaper. It runs the system python with -I -S (no site, no
# environment) and is not dumpable, so nothing the command runs can open its fds through
# /proc/1/fd. It checks the command exists, forks it (rlimits set, signal mask and the signals
# python ignores restored, other fds closed, exec), reaps every process until the command has
# exited, kills and reaps the rest, and reports on the status pipe: b"R" once the exec
# succeeded, then b"X<wait status> <cpu of the command> <cpu of all>\n"; or b"E<reason>" if the
# command never ran. It takes signals only through sigwaitinfo (no handler can interrupt it)
# and stops early only on a SIGTERM from us: si_pid 0 (sent from outside its pid namespace; the
# command's own signals to pid 1 carry their pid, and SIGKILL / SIGSTOP from inside are void for
# a pid 1) or, unsandboxed, from its parent.
_INIT = r"""
import ctypes, os, resource, signal, sys, time
fd, lim, argv = int(sys.argv[1]), [int(x) for x in sys.argv[2].split(",")], sys.argv[3:]
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(4, 0, 0, 0, 0)   # PR_SET_DUMPABLE = 0
libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER = 1
libc.prctl(1, 9, 0, 0, 0)   # PR_SET_PDEATHSIG = SIGKILL: we die with our parent
waited = {signal.SIGTERM, signal.SIGCHLD}
signal.pthread_sigmask(signal.SIG_BLOCK, waited)
prog, path = argv[0], os.environ.get("PATH", "")
if not any(os.path.isfile(c) and os.access(c, os.X_OK)
           for c in ([prog] if "/" in prog else [os.path.join(d, prog) for d in path.split(":")])):
  os.write(fd, ("Eno executable %r (PATH=%s)" % (prog, path)).encode()); os._exit(127)
me, parent = os.getpid(), os.getppid()
r, w = os.pipe()
pid = os.fork()
if pid == 0:
  try:
    os.closerange(3, w)  # our status pipe, bwrap's fds: the command gets 0, 1, 2 only
    os.closerange(w + 1, os.sysconf("SC_OPEN_MAX"))
    libc.prctl(1, 9, 0, 0, 0)  # and the command dies with us
    for s in (signal.SIGPIPE, signal.SIGXFSZ):
      signal.signal(s, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    resource.setrlimit(resource.RLIMIT_CPU, (lim[0], lim[0] + 1))
    resource.setrlimit(resource.RLIMIT_AS, (lim[1], lim[1]))
    resource.setrlimit(resource.RLIMIT_NPROC, (lim[2], lim[2]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (lim[3], lim[3]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.execvp(prog, argv)
  except BaseException as e:
    os.write(w, ("cannot execute %r: %s" % (prog, e)).encode("utf-8", "replace"))
  os._exit(127)
os.close(w)
status, cpu = None, 0.0
err = os.read(r, 4096)  # b"" once the exec succeeded: the pipe is close-on-exec
if not err:
  os.write(fd, b"R")
while status is None and not err:
  info = signal.sigwaitinfo(waited)
  if info.si_signo == signal.SIGTERM and info.si_pid == (0 if me == 1 else parent):
    break
  while status is None:
    p, st, ru = os.wait4(-1, os.WNOHANG)
    if p == 0:
      break
    if p == pid:
      status, cpu = st, ru.ru_utime + ru.ru_stime
while True:  # kill and reap the rest: the whole namespace as pid 1, else our descendants
  if me == 1:
    try:
      os.kill(-1, signal.SIGKILL)
    except OSError:
      pass
  else:
    for name in os.listdir("/proc"):
      try:
        with open("/proc/%s/stat" % name, "rb") as f:
          if int(f.read().rsplit(b")", 1)[1].split()[1]) == me:
            os.kill(int(name), signal.SIGKILL)
      except (OSError, ValueError, IndexError):
        pass
  try:
    p, st = os.waitpid(-1, os.WNOHANG)
  except ChildProcessError:
    break
  if p == 0:
    time.sleep(0.002)
  elif p == pid and status is None:
    status = st
if err:
  os.write(fd, b"E" + err)
elif status is not None:
  ru = resource.getrusage(resource.RUSAGE_CHILDREN)
  os.write(fd, b"X%d %.6f %.6f\n" % (status, cpu, ru.ru_utime + ru.ru_stime))
"""


def _disk_usage(path: pathlib.Path) -> int:
  """Bytes allocated under path (symlinks not followed)."""
  total = 0
  for root, dirs, files in os.walk(path):
    for name in dirs + files:
      try:
        total += os.lstat(os.path.join(root, name)).st_blocks * 512
      except OSError:
        pass
  return total



# -- one call -------------------------------------------------------------------------------

class _Capture:
  """Keeps the first and the last half of `limit` bytes of a stream and counts the rest."""

  def __init__(self, limit: int):
    self.head, self.tail, self.total = bytearray(), bytearray(), 0
    self.head_limit, self.tail_limit = (limit + 1) // 2, limit // 2

  def add(self, data: bytes) -> None:
    self.total += len(data)
    room = self.head_limit - len(self.head)
    if room > 0:
      self.head += data[:room]
      data = data[room:]
    if data and self.tail_limit:
      self.tail += data
      del self.tail[:max(0, len(self.tail) - self.tail_limit)]

  @property
  def truncated(self) -> bool:
    return self.total > len(self.head) + len(self.tail)

  def text(self) -> str:
    if not self.truncated:
      return (self.head + self.tail).decode("utf-8", "replace")
    dropped = self.total - len(self.head) - len(self.tail)
    return (self.head.decode("utf-8", "replace")
            + f"\n[... {dropped} bytes truncated by the sandbox ...]\n"
            + self.tail.decode("utf-8", "replace"))


class _Call:
  """One process tree: spawn, pipes, wall clock, and the stop + reap every path ends with.

  Sandboxed: bwrap (our child, its own process group) -> the init (the namespace's pid 1,
  whose host pid bwrap's --info-fd gives before the command may start) -> the command. bwrap
  reaps the init and we reap bwrap, so once bwrap is reaped nothing of the call is left, not
  even a zombie. Unsandboxed: the init is our child and a child subreaper, so orphans of the
  command (a double-forked daemon) come back to it to be killed and reaped."""

  def __init__(self, session: SandboxSession, argv: list[str]):
    self.session, self.argv = session, argv
    self.sandbox = session.sandbox
    self.cfg = self.sandbox.cfg
    self.proc: Optional[subprocess.Popen] = None
    self.pidfd: Optional[int] = None        # our child's: bwrap, or the init unsandboxed
    self.status_fd: Optional[int] = None    # the init's reports (see _INIT)
    self.status = bytearray()
    self.info_fd: Optional[int] = None      # bwrap's --info-fd: {"child-pid": <init>, ...}
    self.info = bytearray()
    self.init_pidfd: Optional[int] = None   # the init's, once known (-1: unknown or gone)
    self.wait_status: Optional[int] = None  # our child's, once reaped
    self.closed_by_session = False          # stopped by SandboxSession.close(), not by a limit
    self._lock = threading.Lock()

  def _spawn(self) -> None:
    sb, fds = self.sandbox, []
    try:
      status_r, status_w = os.pipe()
      info_r, info_w = os.pipe()
      fds += [status_r, status_w, info_r, info_w]
      data_fds = {}
      if sb.sandboxed:
        for dest, text in sb._etc_files.items():  # a few hundred bytes: fits the pipe buffer
          r, w = os.pipe()
          fds.append(r)
          os.write(w, text.encode())
          os.close(w)
          data_fds[dest] = r
      cmd = sb._command(self.argv, str(self.session.work_dir), status_w, info_w, data_fds)
      env = {"PATH": SANDBOX_PATH, "LANG": "C.UTF-8"}
      if not sb.sandboxed:
        env.update(HOME=str(self.session.work_dir), TMPDIR=str(self.session.work_dir),
                   USER="sandbox")
      ids = dict(user=sb._uid, group=sb._gid, extra_groups=[]) if sb._root else {}
      self.proc = subprocess.Popen(
          cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
          pass_fds=[status_w, *([info_w] if sb.sandboxed else []), *data_fds.values()],
          env=env, start_new_session=True,
          cwd="/" if sb.sandboxed else self.session.work_dir, **ids)
      self.pidfd = os.pidfd_open(self.proc.pid)
      if not sb.sandboxed:
        self.init_pidfd = os.pidfd_open(self.proc.pid)
      self.status_fd, self.info_fd = status_r, info_r
      fds.remove(status_r)
      fds.remove(info_r)
      for fd in (self.proc.stdin.fileno(), self.proc.stdout.fileno(),
                 self.proc.stderr.fileno(), status_r, info_r):
        os.set_blocking(fd, False)
    except OSError as e:
      self.stop()
      self.close_fds()
      raise SandboxError(f"cannot start {self.argv[0]!r} in the sandbox: {e}") from e
    finally:
      for fd in fds:
        os.close(fd)

  def _read(self, fd: int, into: bytearray, drain: bool = False) -> bool:
    """Appends what fd has (drain: all it has now) to `into`; False at EOF or past 64 KiB."""
    open_ = True
    while open_:
      try:
        data = os.read(fd, 4096)
      except BlockingIOError:
        break
      into += data[:65536 - len(into)]
      open_ = bool(data) and len(into) < 65536
      if not drain:
        break
    if fd == self.info_fd and self.init_pidfd is None and b"}" in self.info:
      try:
        pid = json.JSONDecoder().raw_decode(self.info.decode())[0]["child-pid"]
        self.init_pidfd = os.pidfd_open(pid)
      except (ValueError, KeyError, TypeError, OSError):  # OSError: the init is gone already
        self.init_pidfd = -1
    return open_

  async def run(self, stdin: bytes, timeout: float) -> ExecResult:
    """Runs the call: `timeout` is the command's wall clock, started when the init reports the
    exec (b"R"); the sandbox's own start-up before that (bwrap, namespaces, the init: slow on
    a loaded machine) has its own limit, `startup_seconds`, and past it the call is ours."""
    loop = asyncio.get_running_loop()
    t0 = time.monotonic()
    self._spawn()
    proc = self.proc
    out, err = _Capture(self.cfg.max_output_bytes), _Capture(self.cfg.max_output_bytes)
    exited, overflow, started = (loop.create_future() for _ in range(3))
    streams = {proc.stdout.fileno(): (out, loop.create_future()),
               proc.stderr.fileno(): (err, loop.create_future())}

    def on_output(fd: int) -> None:
      capture, eof = streams[fd]
      try:
        data = os.read(fd, 65536)
      except BlockingIOError:
        return
      if not data:
        loop.remove_reader(fd)
        eof.done() or eof.set_result(None)
        return
      capture.add(data)
      if out.total + err.total > self.cfg.kill_output_bytes and not overflow.done():
        overflow.set_result(None)

    def on_report(fd: int, into: bytearray) -> None:
      if not self._read(fd, into):
        loop.remove_reader(fd)
      if fd == self.status_fd and into and not started.done():
        started.set_result(None)  # b"R" (the command runs) or b"E" (it never will)

    pending = memoryview(stdin)

    def on_stdin() -> None:
      nonlocal pending
      try:
        pending = pending[os.write(proc.stdin.fileno(), pending[:65536]):]
      except BlockingIOError:
        return
      except OSError:  # the command closed its stdin: the rest is dropped
        pending = pending[:0]
      if not pending:
        loop.remove_writer(proc.stdin.fileno())
        proc.stdin.close()

    try:
      for fd in streams:
        loop.add_reader(fd, on_output, fd)
      loop.add_reader(self.status_fd, on_report, self.status_fd, self.status)
      loop.add_reader(self.info_fd, on_report, self.info_fd, self.info)
      loop.add_reader(self.pidfd, lambda: exited.done() or exited.set_result(None))
      if pending:
        loop.add_writer(proc.stdin.fileno(), on_stdin)
      else:
        proc.stdin.close()
      await asyncio.wait([started, exited, overflow], timeout=self.cfg.startup_seconds,
                         return_when=asyncio.FIRST_COMPLETED)
      t_start = time.monotonic()
      if started.done() or exited.done() or overflow.done():
        await asyncio.wait([exited, overflow], timeout=timeout,
                           return_when=asyncio.FIRST_COMPLETED)
        killed = None if exited.done() else ("output" if overflow.done() else "wall")
        wall_s = time.monotonic() - t_start
      else:  # not started in startup_seconds: _result raises SandboxError (ours)
        killed, wall_s = "startup", time.monotonic() - t0
      if killed:
        await self._astop(exited)
      self.stop()  # reaps our child, which has exited by now (else: the blocking way)
      await asyncio.wait([eof for _, eof in streams.values()], timeout=2.0)
      self._read(self.status_fd, self.status, drain=True)
    finally:
      for fd in (*streams, self.status_fd, self.info_fd, self.pidfd):
        loop.remove_reader(fd)
      if not proc.stdin.closed:
        loop.remove_writer(proc.stdin.fileno())
      self.stop()
      self.close_fds()
    return self._result(killed, out, err, wall_s)

  def _result(self, killed: Optional[str], out: _Capture, err: _Capture,
              wall_s: float) -> ExecResult:
    report = bytes(self.status)
    if report.startswith(b"E"):
      reason = report[1:].decode("utf-8", "replace")
      raise SandboxError(f"cannot run {self.argv[0]!r} in the sandbox: {reason}")
    if killed == "startup" or not report.startswith(b"R"):
      why = (f"it did not start within {wall_s:.1f} s (startup_seconds="
             f"{self.cfg.startup_seconds:g})" if killed == "startup" else
             f"it exited with status {os.waitstatus_to_exitcode(self.wait_status)} before the "
             "command started")
      raise SandboxError(f"the sandbox failed: {why}; stderr: {err.text()[-2000:]!r}")
    if killed:
      code, cpu_s, total_cpu_s = -signal.SIGKILL, 0.0, 0.0
    else:
      try:
        fields = report[2:report.index(b"\n")].split()
        code = os.waitstatus_to_exitcode(int(fields[0]))
        cpu_s, total_cpu_s = float(fields[1]), float(fields[2])
      except (ValueError, IndexError):
        if self.closed_by_session:  # close() stopped it (the init may be SIGKILLed under load)
          return ExecResult(stdout=out.text(), stderr=err.text(), exit_code=-signal.SIGKILL,
                            timed_out=False, limit=None, wall_s=wall_s,
                            truncated=out.truncated or err.truncated)
        raise SandboxError(f"the sandbox's init died before reporting (status "
                           f"{os.waitstatus_to_exitcode(self.wait_status)}, report {report!r})")
    limit = killed
    if limit is None:
      if code == -signal.SIGXCPU or (code == -signal.SIGKILL
                                     and cpu_s >= math.ceil(self.cfg.cpu_seconds)):
        limit = "cpu"  # SIGKILL: the hard limit, for a command that ignored SIGXCPU
      elif code == -signal.SIGXFSZ:
        limit = "file_size"
      elif code != 0:
        tail = bytes(err.head + err.tail)[-4096:]
        limit = next((name for text, name in _STDERR_LIMITS if text in tail), None)
    if (limit is None and not self.sandbox._mount_ok
        and _disk_usage(self.session.work_dir) > self.cfg.disk_mb << 20):
      limit = "disk"
    return ExecResult(stdout=out.text(), stderr=err.text(), exit_code=code,
                      timed_out=killed == "wall", limit=limit, wall_s=wall_s,
                      cpu_s=total_cpu_s, truncated=out.truncated or err.truncated)

  def stop(self) -> None:
    """Ends the call on every path and reaps our child; idempotent, thread-safe.

    A running call gets SIGTERM at its init, which kills and reaps everything below it and
    exits; bwrap then exits too. Only if that takes over 5 s: SIGKILL to the init (the kernel
    empties its namespace) and to our child's process group."""
    with self._lock:
      if self.proc is None or self.wait_status is not None:
        return
      if self.pidfd is None:  # pidfd_open failed right after the spawn
        self._kill_hard("its pidfd could not be opened")
      elif not _readable(self.pidfd):
        _signal(self._init(), signal.SIGTERM)
        if not _readable(self.pidfd, int(_STOP_GRACE_S * 1000)):
          self._kill_hard(f"it ignored SIGTERM for {_STOP_GRACE_S} s")
      _, status = os.waitpid(self.proc.pid, 0)
      self.proc.returncode = os.waitstatus_to_exitcode(status)
      self.wait_status = status

  async def _astop(self, exited: asyncio.Future) -> None:
    """stop()'s signals, awaiting our child's exit instead of blocking the event loop."""
    _signal(self._init(), signal.SIGTERM)
    await asyncio.wait([exited], timeout=_STOP_GRACE_S)
    if not exited.done():
      self._kill_hard(f"it ignored SIGTERM for {_STOP_GRACE_S} s")
      await asyncio.wait([exited], timeout=10.0)

  def _kill_hard(self, why: str) -> None:
    """SIGKILL to the init (its namespace dies with it), then, unless bwrap exits on its own
    within a second (having reaped the init: no zombie), to our child's process group."""
    log.warning("sandbox: SIGKILL to the call of %r: %s", self.argv[0], why)
    init = self._init()
    _signal(init, signal.SIGKILL)
    if init is not None and self.pidfd is not None and _readable(self.pidfd, 1000):
      return
    try:  # safe: our child is not reaped, so its pid (= the pgid) is not reused
      os.killpg(self.proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
      pass

  def _init(self) -> Optional[int]:
    """The init's pidfd; waits (<= 5 s) for bwrap's info if it has not come yet."""
    deadline = time.monotonic() + 5.0
    while (self.init_pidfd is None and self.info_fd is not None and self.pidfd is not None
           and time.monotonic() < deadline and not _readable(self.pidfd)):
      if _readable(self.info_fd, 50) and not self._read(self.info_fd, self.info):
        break
    return self.init_pidfd if self.init_pidfd is not None and self.init_pidfd >= 0 else None

  def close_fds(self) -> None:
    for name in ("pidfd", "status_fd", "info_fd", "init_pidfd"):
      fd = getattr(self, name)
      if fd is not None and fd >= 0:
        os.close(fd)
      setattr(self, name, None)
    if self.proc is not None:
      for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
        f.close()


def _readable(fd: int, timeout_ms: int = 0) -> bool:
  poller = select.poll()
  poller.register(fd, select.POLLIN)
  return bool(poller.poll(timeout_ms))


def _signal(pidfd: Optional[int], sig: int) -> None:
  if pidfd is not None:
    try:
      signal.pidfd_send_signal(pidfd, sig)
    except OSError:  # gone already
      pass
