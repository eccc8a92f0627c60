"""Shared by the sandbox tests: the config under test, the bwrap skip, /proc scans for what a
call may leave behind (processes carrying a marker, zombies, mounts), and the fixtures that
assert nothing was left: `sandbox`, `marker`, `session` (import them into a test module)."""
import os
import pathlib
import secrets
import shutil
import time

import pytest

from posttrain_jax.sandbox.session import Sandbox
from posttrain_jax.sandbox import SandboxConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]
CFG = SandboxConfig(cpu_seconds=1, memory_mb=256, max_processes=16, max_file_mb=2, disk_mb=8,
                    wall_seconds=5, max_output_bytes=4096, kill_output_bytes=1 << 20)
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None,
                                 reason="bubblewrap is not installed: apt-get install bubblewrap")


def procs_with(needle: str) -> list[str]:
  """Command lines (other than ours) that contain needle: a /proc scan, no psutil."""
  found = []
  for pid in os.listdir("/proc"):
    if pid.isdigit() and int(pid) != os.getpid():
      try:
        cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
      except OSError:
        continue
      if needle.encode() in cmdline:
        found.append(f"{pid}: {cmdline[:200]!r}")
  return found


def _status(pid) -> dict[str, str]:
  try:
    text = pathlib.Path(f"/proc/{pid}/status").read_text()
  except OSError:
    return {}
  return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


def zombies(uid: int) -> list[str]:
  """Orphaned zombie processes of uid: a reaper that outlived its parent would pile up here.
  A zombie whose parent is a live process of the same uid is another session's child between
  its exit and its parent's wait (xdist's other worker runs sandboxes as this uid too)."""
  found = []
  for pid in os.listdir("/proc"):
    if pid.isdigit():
      fields = _status(pid)
      if not fields or fields["State"].split()[0] != "Z" or int(fields["Uid"].split()[0]) != uid:
        continue
      parent = _status(fields["PPid"].strip())
      if parent and int(parent["Uid"].split()[0]) == uid:
        continue
      found.append(f"{pid}: {fields['Name'].strip()}")
  return found


def mounted(path: pathlib.Path) -> bool:
  return any(line.split()[4] == str(path)
             for line in pathlib.Path("/proc/self/mountinfo").read_text().splitlines())


@pytest.fixture(scope="module")
def sandbox():
  return Sandbox(CFG)


@pytest.fixture
def marker():
  """A token in the argv of the test's calls; no process may carry it after a call returns."""
  token = f"ptj-marker-{secrets.token_hex(6)}"
  yield token
  deadline = time.monotonic() + 5  # a SIGKILLed process may take a moment to leave /proc (load)
  while procs_with(token) and time.monotonic() < deadline:
    time.sleep(0.01)
  assert not procs_with(token), f"processes left behind: {procs_with(token)}"


@pytest.fixture
def session(sandbox):
  s = sandbox.session()
  work_dir = s.work_dir
  yield s
  s.close()
  assert not work_dir.exists(), f"work dir {work_dir} left behind"
  assert not mounted(work_dir), f"tmpfs on {work_dir} left mounted"
  assert not procs_with(str(work_dir)), f"bwrap left behind: {procs_with(str(work_dir))}"
  deadline = time.monotonic() + 10  # a call (ours or another run's) may be exiting this instant
  while zombies(sandbox._uid) and time.monotonic() < deadline:
    time.sleep(0.02)
  assert not zombies(sandbox._uid), f"zombies left behind: {zombies(sandbox._uid)}"
