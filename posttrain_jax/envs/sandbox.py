"""A sandbox for the python / shell tool calls of multi-turn environments (bubblewrap + rlimits).

    sandbox = Sandbox(SandboxConfig(wall_seconds=10))   # checks bwrap works here, or raises
    with sandbox.session() as s:                         # one per episode: a fresh work dir
      s.write_file("data.txt", "1 2 3")                  # host side; symlinks refused
      r = s.run_python("print(sum(map(int, open('data.txt').read().split())))")
      r.stdout, r.exit_code, r.limit                     # "6\\n", 0, None
      r = await s.arun_shell("sleep 60")                 # r.timed_out, r.limit == "wall"
      r.summary()                                        # "killed: wall-clock time limit exceeded"
    # here the work dir, its tmpfs and every process of the episode are gone

API: `Sandbox(cfg)` once per environment / actor; `sandbox.session()` per episode, a context
manager with `work_dir` (host path; /work inside), `run(argv, stdin, timeout_s)`,
`run_python(code, ..., args=)` (`python3 -c code *args`), `run_shell(script, ..., args=)`
(`bash -c script sh *args`), their `arun*` twins for asyncio (same semantics; the loop is never
blocked), `write_file` / `read_file` / `read_bytes`, `close()`. Calls of a session share its
work dir; nothing else carries over from one call to the next.

One call, sandboxed: bwrap (our child, in its own session) -> a small init of ours (pid 1 of the
call's namespaces, `--as-pid-1`) -> the command. Isolation:
  * namespaces: user (a non-root uid with no capabilities; with bubblewrap >= 0.8 no nested
    user namespaces), pid (a fresh /proc: host processes are invisible and cannot be signalled),
    net (a private loopback only: the host's 127.0.0.1, its abstract unix sockets and the outside
    are unreachable), ipc, uts, cgroup; --new-session, --die-with-parent; no_new_privs.
  * files: / is an empty read-only tmpfs with read-only binds of /usr (/bin, /lib*, /sbin as on
    the host: symlinks into /usr on merged-/usr systems), a few files of /etc (loader cache,
    alternatives, localtime, python's config) and generated /etc/passwd, group and hosts that
    name only the sandbox user. Writable: the work dir at /work (the cwd and $HOME) and a fresh
    /tmp and /dev/shm per call, tmpfs of `disk_mb` each. /dev is bwrap's minimal one, read-only.
    The host's /home, /root, /tmp, /run and the repository are not there.
  * environment: cleared; PATH, HOME=/work, LANG=C.UTF-8, TMPDIR=/tmp, USER=sandbox. bwrap
    itself gets only PATH and LANG.
  * limits, set per process in the command's process before exec: RLIMIT_CPU = ceil(cpu_seconds)
    (SIGXCPU, SIGKILL a second later), RLIMIT_AS = memory_mb, RLIMIT_FSIZE = max_file_mb,
    RLIMIT_CORE = 0 and RLIMIT_NPROC = max_processes. RLIMIT_NPROC (threads count) is what
    stops a fork bomb, and only under a non-root host uid: the kernel never applies it to root,
    and `bwrap --unshare-user` run as root maps the sandbox uid to host root, still exempt.
    Measured here (kernel 6.18, bwrap 0.8.0) with RLIMIT_NPROC=32: 200 of 200 forks succeed as
    root, with or without bwrap's user namespace; 29 of 200 under a non-root uid. Since Linux
    5.14 the count is kept per user namespace, so each call gets its own `max_processes` though
    all calls share the uid. So when we are root, bwrap is started as `sandbox_uid` (setuid in
    the child before exec) and runs unprivileged, which needs unprivileged user namespaces as
    for any non-root caller. (bwrap run as root without a user namespace would not: but its
    command then keeps every capability of root, measured CapEff=000001fffeffffff.)
  * disk: when we are root, the work dir is a tmpfs of `disk_mb` mounted on the host, and a
    write past it fails (ENOSPC). Without mount permission the usage is measured after each call
    and a call that leaves more than `disk_mb` gets limit="disk"; that is weaker, since within
    one call only RLIMIT_FSIZE bounds each file. tmpfs is RAM: budget 3 * disk_mb a call.
  * the end of a call, on every path: when the command exits, the init SIGKILLs everything left
    in the namespace (a double-forked, setsid daemon too), reaps it and exits; bwrap reaps the
    init and we reap bwrap, so not even a zombie is left. The wall clock (`timeout_s`, default
    `wall_seconds`), an output flood, asyncio cancellation, KeyboardInterrupt, an exception and
    `close()` send the init SIGTERM, which does the same; after 5 s, SIGKILL to the init (the
    kernel empties its namespace) and to bwrap's process group. bwrap's own pid-1 reaper is not
    used: bwrap exits as soon as it reports the command's exit, before its reaper is gone, so
    reapers piled up as zombies of whatever reaps orphans on the host (measured: one per call,
    reaped only now and then by this container's pid 1).
  * not done: seccomp, cgroup limits (memory is per process through RLIMIT_AS; tmpfs pages are
    not counted), a CPU limit summed over processes (each has its own; the wall clock bounds all).

Who failed: the init reports on a pipe only it holds (it is not dumpable, so the command cannot
reach it through /proc/1/fd): b"R" once the command's exec succeeded, then its wait status and
CPU time, or b"E<reason>" if it never ran. No b"R" (bwrap failed, no such program, a limit the
kernel refused) is our failure: `SandboxError`, an infra error the caller retries and never
scores. Everything after b"R" is the policy's: an `ExecResult` whose `limit` names what stopped
it: "wall" and "output" (we killed it), "cpu" (SIGXCPU, or SIGKILL after >= ceil(cpu_seconds) s
of its CPU), "file_size" (SIGXFSZ), else, for a non-zero exit, the end of stderr: MemoryError /
ENOMEM -> "memory", EFBIG -> "file_size", ENOSPC -> "disk", and a shell's "CPU time / File size
limit exceeded". The command can fake those markers only to mislabel its own failure, and it
cannot make its call look like our failure: its signals to pid 1 are void or ignored (the
init takes SIGTERM only from outside its namespace), so the init always gets to report.
`exit_code` is the command's own status, -s when a signal s killed it.

Output: stdout and stderr are each cut to `max_output_bytes` (the first and the last half kept,
a marker line in the middle says how much was dropped); a call whose stdout + stderr pass
`kill_output_bytes` is killed (limit="output").

Without bwrap (not installed, or unable to make namespaces here) `Sandbox()` raises
`SandboxUnavailableError` saying what failed and how to install bubblewrap. With
`allow_unsandboxed=True` it logs a warning and runs commands directly instead: the same init
(a child subreaper, so orphans come back to it to be killed), rlimits (as `sandbox_uid` when we
are root), wall clock and temp work dir, but no isolation at all.

Host-side `write_file` / `read_file` walk the path one component at a time with O_NOFOLLOW from
the work dir: absolute paths, "..", symlinks (the policy's, pointing anywhere) and non-regular
files raise `UnsafePathError`, a policy failure, not ours.

A host process killed with SIGKILL cannot clean up: its `ptj-sandbox-*` work dirs (tmpfs mounts
when root) stay in the temp dir; its calls die with it (--die-with-parent).
"""
from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import errno
import json
import logging
import math
import os
import pathlib
import select
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
import weakref
from typing import Optional, Sequence, Union

