"""Errors that are the user's mistake, not a bug here.

A `UserError` is raised for something the user gave us: a config value, a path, a data file, a
model directory. Its message names the field / file / line and, where it helps, what to do.
`launch/` prints it as one line, `error: <message>`, and exits with status 1, without a
traceback; every other exception is a bug of ours and keeps its traceback.

Subclass it together with the builtin the error would be anyway, so that callers catching the
builtin keep working: `class TaskBankError(UserError, ValueError)`.

A `DiskWriteError` is the machine's state rather than a mistake -- a full, read-only or
over-quota directory -- but it is reported the same way: one line naming the path, the cause
(`ENOSPC`, `EROFS`, ...), what was kept and what to do. `disk_errno` finds such a cause in an
exception chain, including the text-only errors of tensorstore (orbax's array writer), whose
messages carry `os_error_code='28'` instead of an `OSError`.

Stdlib only: the vLLM worker process imports this module.
"""
from __future__ import annotations

import errno as _errno
import os
import re
from typing import Optional

# errno of a failed write that is the disk's state, not a bug -> how we name it
_DISK_CAUSES = {
    _errno.ENOSPC: "no space left on device (ENOSPC)",
    _errno.EDQUOT: "disk quota exceeded (EDQUOT)",
    _errno.EROFS: "read-only file system (EROFS)",
    _errno.EACCES: "permission denied (EACCES)",
    _errno.EPERM: "operation not permitted (EPERM)",
    _errno.EFBIG: "file too large (EFBIG)",
    _errno.EIO: "I/O error (EIO)",
}
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")


class UserError(Exception):
  """The user's mistake: config, paths, data, model directory — printed as one line."""


class PathNotFoundError(UserError, FileNotFoundError):
  """A path the user named does not exist, or lacks the files it should hold."""


class DiskWriteError(UserError, OSError):
  """A write failed because of the disk (full, read-only, quota, permissions); `errno` is the
  cause's, `str()` the whole message (path, cause, what was kept, what to do)."""

  def __init__(self, message: str, errno: Optional[int] = None):
    super().__init__(errno, message)

  def __str__(self) -> str:
    return self.strerror

  def __reduce__(self):  # OSError's would call __init__(errno, message): pickles keep the order
    return type(self), (self.strerror, self.errno)


def disk_errno(exc: Optional[BaseException]) -> Optional[int]:
  """The errno of the first disk fault (a `_DISK_CAUSES` code) in `exc`'s chain, else None."""
  seen = set()
  while exc is not None and id(exc) not in seen:
    seen.add(id(exc))
    if isinstance(exc, OSError) and exc.errno in _DISK_CAUSES:
      return exc.errno
    m = _OS_ERROR_CODE.search(str(exc))
    if m and int(m.group(1)) in _DISK_CAUSES:
      return int(m.group(1))
    exc = exc.__cause__ or exc.__context__
  return None


def disk_cause(code: Optional[int]) -> str:
  """`code` in words with its symbol: "no space left on device (ENOSPC)"."""
  if code in _DISK_CAUSES:
    return _DISK_CAUSES[code]
  return os.strerror(code) if code is not None else "an unknown disk error"


def free_bytes(path: os.PathLike) -> Optional[int]:
  """Bytes an unprivileged writer may still use on `path`'s file system (its nearest existing
  ancestor's), or None where that cannot be read."""
  path = os.path.abspath(path)
  while not os.path.exists(path) and os.path.dirname(path) != path:
    path = os.path.dirname(path)
  try:
    st = os.statvfs(path)
  except OSError:
    return None
  return st.f_bavail * st.f_frsize


def free_note(code: Optional[int], path: os.PathLike) -> str:
  """For a full disk (ENOSPC / EDQUOT): ", 1.2 MB (1200000 bytes) free there"; else ""."""
  free = free_bytes(path) if code in (_errno.ENOSPC, _errno.EDQUOT) else None
  return "" if free is None else f", {format_bytes(free)} free there"


def disk_fix(code: Optional[int], directory: os.PathLike, elsewhere: bool = True) -> str:
  """What to do about disk fault `code` in `directory`, as a clause: "free space on ...".
  `elsewhere=False` where writing to another directory is no fix (a run's checkpoints)."""
  alt = " (or write elsewhere)" if elsewhere else ""
  if code in (_errno.ENOSPC, _errno.EDQUOT, _errno.EFBIG):
    return f"free space on the file system of {directory}{alt}"
  if code == _errno.EIO:
    return f"check the disk holding {directory}"
  return f"make {directory} writable{alt}"


def format_bytes(n: int) -> str:
  """`n` as "1.2 GB (1234567890 bytes)" (decimal units, 3 significant digits); under 1 MB, bytes."""
  for unit, scale in (("GB", 1e9), ("MB", 1e6)):
    if n >= scale:
      return f"{n / scale:.3g} {unit} ({n} bytes)"
  return f"{n} bytes"
