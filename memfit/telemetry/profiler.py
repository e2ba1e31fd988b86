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

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile

from memfit.strategies.tensors import plain_tensors


def live_storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (tied and viewed tensors count once; a wrapper subclass,
    an NF4 weight, by its inner tensors)."""
    seen: set[int] = set()
    total = 0
    for t in (x for t in tensors for x in plain_tensors(t)):
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def profiled_peak_bytes(
    fn: Callable[[], object], already_live: Iterable[torch.Tensor], device: str = "CPU", skip_inside: tuple = ()
) -> int:
    """Peak bytes while ``fn()`` runs: what ``already_live`` holds plus the profiler's running sum
    of allocation events on ``device`` ("CPU" or "CUDA"), without those made inside ops named with a prefix in
    ``skip_inside`` (see ``allocation_events``)."""
    base = live_storage_bytes(already_live)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "CUDA" else [])
    with profile(activities=activities, profile_memory=True) as prof:
        fn()
    ev = allocation_events(prof, device.lower(), skip_inside)
    return base + peak_of(ev)


_COLLECTIVES = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor")
_COLLECTIVES += ("all_reduce", "all_gather", "broadcast")
SETTLE_S = 0.5
"""The longest a collective's caller waits for the backend's threads to let go of its tensors: FSDP2's all-gathers
and reduce-scatters on gloo let go within it (ZeRO-2/3 steps, idle and loaded, never reached it); a work object
that keeps its tensors until it dies (an async ``all_reduce`` the caller still holds) costs this once."""


def _storage_uses(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


@contextlib.contextmanager
def collectives_release_on_caller() -> Iterator[None]:
    """Make the calling thread release every tensor a collective touched, so the profiler sees each release.

    A backend's worker thread (gloo's) holds a collective's tensors until its work object dies; when that
    happens after the caller dropped its own references, the block is freed on the worker thread, which
    torch.profiler does not follow, and how often that happens depends on the machine's load (measured on
    2 gloo ranks at ZeRO-3: +2.8% and +4.7% over the true peak idle, +5.6% loaded). Inside this context each
    collective gets views of its tensors (each view one reference to the storage that the caller can count);
    when the op completes (its ``Work.wait()`` or, for a blocking call, its return) the caller waits until
    the backend's references are gone, so the last reference, and the release, stay on the caller's thread.
    """
    import torch.distributed as dist

    pending: dict[int, list[tuple[torch.Tensor, int]]] = {}

    def settle(held: list[tuple[torch.Tensor, int]]) -> None:
        deadline = time.monotonic() + SETTLE_S
        for t, uses in held:
            while _storage_uses(t) > uses and time.monotonic() < deadline:
                time.sleep(0.0002)

    def wrapped(fn):
        def call(*args, **kwargs):
            storages: dict[int, tuple[torch.Tensor, int]] = {}
            for a in (*args, *kwargs.values()):
                for t in a if isinstance(a, (list, tuple)) else (a,):
                    if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in storages:
                        storages[t.untyped_storage().data_ptr()] = (t, _storage_uses(t))

            def view(a):
                if isinstance(a, torch.Tensor):
                    return a.view(a.shape)
                return type(a)(view(x) for x in a) if isinstance(a, (list, tuple)) else a

            work = fn(*(view(a) for a in args), **{k: view(v) for k, v in kwargs.items()})
            held = list(storages.values())
            if isinstance(work, dist.Work):
                pending[id(work)] = held
            else:
                settle(held)
            return work

        return call

    original_wait = dist.Work.wait

    def wait(self, *args, **kwargs):
        done = original_wait(self, *args, **kwargs)
        settle(pending.pop(id(self), []))
        return done

    originals = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}
    try:
        for name, fn in originals.items():
            setattr(dist, name, wrapped(fn))
        dist.Work.wait = wait
        yield
    finally:
        dist.Work.wait = original_wait
        for name, fn in originals.items():
            setattr(dist, name, fn)


def all_events(prof):
    """Every event of the profile's event tree (ops, markers, allocations), depth first."""
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        ev = stack.pop()
        stack.extend(ev.children)
        yield ev


def _inside(ev, prefixes: tuple) -> bool:
    parent = ev.parent
    while parent is not None:
        if parent.name.startswith(prefixes):
            return True
        parent = parent.parent
    return False


def allocation_events(prof, device_type: str, skip_inside: tuple = ()) -> list[tuple[int, int, int]]:
    """(time ns, address, +bytes | -bytes) of every allocation and release on ``device_type``, less the
    allocations made inside an op whose name starts with one of ``skip_inside``: with ``("c10d::", "gloo:")``, a
    collective backend's private buffers (gloo's ``_reduce_scatter_base_`` clones its input, its ``_allgather_base_``
    and its worker's ``gloo:all_gather`` each allocate a flat buffer the size of the output, and its worker thread,
    which the profiler does not follow, frees them; NCCL makes no such copy and the planner models none)."""
    from torch._C._profiler import _EventType

    out = [
        (ev.start_time_ns, ev.extra_fields.ptr, ev.extra_fields.alloc_size)
        for ev in all_events(prof)
        if ev.tag == _EventType.Allocation
        and ev.extra_fields.device.type == device_type
        and not (skip_inside and ev.extra_fields.alloc_size > 0 and _inside(ev, skip_inside))
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