from posttrain_jax.errors import UserError

log = logging.getLogger(__name__)

LIMITS = ("cpu", "memory", "wall", "file_size", "disk", "output")

_PATH = "/usr/local/bin:/usr/bin:/bin"
_INSIDE_WORK = "/work"
_STOP_GRACE_S = 5.0  # how long a stopped call's init may take before SIGKILL
_MAX_ARG_BYTES = 120_000  # Linux refuses a single argv string over 128 KiB (MAX_ARG_STRLEN)
_INSTALL_HINT = "install it: `apt-get install bubblewrap` (Debian/Ubuntu)"
_UNSANDBOXED_HINT = ("or set SandboxConfig(allow_unsandboxed=True) to run tool calls WITHOUT "
                     "isolation")


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
  """Limits of one tool call and how the sandbox is made (see the module docstring)."""
  cpu_seconds: float = 5.0            # RLIMIT_CPU per process, rounded up to whole seconds
  memory_mb: int = 512                # RLIMIT_AS (address space) per process
  max_processes: int = 32             # RLIMIT_NPROC: processes + threads of one call
  max_file_mb: int = 16               # RLIMIT_FSIZE: the largest file a call may write
  disk_mb: int = 64                   # the work dir's quota; also the size of /tmp and /dev/shm
  wall_seconds: float = 10.0          # wall clock of one call unless run(timeout_s=) says otherwise
  max_output_bytes: int = 16384       # kept of stdout and of stderr each (head + tail)
  kill_output_bytes: int = 1 << 22    # stdout + stderr past this kills the call (limit="output")
  allow_unsandboxed: bool = False     # no working bwrap: run tools unisolated (warns) or raise
  bwrap: str = "bwrap"                # the bubblewrap executable (name on PATH or a path)
  python: str = "python3"             # the interpreter run_python uses inside (system python)
  shell: str = "bash"                 # the shell run_shell uses inside
  sandbox_uid: int = 2_000_000_000    # host uid (and gid) of the calls when we are root
  work_root: Optional[str] = None     # where session work dirs are made; None = the temp dir

  def __post_init__(self):
    for name in ("cpu_seconds", "memory_mb", "max_processes", "max_file_mb", "disk_mb",
                 "wall_seconds", "max_output_bytes", "kill_output_bytes", "sandbox_uid"):
      if not getattr(self, name) > 0:
        raise ValueError(f"SandboxConfig.{name}={getattr(self, name)!r} must be > 0")


