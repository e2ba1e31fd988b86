"""Measured peaks on real tensors, independent of memfit's own accounting: torch.profiler's memory
events (every CPU/GPU allocation and release with its address and size) replayed in time order.

Used by tests and benchmarks to check the planner. Only allocations made inside the profiled region
appear as events, so the tensors alive before it (parameters, buffers, optimizer state, inputs) are
passed in and counted once by storage.

A release made on a thread the profiler does not follow (gloo's collective threads drop the last
reference to some buffers) is missing from the events, and a plain running sum would keep that block
forever: on 2 gloo ranks it over-counted one rank's peak by up to 7%. Events are therefore matched by
address: an allocation at an address that is still live proves the earlier block there was released.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile


def live_storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (tied and viewed tensors count once)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def profiled_peak_bytes(fn: Callable[[], object], already_live: Iterable[torch.Tensor], device: str = "CPU") -> int:
    """Peak bytes while ``fn()`` runs: what ``already_live`` holds plus the profiler's running sum
    of allocation events on ``device`` ("CPU" or "CUDA")."""
    base = live_storage_bytes(already_live)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "CUDA" else [])
    with profile(activities=activities, profile_memory=True) as prof:
        fn()
    return base + peak_of(allocation_events(prof, device.lower()))


def all_events(prof):
    """Every event of the profile's event tree (ops, markers, allocations), depth first."""
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        ev = stack.pop()
        stack.extend(ev.children)
        yield ev


def allocation_events(prof, device_type: str) -> list[tuple[int, int, int]]:
    """(time ns, address, +bytes | -bytes) of every allocation and release on ``device_type``."""
    from torch._C._profiler import _EventType

    out = [
        (ev.start_time_ns, ev.extra_fields.ptr, ev.extra_fields.alloc_size)
        for ev in all_events(prof)
        if ev.tag == _EventType.Allocation and ev.extra_fields.device.type == device_type
    ]
    out.sort(key=lambda e: e[0])
    return out


@dataclass
class Block:
    ptr: int
    nbytes: int
    start: int  # index of its allocation event
    end: int | None = None  # index of the event that ended it (release, or reuse of its address)
    saved: bool = False  # autograd saved it for backward while it was live
    host: bool = False  # an offloaded activation's host copy (a host marker while it was live)


def live_blocks(
    events: list[tuple[int, int, int]], saved: Iterable[tuple[int, int]] = (), host: Iterable[tuple[int, int]] = ()
) -> tuple[list[Block], list[Block]]:
    """Replay ``events`` (and saved-tensor and host-copy markers: (time ns, address)) in time order: every
    block allocated, in order, and the blocks live at the (first) peak. A block counts from its allocation
    to its release, or to the next allocation at its address (whose release the profiler did not see)."""
    marks = sorted([(t, ptr, "saved") for t, ptr in saved] + [(t, ptr, "host") for t, ptr in host])
    live: dict[int, Block] = {}
    blocks: list[Block] = []
    current = peak = 0
    peak_at = -1
    m = 0
    for i, (time_ns, ptr, nbytes) in enumerate(events):
        while m < len(marks) and marks[m][0] <= time_ns:
            if marks[m][1] in live:
                setattr(live[marks[m][1]], marks[m][2], True)
            m += 1
        if nbytes > 0:
            old = live.pop(ptr, None)
            if old is not None:
                old.end, current = i, current - old.nbytes
            live[ptr] = block = Block(ptr, nbytes, i)
            blocks.append(block)
            current += nbytes
            if current > peak:
                peak, peak_at = current, i
        elif ptr in live:  # releases of blocks from before the profiled region are not reported
            old = live.pop(ptr)
            old.end, current = i, current - old.nbytes
    for _, ptr, kind in marks[m:]:
        if ptr in live:
            setattr(live[ptr], kind, True)
    at_peak = [b for b in blocks if b.start <= peak_at and (b.end is None or b.end > peak_at)]
    return blocks, at_peak


def split_host(events: list[tuple[int, int, int]], blocks: list[Block]) -> tuple[list[tuple[int, int, int]], int]:
    """The events without the host blocks' (``live_blocks``' blocks of ``events``): what a device would
    hold, on a CPU where host and device are one memory; and the highest sum of live host blocks."""
    skip, deltas = set(), []
    for b in blocks:
        if b.host:
            skip.add(b.start)
            deltas.append((b.start, b.nbytes))
            if b.end is not None:
                deltas.append((b.end, -b.nbytes))
                if events[b.end][2] < 0:  # its release (not the reuse of its address by another block)
                    skip.add(b.end)
    current = peak = 0
    for _, delta in sorted(deltas, key=lambda d: (d[0], d[1])):
        current += delta
        peak = max(peak, current)
    return [e for i, e in enumerate(events) if i not in skip], peak


def peak_of(events: list[tuple[int, int, int]]) -> int:
    """Highest sum of live blocks (see ``live_blocks``)."""
    return sum(b.nbytes for b in live_blocks(events)[1])
