"""Directories that appear whole: written under a temporary name beside the target, then renamed.

    with atomic_directory(out) as tmp:
      ...write every file into tmp...

On a normal exit `tmp` becomes `out`; an existing `out` is replaced (moved aside to
`.<name>.old`, the new directory renamed in, the old one deleted; if the rename fails the old
one is put back). On an exception `tmp` is deleted and `out` is left as it was. So a reader
never sees a half-written `out` -- though during a replacement there is a moment (between the
two renames) when `out` does not exist. Both renames stay inside `out`'s parent directory,
so they are atomic on one file system.

Stdlib only.
"""
from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import tempfile
from typing import Iterator


@contextlib.contextmanager
def atomic_directory(out: os.PathLike) -> Iterator[pathlib.Path]:
  """Yields an empty temporary directory that replaces `out` when the block ends without error."""
  out = pathlib.Path(out)
  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
  try:
    yield tmp
    _install(tmp, out)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def _install(tmp: pathlib.Path, out: pathlib.Path) -> None:
  if not out.exists():
    tmp.rename(out)
    return
  old = out.with_name(f".{out.name}.old")
  shutil.rmtree(old, ignore_errors=True)
  out.rename(old)
  try:
    tmp.rename(out)
  except BaseException:
    old.rename(out)
    raise
  shutil.rmtree(old, ignore_errors=True)


__all__ = ["atomic_directory"]