class SandboxError(RuntimeError):
  """The sandbox itself failed (our failure, not the policy's): retry, never score it."""


class SandboxUnavailableError(SandboxError, UserError):
  """bwrap is missing or cannot create namespaces here; the message says how to fix it."""


class UnsafePathError(ValueError):
  """A work-dir path that is absolute, has "..", goes through a symlink or is not a file."""


@dataclasses.dataclass(frozen=True)
class ExecResult:
  """What one tool call did (the policy's outcome; our own failures raise SandboxError)."""
  stdout: str                 # decoded (utf-8, errors replaced), cut to max_output_bytes
  stderr: str                 # idem
  exit_code: int              # the command's exit status; -s when killed by signal s
  timed_out: bool             # killed by the wall clock
  limit: Optional[str]        # the limit that stopped it: one of LIMITS, or None
  wall_s: float               # seconds from start to exit
  cpu_s: float = 0.0          # user + system CPU seconds of all its processes (0 if killed)
  truncated: bool = False     # stdout or stderr was cut

  @property
  def ok(self) -> bool:
    return self.exit_code == 0 and self.limit is None

  def summary(self) -> str:
    """One line for the model: "ok", "exit code 1", "killed: CPU time limit exceeded", ..."""
    if self.limit is not None:
      return f"killed: {_LIMIT_TEXT[self.limit]}"
    if self.exit_code < 0:
      try:
        return f"killed by signal {signal.Signals(-self.exit_code).name}"
      except ValueError:
        return f"killed by signal {-self.exit_code}"
    return "ok" if self.exit_code == 0 else f"exit code {self.exit_code}"


_LIMIT_TEXT = {
    "cpu": "CPU time limit exceeded", "memory": "memory limit exceeded",
    "wall": "wall-clock time limit exceeded", "file_size": "file size limit exceeded",
    "disk": "disk quota of the work dir exceeded", "output": "output size limit exceeded",
}
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


