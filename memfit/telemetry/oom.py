"""Recognising out-of-memory errors (CUDA/HIP caching allocator and the CPU allocator) and what they asked for."""

from __future__ import annotations

import re

import torch

_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
_GPU = re.compile(r"Tried to allocate (\d+(?:\.\d+)?) (B|KiB|MiB|GiB|TiB)")
_CPU = re.compile(r"can't allocate memory: you tried to allocate (\d+) bytes")


def oom_request_bytes(error: BaseException) -> int | None:
    """Bytes the failed allocation asked for, or None when ``error`` is not an out-of-memory error."""
    text = str(error)
    m = _GPU.search(text)
    if m and (isinstance(error, torch.OutOfMemoryError) or "out of memory" in text):
        return int(float(m.group(1)) * _UNITS[m.group(2)])
    m = _CPU.search(text)
    if m:
        return int(m.group(1))
    if isinstance(error, torch.OutOfMemoryError):
        return 0
    return None
