"""What memfit's on-disk caches share: where they live, what code they were written by, and how an entry is
written and read back. Imports nothing heavy, so a cached answer is read without importing torch.

Every cache lives under ``$MEMFIT_CACHE`` (default ``~/.cache/memfit``) unless its own variable points elsewhere;
that variable set to ``off`` (or ``0``, ``false``, ``no``) turns the cache off, and set to ``on`` (or ``1``,
``true``, ``yes``) keeps it where it would be unset: a switch's word is never taken for a directory in the working
one, and a leading ``~`` is the home directory. Entries are gzipped JSON named by a SHA-256. Writers write a temporary
file in the same directory and rename it into place (atomic on POSIX), so concurrent writers never leave half an
entry and the last one wins; an entry that cannot be read is said in one line on stderr and removed.

Each cache directory keeps at most ``MEMFIT_CACHE_LIMIT`` bytes of entries (default ``CACHE_LIMIT``; ``off``: no
limit): past it, a write removes the entries least recently read or written (a read marks its entry's time), and
temporary files that a killed writer left an hour ago or more. Keys name memfit's source and the library versions, so
without a limit every upgrade would leave the old entries behind for good.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from memfit.errors import UserError
from memfit.units import GIB, parse_memory, switch

LIBRARIES = ("torch", "transformers", "peft", "torchao")
"""The libraries whose versions change what memfit traces and predicts."""


def cache_dir() -> Path:
    setting = os.environ.get("MEMFIT_CACHE")
    return Path(setting).expanduser() if setting else Path.home() / ".cache" / "memfit"  # set but empty: the default


def _reason(error: OSError) -> str:
    return f"{type(error).__name__}: {error.strerror or error}"


def cache_write_error(error: OSError, where: Path, what: str) -> UserError:
    """The one line for ``what`` that could not be written into the cache directory ``where``."""
    return UserError(
        f"cannot write {what} into '{where}' ({_reason(error)}); set MEMFIT_CACHE to a writable directory with room"
    )


def make_cache_dir(where: Path, what: str) -> Path:
    """``where`` (parents too), made before ``what`` is computed to be written there.

    Raises:
        UserError: where it cannot be made (``MEMFIT_CACHE`` on a read-only or missing mount).
    """
    try:
        where.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise cache_write_error(e, where, what) from None
    return where


def cache_root(variable: str, default: str) -> Path | None:
    """The directory a cache's entries live in: ``$variable``, else ``<memfit cache>/default``; None when off."""
    setting = os.environ.get(variable)
    if setting is None:
        return cache_dir() / default
    on = switch(setting)
    if on is False or not setting.strip():  # set but empty: off
        return None
    return cache_dir() / default if on else Path(setting).expanduser()


@functools.cache
def code_and_versions() -> str:
    """The SHA-256 of memfit's source bytes and the versions of the libraries it traces through, so that a
    changed planner never reads an entry an older one wrote, even at the same version number."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parent
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    for dist in LIBRARIES:
        try:
            h.update(f"{dist}={metadata.version(dist)}".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{dist}=-".encode())
    return h.hexdigest()


def file_digest(path: str | Path) -> str | None:
    """SHA-256 of a file's bytes (read in 4 MiB pieces), or None where it cannot be read."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
    except OSError:
        return None
    return h.hexdigest()


def digest(described: Any) -> str:
    """The entry name of ``described`` (anything JSON can write, keys sorted)."""
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()


CACHE_LIMIT = 4 * GIB
"""Bytes of entries each cache directory (traces, plans, configs, data) keeps unless ``MEMFIT_CACHE_LIMIT`` says."""

_STALE_TMP_S = 3600


