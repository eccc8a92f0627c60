"""The tool-call sandbox against the real bubblewrap: the escape attempts.

Each escape test makes one attempt from inside a call and asserts three things: inside, the
attempt failed (the call prints what it got, e.g. "BLOCKED OSError EROFS"); on the host, the
target is untouched (file bytes, a listening socket that accepted nothing, a sentinel process
still alive); and nothing is left: no process whose command line carries the test's marker,
and, once the session is closed, no work dir and no mount. `pytest -v` reads as the report.

Everything that needs bwrap is skipped, naming `apt-get install bubblewrap`, only where bwrap
is not installed; a bwrap that is installed but cannot work fails these tests.
"""
import os
import pathlib
import secrets
import shutil
import signal
import socket
import subprocess
import textwrap
import time

import pytest

from posttrain_jax.sandbox import ExecResult, UnsafePathError
from tests.support.sandbox import (  # noqa: F401 (sandbox, marker, session: fixtures)
    CFG, ROOT, marker, mounted, needs_bwrap, procs_with, sandbox, session)


class Host:
  """What an escape would hit on the host: sockets, a secret file and env var, sentinels."""

  def __init__(self, sandbox_uid: int, tmp: pathlib.Path):
    self.token = secrets.token_hex(6)
    self.tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    self.tcp.bind(("127.0.0.1", 0))
    self.tcp.listen(8)
    self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    self.udp.bind(("127.0.0.1", 0))
    self.unix_name = f"\0ptj-sandbox-test-{self.token}"
    self.unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    self.unix.bind(self.unix_name)
    self.unix.listen(8)
    for sock in (self.tcp, self.udp, self.unix):
      sock.setblocking(False)
    self.secret = f"SECRET-{self.token}"
    self.secret_file = pathlib.Path(f"/tmp/ptj-sandbox-secret-{self.token}")
    self.secret_file.write_text(self.secret)
    self.secret_file.chmod(0o644)  # readable by the sandbox's uid, were it visible
    self.victim_dir = tmp / "victim"
    self.victim_dir.mkdir()
    self.victim_dir.chmod(0o777)
    self.victim_file = self.victim_dir / "file"
    self.victim_file.write_text("original")
    self.victim_file.chmod(0o666)
    python = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    self.sentinel_argv = [python, "-c", "import time; time.sleep(600)", f"sentinel-{self.token}"]
    ids = dict(user=sandbox_uid, group=sandbox_uid, extra_groups=[]) if os.geteuid() == 0 else {}
    self.sentinels = [subprocess.Popen(self.sentinel_argv),  # ours, and one of the sandbox uid
                      subprocess.Popen(self.sentinel_argv, **ids)]

  def nothing_received(self) -> bool:
    for sock, op in ((self.tcp, "accept"), (self.unix, "accept"), (self.udp, "recv")):
      try:
        getattr(sock, op)(*(() if op == "accept" else (65536,)))
        return False
      except BlockingIOError:
        pass
    return True

  def sentinels_alive(self) -> bool:
    return all(p.poll() is None for p in self.sentinels)

  def close(self) -> None:
    for p in self.sentinels:
      p.kill()
      p.wait()
    for sock in (self.tcp, self.udp, self.unix):
      sock.close()
    self.secret_file.unlink()


@pytest.fixture(scope="module")
def host(sandbox, tmp_path_factory):
  h = Host(sandbox._uid, tmp_path_factory.mktemp("host"))
  os.environ["PTJ_SANDBOX_TEST_SECRET"] = h.secret
  yield h
  del os.environ["PTJ_SANDBOX_TEST_SECRET"]
  h.close()


_ATTEMPT = """\
import errno, os, signal, socket, sys, time
try:
{body}
except BaseException as e:
  print("BLOCKED", type(e).__name__, errno.errorcode.get(getattr(e, "errno", None) or 0, ""))
"""