class Sandbox:
  """Checks at construction that calls can be sandboxed here; makes sessions (see docstring)."""

  def __init__(self, cfg: SandboxConfig = SandboxConfig()):
    self.cfg = cfg
    self._root = os.geteuid() == 0
    self._uid = cfg.sandbox_uid if self._root else os.getuid()
    self._gid = cfg.sandbox_uid if self._root else os.getgid()
    self._mount_ok = self._root  # cleared by the first session whose tmpfs mount fails
    self.sandboxed = True
    self._bwrap_argv: list[str] = []
    problem = self._setup_bwrap()
    if problem is None:
      problem = self._probe()
    if problem is not None:
      if not cfg.allow_unsandboxed:
        raise SandboxUnavailableError(f"cannot sandbox tool calls: {problem}; {_UNSANDBOXED_HINT}")
      log.warning("SandboxConfig.allow_unsandboxed=True: tool calls run WITHOUT a sandbox (no "
                  "namespaces; only rlimits, wall clock and a temp work dir) because %s", problem)
      self.sandboxed = False
      python = shutil.which(cfg.python, path=_PATH)
      if python is None:
        raise SandboxUnavailableError(f"SandboxConfig.python={cfg.python!r} is not on {_PATH}")
      self._python = python
      problem = self._probe()
      if problem is not None:
        raise SandboxError(f"cannot run tool calls even unsandboxed: {problem}")

  @property
  def disk_quota(self) -> str:
    """How `disk_mb` is enforced: "tmpfs" (writes fail) or "measured" (reported after a call)."""
    return "tmpfs" if self._mount_ok else "measured"

  def session(self) -> "SandboxSession":
    """A fresh work dir for one episode; use it as a context manager (or call close())."""
    return SandboxSession(self)

  # -- set-up -------------------------------------------------------------------------------

  def _setup_bwrap(self) -> Optional[str]:
    """The fixed part of the bwrap command line, or why there is none."""
    cfg = self.cfg
    path = shutil.which(cfg.bwrap) if os.sep not in cfg.bwrap else cfg.bwrap
    if path is None or not os.access(path, os.X_OK):
      return f"bubblewrap not found (SandboxConfig.bwrap={cfg.bwrap!r}); {_INSTALL_HINT}"
    try:
      helptext = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=10,
                                env={"PATH": _PATH}).stdout
    except (OSError, subprocess.SubprocessError) as e:
      return f"{path} --help failed: {e}"
    if "--size" not in helptext:
      return f"{path} is too old (no --size option; bubblewrap >= 0.6 needed); {_INSTALL_HINT}"
    size = str(cfg.disk_mb << 20)
    argv = [path, "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc",
            "--unshare-uts", "--hostname", "sandbox", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session", "--as-pid-1", "--cap-drop", "ALL"]
    if "--disable-userns" in helptext:
      argv.append("--disable-userns")
    argv += ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
      if os.path.islink(top):
        argv += ["--symlink", os.readlink(top), top]
      elif os.path.isdir(top):
        argv += ["--ro-bind", top, top]
    etc = ["/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives",
           "/etc/localtime", "/etc/nsswitch.conf"]
    etc += sorted(str(p) for p in pathlib.Path("/etc").glob("python3*"))
    for p in etc:
      argv += ["--ro-bind-try", p, p]
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", size, "--tmpfs", "/dev/shm",
             "--remount-ro", "/dev", "--size", size, "--tmpfs", "/tmp",
             "--clearenv", "--setenv", "PATH", _PATH, "--setenv", "HOME", _INSIDE_WORK,
             "--setenv", "LANG", "C.UTF-8", "--setenv", "TMPDIR", "/tmp",
             "--setenv", "USER", "sandbox", "--chdir", _INSIDE_WORK]
    self._bwrap_argv = argv
    self._etc_files = {
        "/etc/passwd": f"sandbox:x:{self._uid}:{self._gid}:sandbox:{_INSIDE_WORK}:/bin/sh\n",
        "/etc/group": f"sandbox:x:{self._gid}:\n",
        "/etc/hosts": "127.0.0.1 localhost sandbox\n::1 localhost\n",
    }
    return None

  def _probe(self) -> Optional[str]:
    """Runs `python -c print('ok')` the way every call runs; None or what went wrong."""
    try:
      with self.session() as s:
        r = s.run([self.cfg.python, "-c", "print('ok')"], timeout_s=max(self.cfg.wall_seconds, 30))
    except SandboxError as e:
      if self.sandboxed and any(w in str(e) for w in ("namespace", "uid map", "ermission",
                                                        "not permitted")):
        return f"{e}{_userns_diagnosis()}"
      return str(e)
    if r.stdout != "ok\n":
      return (f"the probe `{self.cfg.python} -c print('ok')` gave {r.summary()}, "
              f"stdout={r.stdout!r}, stderr={r.stderr[-2000:]!r}")
    return None

  def _command(self, argv: Sequence[str], work_dir: str, status_fd: int, info_fd: int,
               data_fds: dict[str, int]) -> list[str]:
    """The full command line of one call."""
    cfg = self.cfg
    nproc = cfg.max_processes
    if not self.sandboxed:  # RLIMIT_NPROC counts every task of the uid, not just this call's
      nproc += _tasks_of_uid(self._uid)
    lim = [math.ceil(cfg.cpu_seconds), cfg.memory_mb << 20, nproc, cfg.max_file_mb << 20]
    init = ["-I", "-S", "-c", _INIT, str(status_fd), ",".join(map(str, lim)), *argv]
    if not self.sandboxed:
      return [self._python, *init]
    cmd = self._bwrap_argv + ["--info-fd", str(info_fd)]
    for dest, fd in data_fds.items():
      cmd += ["--ro-bind-data", str(fd), dest]
    return cmd + ["--bind", work_dir, _INSIDE_WORK, "--remount-ro", "/", "--",
                  cfg.python, *init]


