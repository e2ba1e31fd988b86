"""The allocator's block layout at any moment of a recorded trace, rebuilt from a snapshot.

A snapshot holds the layout at the dump (segments and blocks) and, when history was recorded, the
trace of allocator events before it. Walking the trace backwards from the dump gives the segments
and live blocks when recording started; walking it forwards again gives the layout after every
event: reserved, allocated, requested, external free and the largest free block, so the
fragmentation ratio at the peak rather than at the dump (a training step's dump comes after the
step, when activations are gone and the holes they left look different).

Sizes. Trace entries carry the *requested* size (``orig_size`` in the ``record_trace(ALLOC, ...)``
call of ``c10/cuda/CUDACachingAllocator.cpp``), not the block's. A block still live at the dump has
its size in the snapshot; every other block's size follows from the allocator's rules: the request
rounded (``round_size``), carved from the front of the free block that starts at its address (which
runs to the next live block or the end of the segment, free neighbours being always merged), and
that free block kept whole when the rest is too small to split (``should_split``).

Known limitations: blocks are freed at ``free_completed`` (the allocator's ``allocated`` statistic
drops at ``free_requested``, earlier when a block was used on another stream); blocks allocated
before recording started and freed during it get rounded sizes, not their true ones; private pools
(CUDA graphs) are treated like the default pool.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

from memfit.allocator.model import (
    K_LARGE_BUFFER,
    K_SMALL_BUFFER,
    AllocatorSettings,
    round_size,
    should_split,
)
from memfit.allocator.snapshot import ACTIVE_STATES, FragReport, SegmentStats
from memfit.units import MIB

NO_MAX_SPLIT = 1 << 62  # the snapshot's max_split_size when none is set is SIZE_MAX


def settings_in(snapshot: dict[str, Any]) -> AllocatorSettings:
    """The allocator settings a snapshot was taken under (its ``allocator_settings``, newer PyTorch);
    defaults where absent. Per-interval ``roundup_power2_divisions`` count only when all are equal."""
    s = snapshot.get("allocator_settings") or {}
    max_split = int(s.get("max_split_size") or 0)
    divisions = {int(v) for v in (s.get("roundup_power2_divisions") or {}).values()} - {0}
    return AllocatorSettings(
        max_split_size_mb=max_split >> 20 if 0 < max_split < NO_MAX_SPLIT else None,
        roundup_power2_divisions=divisions.pop() if len(divisions) == 1 else None,
        expandable_segments=bool(s.get("expandable_segments", False)),
    )


@dataclass(frozen=True)
class TimelinePoint:
    index: int
    time_us: int | None
    allocated_bytes: int
    reserved_bytes: int


@dataclass
class _Segment:
    start: int
    end: int
    small: bool
    expandable: bool
    stream: int


@dataclass
class _Block:
    size: int
    requested: int
    inferred: bool  # size from the rules, not from the snapshot
    awaiting: bool = False  # free requested, not completed (another stream still uses it)


class _Layout:
    """Segments and live blocks by address; running totals."""

    def __init__(self) -> None:
        self.segments: dict[int, _Segment] = {}
        self.seg_starts: list[int] = []
        self.blocks: dict[int, _Block] = {}
        self.block_starts: list[int] = []
        self.reserved = self.allocated = self.requested = 0

    def copy(self) -> "_Layout":
        c = _Layout()
        c.segments = {a: _Segment(**vars(s)) for a, s in self.segments.items()}
        c.seg_starts = list(self.seg_starts)
        c.blocks = {a: _Block(**vars(b)) for a, b in self.blocks.items()}
        c.block_starts = list(self.block_starts)
        c.reserved, c.allocated, c.requested = self.reserved, self.allocated, self.requested
        return c

    def segment_at(self, addr: int) -> _Segment | None:
        i = bisect.bisect_right(self.seg_starts, addr) - 1
        if i >= 0:
            seg = self.segments[self.seg_starts[i]]
            if addr < seg.end:
                return seg
        return None

    def _insert_segment(self, seg: _Segment) -> None:
        self.segments[seg.start] = seg
        bisect.insort(self.seg_starts, seg.start)

    def _drop_segment(self, seg: _Segment) -> None:
        del self.segments[seg.start]
        self.seg_starts.pop(bisect.bisect_left(self.seg_starts, seg.start))

    def map(self, start: int, size: int, small: bool | None, expandable: bool, stream: int) -> None:
        """Add ``size`` bytes of segment at ``start``; mapped ranges of expandable segments that touch
        merge (the snapshot reports one segment per contiguous mapped range). ``small=None``: the pool
        of a touching range, else judged from the size."""
        end = start + size
        self.reserved += size
        if expandable:
            before, after = self.segment_at(start - 1), self.segment_at(end)
            if before and before.expandable and before.end == start:
                small = before.small if small is None else small
                self._drop_segment(before)
                start = before.start
            if after and after.expandable and after.start == end:
                small = after.small if small is None else small
                self._drop_segment(after)
                end = after.end
        if small is None:
            small = size % K_LARGE_BUFFER != 0
        self._insert_segment(_Segment(start, end, small, expandable, stream))

    def unmap(self, start: int, size: int) -> bool:
        """Remove ``[start, start + size)`` from the segment holding it (the whole segment, or a
        piece of an expandable one). False when no segment holds it (an inconsistent trace)."""
        seg = self.segment_at(start)
        if seg is None:
            return False
        end = min(start + size, seg.end)
        self.reserved -= end - start
        self._drop_segment(seg)
        if seg.start < start:
            self._insert_segment(_Segment(seg.start, start, seg.small, seg.expandable, seg.stream))
        if end < seg.end:
            self._insert_segment(_Segment(end, seg.end, seg.small, seg.expandable, seg.stream))
        return True

    def add_block(self, addr: int, block: _Block) -> None:
        if addr in self.blocks:
            self.remove_block(addr)
        self.blocks[addr] = block
        bisect.insort(self.block_starts, addr)
        self.allocated += block.size
        self.requested += block.requested

    def remove_block(self, addr: int) -> _Block | None:
        block = self.blocks.pop(addr, None)
        if block is not None:
            self.block_starts.pop(bisect.bisect_left(self.block_starts, addr))
            self.allocated -= block.size
            self.requested -= block.requested
        return block

    def free_run(self, addr: int, seg: _Segment) -> int:
        """Bytes from ``addr`` to the next live block or the end of its segment."""
        i = bisect.bisect_right(self.block_starts, addr)
        nxt = self.block_starts[i] if i < len(self.block_starts) else seg.end
        return min(nxt, seg.end) - addr

    def block_size(self, addr: int, requested: int, settings: AllocatorSettings) -> int:
        """Size of a block allocated at ``addr`` for ``requested`` bytes, by the allocator's rules."""
        size = round_size(requested, settings.roundup_power2_divisions)
        seg = self.segment_at(addr)
        if seg is None:
            return size
        free = self.free_run(addr, seg)
        max_split = settings.max_split_size_mb << 20 if settings.max_split_size_mb else None
        if free < size or should_split(free - size, size, seg.small, seg.expandable, max_split):
            return size
        return free

    def report(self, device: int) -> FragReport:
        """The layout as ``analyze`` reports a snapshot (blocks outside any segment are left out)."""
        segs = []
        for start in self.seg_starts:
            seg = self.segments[start]
            i = bisect.bisect_left(self.block_starts, seg.start)
            rows, at, alloc, req, largest = [], seg.start, 0, 0, 0
            while i < len(self.block_starts) and self.block_starts[i] < seg.end:
                addr = self.block_starts[i]
                b = self.blocks[addr]
                if addr > at:
                    rows.append((at - seg.start, addr - at, "inactive"))
                    largest = max(largest, addr - at)
                rows.append((addr - seg.start, b.size, "active_awaiting_free" if b.awaiting else "active_allocated"))
                alloc, req = alloc + b.size, req + b.requested
                at = max(at, addr + b.size)
                i += 1
            if at < seg.end:
                rows.append((at - seg.start, seg.end - at, "inactive"))
                largest = max(largest, seg.end - at)
            segs.append(
                SegmentStats(
                    seg.start,
                    device,
                    seg.stream,
                    "small" if seg.small else "large",
                    seg.end - seg.start,
                    alloc,
                    req,
                    largest,
                    tuple(rows),
                )
            )
        return FragReport.of(device, tuple(segs))


