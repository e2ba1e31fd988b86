"""Writing a run's files without a traceback: an output directory that cannot be created, a full disk.

Checkpoints and exports are written atomically (``checkpoint.py``), so a failed write leaves the previous
checkpoint as it was; what is left to do here is to say, in one line, which path, how many bytes were needed and
how many were free, before the write when the shortage is known and after it when the filesystem only says so
midway (``torch.save`` reports a full disk as "unexpected pos ...").
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from memfit.errors import UserError, first_line
from memfit.units import MIB

_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_HEADROOM = 1.05  # file headers, the manifest, pickled optimizer structure beside the tensors


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem that holds ``path`` (or its nearest existing ancestor)."""
    return shutil.disk_usage(_existing_ancestor(path)).free


def _existing_ancestor(path: Path) -> Path:
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_creatable(path: Path, what: str) -> None:
    """Refuse, in one line, a directory that cannot be created or written (under a file, under /proc or /sys, on
    a read-only mount, without permission); nothing is left behind by the probe.

    Raises:
        UserError: naming ``what``, the path and the reason.
    """
    if path.is_dir():
        probe_in = path
    else:
        probe_in = _existing_ancestor(path)
        if not probe_in.is_dir():
            raise UserError(f"{what} '{path}' cannot be created: {probe_in} is a file; choose a directory path")
    try:
        tempfile.TemporaryDirectory(dir=probe_in, prefix=".memfit-probe-").cleanup()
    except OSError as e:
        raise UserError(
            f"{what} '{path}' cannot be created or written ({probe_in}: {e.strerror}); choose a writable directory"
        ) from None


def _space_line(what: str, path: Path, needed: int, free: int) -> str:
    return (
        f"{what}: no space left for {path} (about {needed / MIB:,.0f} MiB needed, {free / MIB:,.0f} MiB free); "
        "free some space or set output.dir on a larger filesystem"
    )


@contextlib.contextmanager
def guarded_write(what: str, path: Path, needed: int) -> Iterator[None]:
    """Write ``path`` (about ``needed`` bytes) in the block: refused before it starts when the filesystem has
    less free, and a full disk or an unwritable path met midway turned into one line.

    Raises:
        UserError: not enough space (path, bytes needed and free) or the path cannot be written.
    """
    needed = int(needed * _HEADROOM)
    free = free_bytes(path)
    if free < needed:
        raise UserError(_space_line(what, path, needed, free))
    try:
        yield
    except OSError as e:
        if e.errno in _FULL:
            raise UserError(_space_line(what, path, needed, free_bytes(path))) from None
        if e.errno in (errno.EACCES, errno.EROFS, errno.EPERM, errno.ENOTDIR):
            raise UserError(f"{what}: cannot write {path} ({e.strerror}); choose a writable output.dir") from None
        raise
    except RuntimeError as e:  # torch's zip writer hides the errno of a failed write
        if not any(sign in str(e) for sign in _FAILED_WRITE):
            raise
        raise UserError(_space_line(what, path, needed, free_bytes(path)) + f" (torch: {first_line(e)})") from None


_FAILED_WRITE = ("unexpected pos", "file write failed", "No space left", "Disk quota")
