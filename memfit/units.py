"""Byte units: constants for display (bytes stay integers everywhere else); parsing what users type: sizes, and the
words that switch something on or off."""

from __future__ import annotations

import os
import re

from memfit.errors import UserError

MIB = 1 << 20
GIB = 1 << 30

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(GiB|GB|G|MiB|MB|M|TiB|TB|T|KiB|KB|K)?\s*$", re.IGNORECASE)
_UNITS = {
    "gib": GIB,
    "g": GIB,
    "gb": 10**9,
    "mib": 1 << 20,
    "m": 1 << 20,
    "mb": 10**6,
    "tib": 1 << 40,
    "t": 1 << 40,
    "tb": 10**12,
    "kib": 1 << 10,
    "k": 1 << 10,
    "kb": 10**3,
}


def size_text(n: int) -> str:
    """``n`` bytes as a person reads them: GiB to two places, or MiB or bytes for a size that would show as 0.00 GiB."""
    if n >= 10 * MIB:
        return f"{n / GIB:.2f} GiB"
    return f"{n / MIB:.2f} MiB" if n >= 10 << 10 else f"{n:,} bytes"


def switch(text: str) -> bool | None:
    """True for on/yes/true/1, False for off/no/false/0 (any case, spaces around), None for any other text: the one
    spelling of a switch in flags, YAML and environment variables."""
    word = text.strip().lower()
    return True if word in ("on", "yes", "true", "1") else False if word in ("off", "no", "false", "0") else None


def parse_memory(text: str, flag: str = "--gpu-mem") -> int:
    """``64GiB`` / ``64`` (GiB) / ``80GB`` (decimal) / ``512MiB`` / ``1TiB`` to bytes.

    Raises:
        UserError: for anything else, naming ``flag``.
    """
    m = _SIZE.match(text)
    if not m:
        raise UserError(f"{flag} must look like 64GiB, 80GB or 512MiB (got '{text}')")
    value = int(float(m.group(1)) * _UNITS[(m.group(2) or "GiB").lower()])
    if value < 1:
        raise UserError(f"{flag} must be more than 0 bytes (got '{text}')")
    return value


def this_machine_memory() -> int:
    """This machine's physical memory in bytes (``os.sysconf``; 0 where the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes (Linux; empty where there is none)."""
    out = {}
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                key, value = line.split(":", 1)
                out[key] = int(value.split()[0]) * 1024
    except OSError:
        return {}
    return out


def statm_bytes() -> tuple[int, int]:
    """This process's mapped address space and resident set in bytes (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as fh:
        size, resident = fh.read().split()[:2]
    page = os.sysconf("SC_PAGE_SIZE")
    return int(size) * page, int(resident) * page


def process_rss_bytes() -> int:
    """Resident set size of this process now (Linux ``/proc/self/statm``)."""
    return statm_bytes()[1]