@dataclass(frozen=True)
class Moment:
    """The layout after trace entry ``index`` (-1: when recording started)."""

    index: int
    time_us: int | None
    report: FragReport
    inferred_blocks: int  # live blocks whose size came from the rules, not the snapshot


@dataclass(frozen=True)
class OomMoment:
    """An out-of-memory error in the trace, with the layout at that moment."""

    requested_bytes: int  # the (rounded) request that failed
    device_free_bytes: int  # what the device reported free
    moment: Moment

    @property
    def cause(self) -> str:
        """ "fragmentation" when the cache held enough free memory but no block large enough (and the
        device too little to map more); "shortage" when even all of it together was too little."""
        r = self.moment.report
        if r.largest_free_bytes >= self.requested_bytes:
            return "unclear"  # a block was large enough: on another stream, or a request the trace does not show
        return "fragmentation" if r.external_free_bytes + self.device_free_bytes >= self.requested_bytes else "shortage"

    def as_dict(self) -> dict[str, Any]:
        r = self.moment.report
        return {
            "requested_bytes": self.requested_bytes,
            "device_free_bytes": self.device_free_bytes,
            "trace_entry": self.moment.index,
            "cause": self.cause,
            "external_free_bytes": r.external_free_bytes,
            "largest_free_bytes": r.largest_free_bytes,
            "fragmentation_ratio": r.fragmentation_ratio,
        }

    def explain(self) -> str:
        r = self.moment.report
        head = (
            f"OOM at trace entry {self.moment.index}: asked for {self.requested_bytes / MIB:.1f} MiB with "
            f"{self.device_free_bytes / MIB:.1f} MiB free on the device; the cache held "
            f"{r.external_free_bytes / MIB:.1f} MiB "
            f"free in {sum(st == 'inactive' for s in r.segments for _, _, st in s.blocks)} blocks, the largest "
            f"{r.largest_free_bytes / MIB:.1f} MiB (fragmentation {r.fragmentation_ratio:.2f})"
        )
        why = {
            "fragmentation": "enough free memory, but in pieces: expandable segments or a smaller max_split_size_mb "
            "may avoid it (compare them with --simulate)",
            "shortage": "too little memory: all the free memory together is less than the request; the workload "
            "must shrink (memfit plan suggests how)",
            "unclear": "a free block was large enough: it may have been on another stream",
        }[self.cause]
        return f"{head}: {why}"