def attempt(s, marker: str, body: str, **kw) -> tuple[ExecResult, str]:
  """Runs body (python) in the sandbox; returns the result and its last stdout line."""
  r = s.run_python(_ATTEMPT.format(body=textwrap.indent(textwrap.dedent(body), "  ")),
                   args=[marker], **kw)
  lines = r.stdout.strip().splitlines()
  return r, (lines[-1] if lines else f"<no output: {r.summary()}; stderr {r.stderr[-300:]!r}>")


def blocked(outcome: str, *names: str) -> None:
  assert outcome.startswith("BLOCKED"), outcome
  assert any(n in outcome.split() for n in names), f"{outcome!r}: expected one of {names}"


# --- the escape attempts ---------------------------------------------------------------------

ESCAPES = {}


def escape(description):
  def register(fn):
    ESCAPES[description] = fn
    return fn
  return register


@escape("write /etc/passwd")
def _(s, h, m):
  before = pathlib.Path("/etc/passwd").read_bytes()
  _, out = attempt(s, m, "open('/etc/passwd', 'a').write('evil::0:0::/:/bin/sh\\n')")
  blocked(out, "EROFS", "EACCES")
  assert pathlib.Path("/etc/passwd").read_bytes() == before


@escape("read the host's /etc/shadow")
def _(s, h, m):
  blocked(attempt(s, m, "print(open('/etc/shadow').read())")[1], "ENOENT", "EACCES")


@escape("list /root and /home")
def _(s, h, m):
  blocked(attempt(s, m, "print(os.listdir('/root'), os.listdir('/home'))")[1], "ENOENT")


@escape("read the repository")
def _(s, h, m):
  assert (ROOT / "setup.py").exists()
  blocked(attempt(s, m, f"print(open({str(ROOT / 'setup.py')!r}).read())")[1], "ENOENT")


@escape("write into the repository")
def _(s, h, m):
  target = ROOT / f"escape-{m}"
  blocked(attempt(s, m, f"open({str(target)!r}, 'w').write('x')")[1], "ENOENT")
  assert not target.exists()


@escape("write the host's /tmp")
def _(s, h, m):
  target = pathlib.Path(f"/tmp/escape-{m}")
  _, out = attempt(s, m, f"open({str(target)!r}, 'w').write('x'); print('WROTE its own /tmp')")
  assert out == "WROTE its own /tmp"  # a private tmpfs: the write lands there, not on the host
  assert not target.exists()


@escape("read a file in the host's /tmp")
def _(s, h, m):
  blocked(attempt(s, m, f"print(open({str(h.secret_file)!r}).read())")[1], "ENOENT")


@escape("write a file in the host's /tmp")
def _(s, h, m):
  _, out = attempt(s, m, f"open({str(h.victim_file)!r}, 'w').write('pwned')")
  blocked(out, "ENOENT")
  assert h.victim_file.read_text() == "original"


@escape("symlink to /etc, write through it")
def _(s, h, m):
  before = pathlib.Path("/etc/passwd").read_bytes()
  _, out = attempt(s, m, "os.symlink('/etc', 'etc'); open('etc/passwd', 'a').write('evil')")
  blocked(out, "EROFS", "EACCES")
  assert pathlib.Path("/etc/passwd").read_bytes() == before


@escape("symlink to a host file, read through it")
def _(s, h, m):
  _, out = attempt(s, m, f"os.symlink({str(h.secret_file)!r}, 'lnk'); print(open('lnk').read())")
  blocked(out, "ENOENT")


@escape("host read_file through the policy's symlink")
def _(s, h, m):
  assert s.run_shell(f"ln -s {h.secret_file} lnk && ln -s / root", args=[m]).ok
  for rel in ("lnk", f"root{h.secret_file}"):
    with pytest.raises(UnsafePathError, match="symlink"):
      s.read_file(rel)


@escape("host write_file through the policy's symlinks")
def _(s, h, m):
  assert s.run_shell(f"ln -s {h.victim_file} f && ln -s {h.victim_dir} d", args=[m]).ok
  for rel in ("f", "d/new", "d/file"):
    with pytest.raises(UnsafePathError, match="symlink"):
      s.write_file(rel, "pwned")
  assert h.victim_file.read_text() == "original"
  assert sorted(p.name for p in h.victim_dir.iterdir()) == ["file"]