def _userns_diagnosis() -> str:
  """The kernel settings that decide whether an unprivileged user namespace can be made."""
  facts = []
  for p in ("/proc/sys/user/max_user_namespaces", "/proc/sys/kernel/unprivileged_userns_clone",
            "/proc/sys/kernel/apparmor_restrict_unprivileged_userns"):
    try:
      facts.append(f"{p}={pathlib.Path(p).read_text().strip()}")
    except OSError:
      pass
  return (" (bwrap needs unprivileged user namespaces: max_user_namespaces > 0, "
          "unprivileged_userns_clone=1 and apparmor_restrict_unprivileged_userns=0 where those "
          f"exist; here {', '.join(facts) or 'none readable'})")


def _tasks_of_uid(uid: int) -> int:
  """Processes + threads owned by `uid` (what RLIMIT_NPROC counts)."""
  n = 0
  for pid in os.listdir("/proc"):
    if pid.isdigit():
      try:
        if os.stat(f"/proc/{pid}").st_uid == uid:
          n += len(os.listdir(f"/proc/{pid}/task"))
      except OSError:
        pass
  return n


class SandboxSession:
  """One episode: a work dir (host path `work_dir`, /work inside) that calls share."""

  def __init__(self, sandbox: Sandbox):
    self.sandbox = sandbox
    cfg = sandbox.cfg
    self.work_dir = pathlib.Path(tempfile.mkdtemp(prefix="ptj-sandbox-", dir=cfg.work_root))
    self._calls: set[_Call] = set()
    mounted = False
    try:
      if sandbox._mount_ok:
        mounted = sandbox._mount_ok = _mount_tmpfs(self.work_dir, cfg.disk_mb, sandbox._uid,
                                                   sandbox._gid)
      if sandbox._root and not mounted:
        os.chown(self.work_dir, sandbox._uid, sandbox._gid)
    except BaseException:
      _remove_work_dir(str(self.work_dir), mounted)
      raise
    self._finalizer = weakref.finalize(self, _remove_work_dir, str(self.work_dir), mounted)

  def __enter__(self) -> "SandboxSession":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def close(self) -> None:
    """Kills calls still running, unmounts and removes the work dir. Idempotent."""
    for call in list(self._calls):
      call.closed_by_session = True   # its result: killed (no report of the command's exit)
      call.stop()
    self._finalizer()

  @property
  def closed(self) -> bool:
    return not self._finalizer.alive

  # -- running ------------------------------------------------------------------------------

  def run(self, argv: Sequence[str], stdin: Union[str, bytes] = "",
          timeout_s: Optional[float] = None) -> ExecResult:
    """Runs argv (argv[0] looked up on the sandbox's PATH) in /work; see ExecResult."""
    try:
      asyncio.get_running_loop()
    except RuntimeError:
      return asyncio.run(self.arun(argv, stdin, timeout_s))
    raise RuntimeError("SandboxSession.run() blocks; inside an event loop use `await arun()`")

  def run_python(self, code: str, stdin: Union[str, bytes] = "", timeout_s: Optional[float] = None,
                 args: Sequence[str] = ()) -> ExecResult:
    """`python3 -c code *args` in /work (sys.argv[1:] == args)."""
    return self.run(self._python_argv(code, args), stdin, timeout_s)

  def run_shell(self, script: str, stdin: Union[str, bytes] = "", timeout_s: Optional[float] = None,
                args: Sequence[str] = ()) -> ExecResult:
    """`bash -c script sh *args` in /work ($1.. == args)."""
    return self.run(self._shell_argv(script, args), stdin, timeout_s)

  async def arun(self, argv: Sequence[str], stdin: Union[str, bytes] = "",
                 timeout_s: Optional[float] = None) -> ExecResult:
    """run() for the event loop: same semantics, the loop is never blocked on the call."""
    if self.closed:
      raise SandboxError(f"SandboxSession for {self.work_dir} is closed")
    argv = [str(a) for a in argv]
    if not argv or sum(len(a.encode()) for a in argv) > _MAX_ARG_BYTES:
      raise ValueError(f"argv must be non-empty and under {_MAX_ARG_BYTES} bytes in all")
    data = stdin.encode() if isinstance(stdin, str) else bytes(stdin)
    timeout = self.sandbox.cfg.wall_seconds if timeout_s is None else timeout_s
    if not timeout > 0:
      raise ValueError(f"timeout_s={timeout_s!r} must be > 0")
    call = _Call(self, argv)
    self._calls.add(call)
    try:
      return await call.run(data, timeout)
    finally:
      self._calls.discard(call)

  async def arun_python(self, code: str, stdin: Union[str, bytes] = "",
                        timeout_s: Optional[float] = None, args: Sequence[str] = ()) -> ExecResult:
    return await self.arun(self._python_argv(code, args), stdin, timeout_s)

  async def arun_shell(self, script: str, stdin: Union[str, bytes] = "",
                       timeout_s: Optional[float] = None, args: Sequence[str] = ()) -> ExecResult:
    return await self.arun(self._shell_argv(script, args), stdin, timeout_s)

  def _python_argv(self, code: str, args: Sequence[str]) -> list[str]:
    return [self.sandbox.cfg.python, "-c", code, *args]

  def _shell_argv(self, script: str, args: Sequence[str]) -> list[str]:
    return [self.sandbox.cfg.shell, "-c", script, "sh", *args]

  # -- files (host side) --------------------------------------------------------------------

  def write_file(self, rel: str, content: Union[str, bytes], mode: int = 0o644) -> None:
    """Writes work_dir/rel (parents made); refuses symlinks and anything outside the work dir."""
    data = content.encode() if isinstance(content, str) else bytes(content)
    fd = self._open(rel, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK, mode, make_parents=True)
    try:
      _require_regular(fd, rel)
      os.ftruncate(fd, 0)
      os.set_blocking(fd, True)
      view = memoryview(data)
      while view:
        view = view[os.write(fd, view):]
      os.fchmod(fd, mode)
      if self.sandbox._root:
        os.fchown(fd, self.sandbox._uid, self.sandbox._gid)
    finally:
      os.close(fd)

  def read_file(self, rel: str, max_bytes: Optional[int] = None) -> str:
    """Reads work_dir/rel (utf-8, errors replaced); refuses symlinks and non-regular files."""
    return self.read_bytes(rel, max_bytes).decode("utf-8", "replace")

  def read_bytes(self, rel: str, max_bytes: Optional[int] = None) -> bytes:
    """read_file without decoding."""
    fd = self._open(rel, os.O_RDONLY | os.O_NONBLOCK)
    try:
      _require_regular(fd, rel)
      chunks, left = [], max_bytes if max_bytes is not None else 1 << 62
      while left > 0:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
          break
        chunks.append(chunk)
        left -= len(chunk)
      return b"".join(chunks)
    finally:
      os.close(fd)

  def _open(self, rel: str, flags: int, mode: int = 0o644, make_parents: bool = False) -> int:
    """Opens work_dir/rel one component at a time, never following a symlink."""
    parts = pathlib.PurePosixPath(rel).parts
    if not parts or parts[0] == "/" or ".." in parts or "\0" in rel:
      raise UnsafePathError(f"{rel!r}: give a relative path inside the work dir, without '..'")
    if self.closed:
      raise SandboxError(f"SandboxSession for {self.work_dir} is closed")
    dir_flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    dirfd = os.open(self.work_dir, dir_flags)
    try:
      for i, part in enumerate(parts):
        try:
          if i == len(parts) - 1:
            return os.open(part, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dirfd)
          made = False
          if make_parents:
            try:
              os.mkdir(part, 0o755, dir_fd=dirfd)  # never follows a symlink: EEXIST
              made = True
            except FileExistsError:
              pass
          fd = os.open(part, dir_flags, dir_fd=dirfd)
          if made and self.sandbox._root:
            os.fchown(fd, self.sandbox._uid, self.sandbox._gid)
        except OSError as e:
          if e.errno not in (errno.ELOOP, errno.ENOTDIR, errno.ENXIO):
            raise
          kind = "a symlink" if _is_link(dirfd, part) else "not a regular file or directory"
          raise UnsafePathError(f"{rel!r}: {'/'.join(parts[:i + 1])!r} is {kind}; refused "
                                "(paths must stay inside the work dir)") from None
        os.close(dirfd)
        dirfd = fd
    finally:
      os.close(dirfd)
    raise AssertionError("unreachable")


