"""Directories that appear whole: written under a temporary name beside the target, then renamed.

    with atomic_directory(out) as tmp:
      ...write every file into tmp...

On a normal exit `tmp` becomes `out`; an existing `out` is replaced (moved aside to
`.<name>.old`, the new directory renamed in, the old one deleted; if the rename fails the old
one is put back). On an exception `tmp` is deleted and `out` is left as it was. So a reader
never sees a half-written `out` -- though during a replacement there is a moment (between the
two renames) when `out` does not exist. Both renames stay inside `out`'s parent directory,
so they are atomic on one file system.

Every file of `tmp`, and `tmp` itself, is fsync'ed before the rename: without it a machine
that loses power just after the rename may keep `out` with empty or short files (the rename
reaches the disk before their data), which would read as a complete, broken export.

A write that fails because of the disk (full, read-only, over quota: `errors.disk_errno`) is
raised as `DiskWriteError`, naming `out`, the file and the cause, and saying that `out` is
unchanged.

Stdlib only.
"""
from __future__ import annotations

import contextlib
import errno
import os
import pathlib
import shutil
import tempfile
from typing import Iterator, Optional

from posttrain_jax.errors import (DiskWriteError, disk_cause, disk_errno, disk_fix, format_bytes,
                                  free_note)


@contextlib.contextmanager
def atomic_directory(out: os.PathLike, nbytes: Optional[int] = None) -> Iterator[pathlib.Path]:
  """Yields an empty temporary directory that replaces `out` when the block ends without error.
  `nbytes`: about how much the block writes (named in a disk-full error)."""
  out = pathlib.Path(out)
  existed = out.exists()
  tmp = None
  installed = False
  try:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    yield tmp
    _fsync_tree(tmp)
    old = _install(tmp, out)
    installed = True
    try:
      _fsync(str(out.parent), _DIR)  # the renames themselves
    finally:
      if old is not None:
        shutil.rmtree(old, ignore_errors=True)
  except BaseException as e:
    if tmp is not None and not installed:
      shutil.rmtree(tmp, ignore_errors=True)
    code = disk_errno(e) if isinstance(e, Exception) else None
    if code is None:
      raise
    if installed:  # only the last fsync failed: the new files are in place, maybe not on disk
      raise DiskWriteError(f"{out} was written but not synced to the disk: {disk_cause(code)}; "
                           f"a power loss now may leave it incomplete; "
                           f"{disk_fix(code, out.parent)}", code) from e
    kept = (f"the previous {out} is unchanged" if existed else f"nothing was left in {out.parent}")
    name = getattr(e, "filename", None)
    if name and tmp is not None and str(name).startswith(str(tmp)):
      name = os.path.relpath(name, tmp)
    where = (f" (writing {name})" if name and tmp is not None
             else f" (creating a temporary directory in {out.parent})" if tmp is None else "")
    size = (f", about {format_bytes(nbytes)} to write"
            if nbytes is not None and code in (errno.ENOSPC, errno.EDQUOT) else "")
    raise DiskWriteError(f"{out} was not written: {disk_cause(code)}{where}{size}"
                         f"{free_note(code, out.parent)}; {kept}; {disk_fix(code, out.parent)}",
                         code) from e


_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)


def _fsync_tree(root: pathlib.Path) -> None:
  """fsync every file under `root`, then every directory (children before parents)."""
  for dirpath, _, files in os.walk(root, topdown=False):
    for name in files:
      _fsync(os.path.join(dirpath, name), os.O_RDONLY)
    _fsync(dirpath, _DIR)


def _fsync(path: str, flags: int) -> None:
  fd = os.open(path, flags)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _install(tmp: pathlib.Path, out: pathlib.Path) -> Optional[pathlib.Path]:
  """Renames `tmp` to `out`; the previous `out`, now renamed aside (None if there was none)."""
  if not out.exists():
    tmp.rename(out)
    return None
  old = out.with_name(f".{out.name}.old")
  shutil.rmtree(old, ignore_errors=True)
  out.rename(old)
  try:
    tmp.rename(out)
  except BaseException:
    old.rename(out)
    raise
  return old


__all__ = ["atomic_directory"]