@escape("host write_file with .. or an absolute path")
def _(s, h, m):
  for rel in ("../x", "a/../../x", str(h.victim_file), ""):
    with pytest.raises(UnsafePathError):
      s.write_file(rel, "pwned")
  assert h.victim_file.read_text() == "original"


@escape("hardlink a system file into the work dir")
def _(s, h, m):
  blocked(attempt(s, m, "os.link('/usr/bin/python3', 'py')")[1], "EXDEV", "EPERM")


@escape("TCP to the host's 127.0.0.1 listener")
def _(s, h, m):
  port = h.tcp.getsockname()[1]
  _, out = attempt(s, m, f"socket.create_connection(('127.0.0.1', {port}), timeout=2)")
  blocked(out, "ECONNREFUSED")
  assert h.nothing_received()


@escape("UDP to the host's 127.0.0.1 socket")
def _(s, h, m):
  port = h.udp.getsockname()[1]
  _, out = attempt(s, m, f"""
      u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
      for _ in range(3):
        u.sendto(b'hello', ('127.0.0.1', {port})); time.sleep(0.01)
      print('SENT into its own loopback')""")
  assert out in ("SENT into its own loopback", "BLOCKED ConnectionRefusedError ECONNREFUSED"), out
  time.sleep(0.05)
  assert h.nothing_received()


@escape("TCP to an outside address")
def _(s, h, m):
  _, out = attempt(s, m, "socket.create_connection(('1.1.1.1', 80), timeout=2)")
  blocked(out, "ENETUNREACH", "EHOSTUNREACH")


@escape("UDP to an outside address")
def _(s, h, m):
  _, out = attempt(s, m, "socket.socket(socket.AF_INET, socket.SOCK_DGRAM)"
                         ".sendto(b'x', ('8.8.8.8', 53))")
  blocked(out, "ENETUNREACH", "EHOSTUNREACH")


@escape("DNS lookup")
def _(s, h, m):
  blocked(attempt(s, m, "print(socket.getaddrinfo('example.com', 80))")[1], "gaierror")


@escape("connect to the host's abstract unix socket")
def _(s, h, m):
  _, out = attempt(s, m, f"socket.socket(socket.AF_UNIX).connect({h.unix_name!r})")
  blocked(out, "ECONNREFUSED", "ENOENT")
  assert h.nothing_received()


@escape("fork bomb (python os.fork loop)")
def _(s, h, m):
  r, out = attempt(s, m, """
      n = 0
      for _ in range(500):
        try:
          pid = os.fork()
        except OSError:
          break
        if pid == 0:
          time.sleep(30); os._exit(0)
        n += 1
      print('FORKED', n)""")
  forked = int(out.split()[1])
  assert 0 < forked < CFG.max_processes, out  # RLIMIT_NPROC in the call's user namespace
  assert h.sentinels_alive()


@escape("fork bomb (bash :(){ :|:& };:)")
def _(s, h, m):
  r = s.run_shell(":(){ :|:& };:; sleep 30", args=[m], timeout_s=1.5)
  assert r.limit == "wall" and r.timed_out, r
  assert "fork: retry: Resource temporarily unavailable" in r.stderr, r  # RLIMIT_NPROC bit
  assert h.sentinels_alive()


@escape("memory bomb (one big allocation)")
def _(s, h, m):
  r, out = attempt(s, m, "x = bytearray(1 << 30); print('ALLOCATED')")
  blocked(out, "MemoryError")


@escape("memory bomb (growing list)")
def _(s, h, m):
  r = s.run_python("a = []\nwhile True: a.append(bytearray(1 << 20))", args=[m])
  assert r.limit == "memory" and r.exit_code == 1 and "MemoryError" in r.stderr, r


@escape("infinite CPU loop (the CPU limit)")
def _(s, h, m):
  r = s.run_python("while True: pass", args=[m], timeout_s=10)
  assert r.limit == "cpu" and r.exit_code == -signal.SIGXCPU and not r.timed_out, r  # before 10 s