def cache_limit() -> int | None:
    """``MEMFIT_CACHE_LIMIT`` in bytes (``8GiB``, ``512MiB``, ...; ``off``: None, no limit), else ``CACHE_LIMIT``.

    Raises:
        UserError: neither a size nor ``off``.
    """
    setting = os.environ.get("MEMFIT_CACHE_LIMIT", "").strip()
    if not setting:
        return CACHE_LIMIT
    if switch(setting) is False:
        return None
    try:
        return parse_memory(setting, "MEMFIT_CACHE_LIMIT")
    except UserError:
        raise UserError(
            f"MEMFIT_CACHE_LIMIT must be a size such as 8GiB or 512MiB, or off for no limit (got '{setting}')"
        ) from None


_HELD: dict[Path, int] = {}
"""Bytes of entries each cache directory held when this process last counted them, with what it wrote since."""


def _entries(root: Path) -> list[tuple[float, int, Path]]:
    """``root``'s entries, least recently used first, as (time, bytes, path); a writer's temporary file an hour old
    or more is removed (its writer was killed before the rename)."""
    out, now = [], time.time()
    for path in root.iterdir():
        try:
            st = path.stat()
        except OSError:
            continue
        if path.name.startswith(".tmp-") and now - st.st_mtime >= _STALE_TMP_S:
            path.unlink(missing_ok=True)
        elif path.name.endswith(".json.gz") and not path.name.startswith("."):
            out.append((st.st_mtime, st.st_size, path))
    return sorted(out)


def keep_within_limit(root: Path, written: Path, size: int) -> None:
    """After ``written`` (``size`` bytes) went into ``root``: remove the least recently used other entries until
    ``root`` holds at most ``cache_limit()`` bytes. The directory is counted at this process's first write and again
    whenever what it wrote since would pass the limit."""
    limit = cache_limit()
    if limit is None:
        return
    held = _HELD.get(root)
    if held is not None and held + size <= limit:
        _HELD[root] = held + size
        return
    try:
        entries = _entries(root)
    except OSError:
        return
    total = sum(n for _, n, _ in entries)
    for _, n, path in entries:
        if total <= limit:
            break
        if path != written:
            try:
                path.unlink()
            except OSError:
                continue
            total -= n
    _HELD[root] = total


def read_entry(root: Path | None, key: str, what: str, parse: Callable[[Any], Any] = lambda data: data) -> Any | None:
    """Entry ``key`` as ``parse`` makes it from the decoded JSON, or None: not cached, the cache off, or damaged (not
    gzipped JSON, or ``parse`` raised ValueError, KeyError or TypeError: said in one line on stderr, naming ``what``
    the cache holds, and removed)."""
    if root is None:
        return None
    path = root / f"{key}.json.gz"
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    try:
        value = parse(json.loads(gzip.decompress(raw)))
    except (OSError, EOFError, ValueError, KeyError, TypeError, RecursionError) as e:  # RecursionError: nested deep
        drop_damaged(path, what, e)
        return None
    try:
        os.utime(path)  # read now: the last the limit removes
    except OSError:
        pass  # a cache another user owns, or read-only: read, not marked
    return value


def drop_damaged(path: Path, what: str, error: Exception) -> None:
    """Say in one line that ``path`` is damaged and remove it, so the next run writes it again."""
    why = type(error).__name__
    print(f"memfit: {what} cache entry {path} is damaged ({why}); ignored and rebuilt", file=sys.stderr)
    try:
        path.unlink()
    except OSError:
        pass


_UNWRITABLE: set[Path] = set()


def write_entry(root: Path | None, key: str, value: Any) -> None:
    """Write ``value`` as entry ``key`` (atomically; skipped where the cache is off, and where it cannot be written,
    which is said once per cache in one line on stderr)."""
    if root is None:
        return
    data = gzip.compress(json.dumps(value).encode(), compresslevel=3)
    tmp = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=".tmp-", suffix=".json.gz", delete=False) as fh:
            tmp = fh.name
            fh.write(data)
        os.replace(tmp, root / f"{key}.json.gz")
        keep_within_limit(root, root / f"{key}.json.gz", len(data))
    except OSError as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if root not in _UNWRITABLE:
            _UNWRITABLE.add(root)
            print(f"memfit: the cache at {root} cannot be written ({_reason(e)}); going on without it", file=sys.stderr)
