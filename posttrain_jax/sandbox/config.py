"""The sandbox's settings and results: `SandboxConfig` (the limits of one tool call),
`ExecResult` (what a call did), and its errors. The sandbox itself is in sandbox.py."""
from __future__ import annotations

import dataclasses
import signal
from typing import Optional

from posttrain_jax.errors import UserError

LIMITS = ("cpu", "memory", "wall", "file_size", "disk", "output")
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"  # $PATH of the calls (and of bwrap)


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
  """Limits of one tool call and how the sandbox is made (see the module docstring)."""
  cpu_seconds: float = 5.0            # RLIMIT_CPU per process, rounded up to whole seconds
  memory_mb: int = 512                # RLIMIT_AS (address space) per process
  max_processes: int = 32             # RLIMIT_NPROC: processes + threads of one call
  max_file_mb: int = 16               # RLIMIT_FSIZE: the largest file a call may write
  disk_mb: int = 64                   # the work dir's quota; also the size of /tmp and /dev/shm
  wall_seconds: float = 10.0          # wall clock of one call unless run(timeout_s=) says otherwise
  startup_seconds: float = 30.0       # the sandbox's own start (bwrap, namespaces, the init) before
                                      # the command runs: not on the command's wall clock; past it
                                      # the call is our failure (SandboxError), not the policy's
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
                 "wall_seconds", "startup_seconds", "max_output_bytes", "kill_output_bytes",
                 "sandbox_uid"):
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
  wall_s: float               # seconds from the command's start (the sandbox's own start-up
                              # excluded) to its exit
  cpu_s: float = 0.0          # user + system CPU seconds of all its processes (0 if killed)
  truncated: bool = False     # stdout or stderr was cut

  @property
  def ok(self) -> bool:
    return self.exit_code == 0 and self.limit is None

  def summary(self) -> str:
    """One line for the model: "ok", "exit code 1", "killed: CPU time limit exceeded", ..."""
    if self.limit is not None:
      return f"killed: {LIMIT_TEXT[self.limit]}"
    if self.exit_code < 0:
      try:
        return f"killed by signal {signal.Signals(-self.exit_code).name}"
      except ValueError:
        return f"killed by signal {-self.exit_code}"
    return "ok" if self.exit_code == 0 else f"exit code {self.exit_code}"


LIMIT_TEXT = {
    "cpu": "CPU time limit exceeded", "memory": "memory limit exceeded",
    "wall": "wall-clock time limit exceeded", "file_size": "file size limit exceeded",
    "disk": "disk quota of the work dir exceeded", "output": "output size limit exceeded",
}
