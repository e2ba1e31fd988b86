"""Caching-allocator policy for CUDA and ROCm (settings string, memory cap, pre-warm, cache release), and the host's
malloc while a run trains.

PyTorch reads its allocator settings from ``PYTORCH_CUDA_ALLOC_CONF`` (``PYTORCH_HIP_ALLOC_CONF`` on
ROCm builds, ``PYTORCH_ALLOC_CONF`` on recent releases) when the allocator starts, i.e. at the first
GPU allocation. ``apply_allocator_env`` must therefore run before anything touches the GPU; if the
allocator is already up, the settings go through ``torch.cuda.memory._set_allocator_settings``.
On CPU none of this applies and the trainer says so once.

On the host, ``host_memory_kept`` keeps glibc's malloc from handing freed memory back to the kernel while a run
trains (``allocator.host_keep_freed``; unset, on for CPU training with room to spare: ``host_keep_decision``). By
default glibc serves a block over its mmap threshold (128 KiB, raised up to 32 MiB as such blocks are freed) with a
fresh ``mmap`` and unmaps it on ``free``, and trims the top of the heap past twice that: every step's logits,
activations and gradients then arrive as new pages that the kernel faults in and zeroes again, step after step. On
CPU that was 100,000-400,000 page faults a step (0.4-1.6 GB of pages zeroed), 8% of the default job's step time and
about half of a tiny model's at seq 512 (benchmarks/RESULTS.md). The price is resident memory: a kept heap reuses its
holes instead of returning them.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import resource
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from memfit.allocator.conf import parse, split_pairs, unsafe_combination
from memfit.config.schema import AllocatorConfig
from memfit.device import is_rocm
from memfit.errors import UserError
from memfit.units import GIB, meminfo, statm_bytes


def alloc_conf_items(cfg: AllocatorConfig) -> dict[str, str]:
    """The ``key:value`` pairs this config sets (empty when it leaves the allocator alone)."""
    items: dict[str, str] = {}
    if cfg.expandable_segments is not None:
        items["expandable_segments"] = "True" if cfg.expandable_segments else "False"
    if cfg.max_split_size_mb is not None:
        items["max_split_size_mb"] = str(cfg.max_split_size_mb)
    if cfg.garbage_collection_threshold is not None:
        items["garbage_collection_threshold"] = str(cfg.garbage_collection_threshold)
    return items


def env_var_name() -> str:
    return "PYTORCH_HIP_ALLOC_CONF" if is_rocm() else "PYTORCH_CUDA_ALLOC_CONF"


def conf_var() -> str:
    """The variable the allocator will read: ``PYTORCH_ALLOC_CONF`` when it is set (PyTorch reads it
    first, ``c10/core/AllocatorConfig.cpp``; the build's own name is its fallback), else the build's own."""
    return "PYTORCH_ALLOC_CONF" if os.environ.get("PYTORCH_ALLOC_CONF") else env_var_name()


def conf_in_effect() -> str:
    """The allocator settings string this process runs with ("" for the defaults)."""
    return os.environ.get(conf_var(), "")


def merge_conf(existing: str, items: dict[str, str]) -> str:
    """Merge our items into an existing ``k:v,k:v`` string; ours win, the user's other keys stay."""
    merged: dict[str, str] = {}
    for part in split_pairs(existing):
        key, _, value = part.partition(":")
        merged[key.strip()] = value.strip()
    merged.update(items)
    return ",".join(f"{k}:{v}" for k, v in merged.items())


def refuse_unsafe(cfg: AllocatorConfig, hip: str | None) -> None:
    """Refuse allocator settings known to misbehave on this build (``conf.unsafe_combination``: the config's
    own merged with the environment's), unless ``allocator.allow_unsafe``.

    Raises:
        UserError: naming the settings, what went wrong where, and the override.
    """
    merged = parse(merge_conf(conf_in_effect(), alloc_conf_items(cfg))).settings
    unsafe = unsafe_combination(merged, hip)
    if unsafe and not cfg.allow_unsafe:
        raise UserError(f"allocator: {unsafe}, or set allocator.allow_unsafe=true to run it anyway")


def apply_allocator_env(cfg: AllocatorConfig) -> str | None:
    """Put the settings where the allocator will read them. Returns the string applied, if any."""
    items = alloc_conf_items(cfg)
    if not items:
        return None
    name = conf_var()  # a user's PYTORCH_ALLOC_CONF would hide settings written to the build's own name
    conf = merge_conf(os.environ.get(name, ""), items)
    os.environ[name] = conf
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.memory._set_allocator_settings(conf)
    return conf


# glibc's mallopt parameters (malloc.h) and their documented defaults, which a run's end puts back
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
# kept: no mmap'd blocks, and the heap's top never trimmed (-1 is SIZE_MAX to glibc; a 2 GiB threshold gave a step's
# freed logits back each step at micro-batch 16: benchmarks/RESULTS.md)
_KEEP = {_M_TRIM_THRESHOLD: -1, _M_MMAP_MAX: 0}
_GLIBC_DEFAULTS = {_M_TRIM_THRESHOLD: 128 * 1024, _M_MMAP_MAX: 65536}


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (whose ``mallopt`` and ``malloc_trim`` we call), else None."""
    if sys.platform != "linux":
        return None
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
        return ctypes.CDLL("libc.so.6")
    except (OSError, ValueError):  # musl has no CS_GNU_LIBC_VERSION; no libc.so.6
        return None


KEEP_HEADROOM = 3
"""``allocator.host_keep_freed`` unset keeps freed host memory only where this many times the step's predicted peak
fits in the room the process has: a kept heap reuses holes rather than returning them, and its resident peak measured
1.1-1.7x the returning heap's on CPU steps (benchmarks/RESULTS.md)."""


def host_memory_room() -> int | None:
    """Bytes this process may still take: the least of the host's ``MemAvailable``, the address-space limit
    (``RLIMIT_AS``) less what is mapped, and the cgroup's ``memory.max`` less its usage (None where none is known)."""
    room = [meminfo().get("MemAvailable")]
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        room.append(soft - statm_bytes()[0])
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            room.append(int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        pass
    known = [r for r in room if r is not None]
    return min(known) if known else None


def host_keep_decision(
    cfg: AllocatorConfig, device: torch.device, predicted_peak: int | None, notes: list[str], room: int | None = -1
) -> bool:
    """Whether a run keeps freed host memory while it trains (``host_memory_kept``); a note for the run log, when it
    does or cannot, goes to ``notes``.

    ``host_keep_freed`` true or false decides (true needs glibc); unset, a CPU run keeps it when its predicted step
    peak times ``KEEP_HEADROOM`` fits in ``room`` (default: ``host_memory_room()``), and a GPU run does not.
    """
    if cfg.host_keep_freed is False or (cfg.host_keep_freed is None and device.type != "cpu"):
        return False
    if _glibc() is None:
        if cfg.host_keep_freed:
            notes.append("allocator.host_keep_freed needs glibc's malloc (Linux); this host's is left as it is")
        return False
    if cfg.host_keep_freed is None:
        room = host_memory_room() if room == -1 else room
        if predicted_peak is None or room is None or KEEP_HEADROOM * predicted_peak > room:
            return False
    notes.append(
        "host memory freed while training is kept for reuse, not returned to the kernel "
        "(allocator.host_keep_freed=false returns it)"
    )
    return True


def kept_heap_limit(baseline_rss: int, predicted_peak: int | None) -> int | None:
    """The resident set a kept heap may reach before it is handed back: the process before training plus the room
    ``host_keep_decision`` asked for (``KEEP_HEADROOM`` x the predicted step peak); None without a prediction."""
    return None if predicted_peak is None else baseline_rss + KEEP_HEADROOM * predicted_peak


@contextlib.contextmanager
def host_memory_kept(keep: bool, limit_bytes: int | None = None) -> Iterator[Callable[[], bool]]:
    """While open (when ``keep``: ``host_keep_decision``), glibc serves every block from its heap and keeps what is
    freed: after the first steps a step reuses the pages earlier ones faulted in. On the way out glibc's default
    thresholds return and ``malloc_trim`` hands the free heap back to the kernel.

    The cost is resident memory: the process keeps its peak heap for the run, and a block freed in the middle of
    the heap is reused rather than returned. How far a kept heap grows past the step's needs varies from run to run (a
    tiny model at seq 512, micro-batch 4: 2.4 GiB resident after 8 steps, 2.7-3.5 GiB after 30 to 200, against 1.6
    GiB returned). So the context yields ``bound()``, for after each step: when the resident set exceeds
    ``limit_bytes`` it hands the free heap back (``malloc_trim``; the next step faults its blocks in once more) and
    returns True.
    """
    libc = _glibc() if keep else None
    if libc is None:
        yield lambda: False
        return

    def bound() -> bool:
        if limit_bytes is None or statm_bytes()[1] <= limit_bytes:
            return False
        libc.malloc_trim(0)
        return True

    for param, value in _KEEP.items():
        libc.mallopt(param, value)
    try:
        yield bound
    finally:
        for param, value in _GLIBC_DEFAULTS.items():
            libc.mallopt(param, value)
        libc.malloc_trim(0)


def apply_device_limits(cfg: AllocatorConfig, device: torch.device) -> list[str]:
    """Memory-fraction cap and pre-warm reservation on a GPU. Returns notes for the run log."""
    notes: list[str] = []
    if device.type != "cuda":
        if alloc_conf_items(cfg) or cfg.memory_fraction or cfg.prewarm_gib or cfg.empty_cache_every:
            notes.append("allocator settings apply to CUDA/ROCm devices only; ignored on CPU")
        return notes
    if cfg.garbage_collection_threshold is not None and cfg.memory_fraction is None:
        notes.append("allocator.garbage_collection_threshold only acts with allocator.memory_fraction set")
    if cfg.memory_fraction is not None:
        torch.cuda.set_per_process_memory_fraction(cfg.memory_fraction, device)
    if cfg.prewarm_gib > 0:
        block = torch.empty(int(cfg.prewarm_gib * GIB), dtype=torch.uint8, device=device)
        del block  # the segment stays reserved in the cache for later allocations
        notes.append(
            f"pre-warmed {cfg.prewarm_gib:g} GiB (reserved {torch.cuda.memory_reserved(device) / GIB:.2f} GiB)"
        )
    return notes


def maybe_release_cache(cfg: AllocatorConfig, device: torch.device, step: int) -> bool:
    """``empty_cache()`` every ``empty_cache_every`` optimizer steps on a GPU. Returns whether it ran."""
    if device.type == "cuda" and cfg.empty_cache_every and step % cfg.empty_cache_every == 0:
        torch.cuda.empty_cache()
        return True
    return False