def _is_link(dirfd: int, name: str) -> bool:
  try:
    return stat.S_ISLNK(os.stat(name, dir_fd=dirfd, follow_symlinks=False).st_mode)
  except OSError:
    return False


def _require_regular(fd: int, rel: str) -> None:
  if not stat.S_ISREG(os.fstat(fd).st_mode):
    raise UnsafePathError(f"{rel!r} is not a regular file")


# -- the work dir ---------------------------------------------------------------------------

_MS_NOSUID, _MS_NODEV, _MNT_DETACH = 2, 4, 2


def _libc():
  return ctypes.CDLL(None, use_errno=True)


def _mount_tmpfs(path: pathlib.Path, size_mb: int, uid: int, gid: int) -> bool:
  """Mounts a tmpfs of size_mb owned by uid on path; False where we may not mount."""
  opts = f"size={size_mb}m,mode=0700,uid={uid},gid={gid}".encode()
  if _libc().mount(b"tmpfs", bytes(path), b"tmpfs", _MS_NOSUID | _MS_NODEV, opts) == 0:
    return True
  e = ctypes.get_errno()
  log.info("sandbox: cannot mount a tmpfs on %s (%s); the disk quota is measured after each "
           "call instead", path, os.strerror(e))
  return False


def _remove_work_dir(path: str, mounted: bool) -> None:
  """Unmounts (lazily: a straggler cannot keep it busy) and removes the work dir."""
  if mounted and _libc().umount2(path.encode(), _MNT_DETACH) != 0:
    log.warning("sandbox: umount %s failed: %s", path, os.strerror(ctypes.get_errno()))
  if os.geteuid() != 0:  # dirs the command made unreadable (chmod 000) would stop rmtree
    for root, dirs, _ in os.walk(path):
      for d in dirs:
        p = os.path.join(root, d)
        if not os.path.islink(p):
          try:
            os.chmod(p, 0o700)
          except OSError:
            pass
  shutil.rmtree(path, ignore_errors=True)
  if os.path.lexists(path):
    log.warning("sandbox: could not remove the work dir %s", path)


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
      env = {"PATH": _PATH, "LANG": "C.UTF-8"}
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
    loop = asyncio.get_running_loop()
    t0 = time.monotonic()
    self._spawn()
    proc = self.proc
    out, err = _Capture(self.cfg.max_output_bytes), _Capture(self.cfg.max_output_bytes)
    exited, overflow = loop.create_future(), loop.create_future()
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
      await asyncio.wait([exited, overflow], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
      killed = None if exited.done() else ("output" if overflow.done() else "wall")
      wall_s = time.monotonic() - t0
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
    if not report.startswith(b"R"):
      why = (f"it did not start within {wall_s:.1f} s" if killed else
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
