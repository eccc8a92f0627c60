"""A sandbox for the python / shell tool calls of multi-turn environments (bubblewrap + rlimits).

    sandbox = Sandbox(SandboxConfig(wall_seconds=10))   # checks bwrap works here, or raises
    with sandbox.session() as s:                         # one per episode: a fresh work dir
      s.write_file("data.txt", "1 2 3")                  # host side; symlinks refused
      r = s.run_python("print(sum(map(int, open('data.txt').read().split())))")
      r.stdout, r.exit_code, r.limit                     # "6\\n", 0, None
      r = await s.arun_shell("sleep 60")                 # r.timed_out, r.limit == "wall"
      r.summary()                                        # "killed: wall-clock time limit exceeded"
    # here the work dir, its tmpfs and every process of the episode are gone

Files: this one (Sandbox: the bwrap command line and the checks; SandboxSession: the work
dir and the calls), sandbox_config.py (SandboxConfig, ExecResult, errors), sandbox_call.py (one
call's process tree: the init, spawn, pipes, wall clock, stop and reap).

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
kernel refused, or no b"R" within `startup_seconds`) is our failure: `SandboxError`, an infra
error the caller retries and never scores. The command's wall clock starts at b"R", so a slow
start (bwrap and the namespaces on a loaded machine) is never charged to the policy.
Everything after b"R" is the policy's: an `ExecResult` whose `limit` names what stopped
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
import errno
import logging
import math
import os
import pathlib
import shutil
import stat
import subprocess
import tempfile
import weakref
from typing import Optional, Sequence, Union

from posttrain_jax.sandbox.call import _INIT, _Call
from posttrain_jax.sandbox.config import (LIMITS,
    SANDBOX_PATH,
    ExecResult,
    SandboxConfig,
    SandboxError,
    SandboxUnavailableError,
    UnsafePathError)

__all__ = ["LIMITS", "ExecResult", "Sandbox", "SandboxConfig", "SandboxError", "SandboxSession",
           "SandboxUnavailableError", "UnsafePathError"]

log = logging.getLogger(__name__)

_INSIDE_WORK = "/work"
_MAX_ARG_BYTES = 120_000  # Linux refuses a single argv string over 128 KiB (MAX_ARG_STRLEN)
_INSTALL_HINT = "install it: `apt-get install bubblewrap` (Debian/Ubuntu)"
_UNSANDBOXED_HINT = ("or set SandboxConfig(allow_unsandboxed=True) to run tool calls WITHOUT "
                     "isolation")



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
      python = shutil.which(cfg.python, path=SANDBOX_PATH)
      if python is None:
        raise SandboxUnavailableError(f"SandboxConfig.python={cfg.python!r} is not on {SANDBOX_PATH}")
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
                                env={"PATH": SANDBOX_PATH}).stdout
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
             "--clearenv", "--setenv", "PATH", SANDBOX_PATH, "--setenv", "HOME", _INSIDE_WORK,
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