class Rebuilt:
    """One device's trace replayed over the layout it started from.

    Args:
        snapshot: a loaded snapshot with ``device_traces``.
        device: the device index.
        settings: the allocator settings the process ran with (default: the snapshot's own).
    """

    def __init__(self, snapshot: dict[str, Any], device: int = 0, settings: AllocatorSettings | None = None):
        traces = snapshot.get("device_traces") or []
        self.entries: list[dict[str, Any]] = traces[device] if device < len(traces) else []
        self.device = device
        self.settings = settings if settings is not None else settings_in(snapshot)
        self.known: dict[int, tuple[int, int]] = {}  # alloc entry index -> (size, requested) from the snapshot
        self._size_rule = (0, 0)  # (blocks checked, misses), set by a whole replay
        self.start = self._rewound(snapshot)
        self._totals: list[TimelinePoint] | None = None

    def _rewound(self, snapshot: dict[str, Any]) -> _Layout:
        """The layout when recording started: the dump's, with the trace undone from the end."""
        lay = _Layout()
        final: dict[int, tuple[int, int]] = {}
        for seg in snapshot["segments"]:
            if seg.get("device", 0) != self.device:
                continue
            base, total = int(seg["address"]), int(seg["total_size"])
            expandable = bool(seg.get("is_expandable", False))
            lay.map(base, total, seg.get("segment_type", "large") == "small", expandable, seg.get("stream", 0))
            for b in seg["blocks"]:
                if b["state"] in ACTIVE_STATES:
                    addr, size = int(b["address"]), int(b["size"])
                    final[addr] = (size, int(b.get("requested_size", size)))
                    lay.add_block(addr, _Block(*final[addr], False, b["state"] == "active_awaiting_free"))
        pending: dict[int, int] = {}  # addr -> requested, freed during the trace, allocated before it
        for i in range(len(self.entries) - 1, -1, -1):
            e = self.entries[i]
            action, addr, size = e.get("action"), int(e.get("addr", 0)), int(e.get("size", 0))
            if action == "alloc":
                if lay.remove_block(addr) is not None and addr in final:
                    self.known[i] = final.pop(addr)
                pending.pop(addr, None)
            elif action == "free_completed":
                lay.add_block(addr, _Block(0, size, True))
                pending[addr] = size
            elif action == "free_requested":
                if addr in lay.blocks:
                    lay.blocks[addr].awaiting = False
            elif action in ("segment_alloc", "segment_map"):
                lay.unmap(addr, size)
            elif action == "segment_free":
                lay.map(addr, size, size == K_SMALL_BUFFER, False, e.get("stream", 0))
            elif action == "segment_unmap":
                lay.map(addr, size, None, True, e.get("stream", 0))
        for addr in sorted(pending):  # sizes of blocks allocated before recording, by the rules
            b = lay.remove_block(addr)
            b.size = lay.block_size(addr, b.requested, self.settings)
            lay.add_block(addr, b)
        return lay

    def _replay(self, stop: int | None = None) -> tuple[_Layout, list[TimelinePoint]]:
        """Forward from the start through entry ``stop`` (all when None)."""
        lay = self.start.copy()
        points: list[TimelinePoint] = []
        last = len(self.entries) - 1 if stop is None else stop
        checked = misses = 0
        for i in range(last + 1):
            e = self.entries[i]
            action, addr, size = e.get("action"), int(e.get("addr", 0)), int(e.get("size", 0))
            if action == "alloc":
                by_rule = lay.block_size(addr, size, self.settings)
                if i in self.known:
                    checked, misses = checked + 1, misses + (by_rule != self.known[i][0])
                    lay.add_block(addr, _Block(*self.known[i], False))
                else:
                    lay.add_block(addr, _Block(by_rule, size, True))
            elif action == "free_requested":
                if addr in lay.blocks:
                    lay.blocks[addr].awaiting = True
            elif action == "free_completed":
                lay.remove_block(addr)
            elif action in ("segment_alloc", "segment_map"):
                lay.map(
                    addr,
                    size,
                    size == K_SMALL_BUFFER if action == "segment_alloc" else None,
                    action == "segment_map",
                    e.get("stream", 0),
                )
            elif action in ("segment_free", "segment_unmap"):
                lay.unmap(addr, size)
            if stop is None:
                points.append(TimelinePoint(i, e.get("time_us"), lay.allocated, lay.reserved))
        if stop is None:
            self._size_rule = (checked, misses)
        return lay, points

    @property
    def size_rule_checked(self) -> int:
        """Blocks live at the dump and allocated during the trace: their sizes by the rules were checked."""
        self.totals()
        return self._size_rule[0]

    @property
    def size_rule_misses(self) -> int:
        """Of those, how many the rounding and split rules sized differently from the snapshot."""
        self.totals()
        return self._size_rule[1]

    def totals(self) -> list[TimelinePoint]:
        """Allocated and reserved bytes after each entry (blocks at their sizes, not the requests)."""
        if self._totals is None:
            self._totals = self._replay()[1]
        return self._totals

    def at(self, index: int) -> Moment:
        """The layout after entry ``index`` (-1: before the first)."""
        lay = self._replay(index)[0] if index >= 0 else self.start
        time_us = self.entries[index].get("time_us") if index >= 0 else None
        return Moment(index, time_us, lay.report(self.device), sum(b.inferred for b in lay.blocks.values()))

    def ooms(self) -> list["OomMoment"]:
        """Each ``oom`` entry of the trace with the layout when it was written (the allocator has
        already released its wholly free segments and retried by then)."""
        return [
            OomMoment(int(e.get("size", 0)), int(e.get("device_free", 0)), self.at(i))
            for i, e in enumerate(self.entries)
            if e.get("action") == "oom"
        ]

    def peak(self, since_us: int | None = None) -> Moment | None:
        """The layout at the first moment allocated bytes were highest; None without a trace.
        ``since_us``: only entries stamped at or after it (``time_us``, the trace's clock), when any are."""
        points = self.totals()
        if since_us is not None:
            points = [p for p in points if p.time_us is not None and p.time_us >= since_us] or points
        if not points:
            return None
        top = max(p.allocated_bytes for p in points)
        return self.at(next(p.index for p in points if p.allocated_bytes == top))