@escape("sleep loop (only the wall clock)")
def _(s, h, m):
  r = s.run_python("import time\nwhile True: time.sleep(0.05)", args=[m], timeout_s=1.0)
  assert r.limit == "wall" and r.timed_out and r.exit_code == -signal.SIGKILL, r
  assert r.wall_s >= 1.0  # not stopped before its wall clock


@escape("kill the parent (os.kill(os.getppid(), SIGKILL))")
def _(s, h, m):
  _, out = attempt(s, m, """
      ppid = os.getppid()
      os.kill(ppid, signal.SIGKILL); time.sleep(0.1)
      print('PARENT', ppid, 'still there:', os.path.exists(f'/proc/{ppid}'))""")
  assert out == "PARENT 1 still there: True", out  # pid 1 of its own namespace
  assert h.sentinels_alive()


@escape("signal the sandbox's init (SIGTERM, SIGKILL, SIGSTOP to pid 1)")
def _(s, h, m):
  r, out = attempt(s, m, """
      for sig in (signal.SIGTERM, signal.SIGSTOP, signal.SIGKILL) * 20:
        os.kill(1, sig); time.sleep(0.005)
      print('STILL RUNNING')""")
  assert out == "STILL RUNNING" and r.ok, r  # no early stop, and no SandboxError to hide behind


@escape("kill -9 -1")
def _(s, h, m):
  r = s.run_shell("sleep 30 & kill -9 -1; wait $!; echo sleep=$?", args=[m])
  assert r.stdout == "sleep=137\n", r  # it reaches its own namespace only (not itself: POSIX)
  assert h.sentinels_alive()


@escape("signal host pids (the sentinels, the test process)")
def _(s, h, m):
  pids = [p.pid for p in h.sentinels] + [os.getpid()]
  _, out = attempt(s, m, f"""
      errors = set()
      for pid in {pids}:
        try:
          os.kill(pid, signal.SIGKILL)
          errors.add('KILLED')
        except OSError as e:
          errors.add(errno.errorcode[e.errno])
      print('BLOCKED', *sorted(errors))""")
  assert out == "BLOCKED ESRCH", out
  assert h.sentinels_alive()


@escape("read the parent's environment")
def _(s, h, m):
  r, _ = attempt(s, m, """
      print(dict(os.environ))
      for p in os.listdir('/proc'):
        if p.isdigit():
          try: print(p, open(f'/proc/{p}/environ', 'rb').read())
          except OSError as e: print(p, e)
      print('DONE')""")
  assert "DONE" in r.stdout and os.environ["PTJ_SANDBOX_TEST_SECRET"] == h.secret
  assert h.secret not in r.stdout + r.stderr


@escape("read /proc of host processes")
def _(s, h, m):
  r, out = attempt(s, m, f"""
      pids = [p for p in os.listdir('/proc') if p.isdigit()]
      cmdlines = [open(f'/proc/{{p}}/cmdline', 'rb').read() for p in pids]
      print('SEEN', len(pids), any(('sentinel-' + '{h.token}').encode() in c for c in cmdlines),
            open('/proc/1/cmdline', 'rb').read().split(b'\\0')[0].decode())
      print(open('/proc/{h.sentinels[0].pid}/cmdline').read())""")
  seen = r.stdout.split("SEEN", 1)[1].split()
  # pid 1 is the sandbox's own init, the command pid 2: no host process is visible
  assert int(seen[0]) <= 3 and seen[1] == "False" and seen[2] == CFG.python, r.stdout
  blocked(out, "ENOENT")


@escape("fill the work dir (disk_mb)")
def _(s, h, m):
  r, out = attempt(s, m, """
      for i in range(100):
        with open(f'fill{i}', 'wb') as f:
          f.write(b'x' * (1 << 20))
      print('WROTE 100 MiB')""")
  if s.sandbox.disk_quota == "tmpfs":
    blocked(out, "ENOSPC")
    assert os.statvfs(s.work_dir).f_blocks * os.statvfs(s.work_dir).f_frsize <= CFG.disk_mb << 20
  else:
    assert r.limit == "disk", r


@escape("one file past max_file_mb")
def _(s, h, m):
  r, out = attempt(s, m, "open('big', 'wb').write(b'x' * (3 << 20)); print('WROTE 3 MiB')")
  blocked(out, "EFBIG")
  assert (s.work_dir / "big").stat().st_size <= CFG.max_file_mb << 20
  r = s.run_shell("head -c 3M /dev/zero > big2", args=[m])
  assert r.limit == "file_size" and r.exit_code != 0, r


@escape("fill /tmp and /dev/shm")
def _(s, h, m):
  for d in ("/tmp", "/dev/shm"):
    _, out = attempt(s, m, f"""
        for i in range(100):
          with open('{d}/fill%d' % i, 'wb') as f:
            f.write(b'x' * (1 << 20))
        print('WROTE 100 MiB')""")
    blocked(out, "ENOSPC")


@escape("write to / and /dev")
def _(s, h, m):
  for path in ("/evil", "/dev/evil", "/usr/evil"):
    blocked(attempt(s, m, f"open({path!r}, 'w')")[1], "EROFS", "EACCES")


@escape("daemon outliving the call (double fork + setsid)")
def _(s, h, m):
  r, out = attempt(s, m, """
      if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
          time.sleep(30)
        os._exit(0)
      time.sleep(0.1)
      print('DAEMONIZED')""")
  assert out == "DAEMONIZED" and r.ok, r
  assert not procs_with(m), "the daemon outlived run()"


@escape("nested user namespace (unshare -U)")
def _(s, h, m):
  r = s.run_shell("unshare -U -r id", args=[m])
  assert r.exit_code != 0 and "uid=0" not in r.stdout, r


@escape("mount a filesystem")
def _(s, h, m):
  _, out = attempt(s, m, """
      import ctypes
      os.mkdir('x')
      libc = ctypes.CDLL(None, use_errno=True)
      if libc.mount(b'none', b'/work/x', b'tmpfs', 0, None) != 0:
        raise OSError(ctypes.get_errno(), 'mount')
      print('MOUNTED')""")
  blocked(out, "EPERM")
  assert not mounted(s.work_dir / "x")


@escape("capabilities / setuid (NoNewPrivs)")
def _(s, h, m):
  r = s.run_shell("grep -E '^(CapEff|CapPrm|NoNewPrivs)' /proc/self/status", args=[m])
  assert "CapEff:\t0000000000000000" in r.stdout and "CapPrm:\t0000000000000000" in r.stdout
  assert "NoNewPrivs:\t1" in r.stdout, r.stdout


@escape("forge a sandbox failure from inside")
def _(s, h, m):
  r, out = attempt(s, m, """
      wrote, denied = 0, []
      for p in (p for p in os.listdir('/proc') if p.isdigit()):
        try:
          fds = os.listdir(f'/proc/{p}/fd')
        except OSError as e:
          denied.append(f'{p}:{errno.errorcode[e.errno]}')
          continue
        for fd in fds:
          try:
            with open(f'/proc/{p}/fd/{fd}', 'wb', buffering=0) as f:
              wrote += f.write(b'Eforged failure')
          except OSError:
            pass
      print('WROTE', wrote, 'DENIED', *denied)
      sys.stdout.flush(); os._exit(3)""")
  assert r.exit_code == 3 and r.limit is None, r  # a policy failure, not a SandboxError
  assert "DENIED 1:EACCES" in out, out  # the init's fds (the status pipe) are out of reach


@needs_bwrap
@pytest.mark.parametrize("attempt_fn", list(ESCAPES.values()), ids=list(ESCAPES))
def test_escape_blocked(attempt_fn, session, host, marker):
  attempt_fn(session, host, marker)
  assert host.sentinels_alive()


def test_at_least_twenty_escape_attempts():
  assert len(ESCAPES) >= 20
