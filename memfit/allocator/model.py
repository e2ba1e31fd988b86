"""A model of PyTorch's native CUDA/HIP caching allocator that replays alloc/free traces.

Rules and constants follow ``c10/cuda/CUDACachingAllocator.cpp`` (and ``CUDAAllocatorConfig``):

    kMinBlockSize  = 512        every request is rounded up to a multiple of 512 bytes
    kSmallSize     = 1 MiB      requests <= 1 MiB use the small pool
    kSmallBuffer   = 2 MiB      small-pool segments are 2 MiB
    kMinLargeAlloc = 10 MiB     large requests below this get a kLargeBuffer (20 MiB) segment
    kRoundLarge    = 2 MiB      larger requests get a segment rounded up to 2 MiB
    best fit:      the smallest free block of the same pool and stream that is large enough
    split:         small pool, or any pool with expandable segments, if the rest >= 512 B; large pool
                   if the rest > 1 MiB and the request is below max_split_size (``should_split``)
    max_split_size_mb: blocks at or above it are never split; small requests may not take them, and
                   an oversize request may not take one 20 MiB (kLargeBuffer) or more larger than itself
    merge:         a freed block merges with free neighbours in its segment
    roundup_power2_divisions: sizes round up to the next 1/N step between powers of two
    out of memory: a new segment first triggers garbage collection (only with a memory fraction and
                   garbage_collection_threshold: whole free large segments at least as old as the
                   average, pass by pass, while reserved exceeds the threshold), then with max_split_size_mb
                   the release of one cached oversize block big enough, or of oversize blocks from the
                   largest down until enough is freed, then of every wholly free segment
                   (``num_alloc_retries`` += 1), then OOM
    expandable_segments: per pool and stream one segment of virtual address space (the device's size),
                   mapped in pages of 2 MiB (small) or 20 MiB (large). Best fit among mapped free blocks
                   passes over a block whose unmapped neighbour makes it look bigger (``get_free_block``);
                   a request that fits no mapped block takes the lowest-address run of free and
                   unmapped blocks (``find_expandable_block``) and maps the pages it needs
                   (``map_block``); ``empty_cache`` unmaps the whole pages inside every free block
                   (``unmap_block``), wherever it lies; mapped and unmapped blocks never merge

Known limitations: streams only separate pools (no cross-stream free delays); GC ages are counted in
allocations; no virtual-address limit beyond the device's size.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

K_MIN_BLOCK = 512
K_SMALL_SIZE = 1 << 20
K_SMALL_BUFFER = 2 << 20
K_LARGE_BUFFER = 20 << 20
K_MIN_LARGE_ALLOC = 10 << 20
K_ROUND_LARGE = 2 << 20


@dataclass(frozen=True)
class AllocatorSettings:
    max_split_size_mb: int | None = None
    roundup_power2_divisions: int | None = None
    garbage_collection_threshold: float | None = None
    memory_fraction: float | None = None
    expandable_segments: bool = False

    def conf(self) -> str:
        """The ``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_HIP_ALLOC_CONF`` value ("" for the defaults);
        the memory fraction is not part of it (``torch.cuda.set_per_process_memory_fraction``)."""
        parts = []
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        if self.max_split_size_mb is not None:
            parts.append(f"max_split_size_mb:{self.max_split_size_mb}")
        if self.roundup_power2_divisions is not None:
            parts.append(f"roundup_power2_divisions:{self.roundup_power2_divisions}")
        if self.garbage_collection_threshold is not None:
            parts.append(f"garbage_collection_threshold:{self.garbage_collection_threshold}")
        return ",".join(parts)

    def label(self) -> str:
        label = self.conf() or "default"
        if self.memory_fraction is not None:
            label += f" + memory fraction {self.memory_fraction}"
        return label


@dataclass(eq=False)
class Block:
    """A block of a segment, linked to its neighbours in address order (as the allocator's are)."""

    segment: "Segment"
    offset: int
    size: int
    allocated: bool = False
    last_used: int = 0  # allocation counter when last freed (GC age)
    mapped: bool = True  # False: reserved address space of an expandable segment, no memory behind it
    prev: "Block | None" = field(default=None, repr=False)
    next: "Block | None" = field(default=None, repr=False)


@dataclass(eq=False)
class Segment:
    sid: int
    pool: str
    stream: int
    size: int  # mapped bytes
    expandable: bool = False
    head: Block | None = field(default=None, repr=False)  # lowest address; expandable: mapped or not

    @property
    def blocks(self) -> list[Block]:
        """The blocks in address order."""
        out, b = [], self.head
        while b is not None:
            out.append(b)
            b = b.next
        return out

    @property
    def page(self) -> int:
        """Mapping granularity of an expandable segment."""
        return K_SMALL_BUFFER if self.pool == "small" else K_LARGE_BUFFER

    def wholly_free(self) -> bool:
        return all(not b.allocated for b in self.blocks)


def _insert_after(b: Block, new: Block) -> None:
    new.prev, new.next = b, b.next
    if b.next is not None:
        b.next.prev = new
    b.next = new


def _unlink(b: Block) -> None:
    if b.prev is not None:
        b.prev.next = b.next
    else:
        b.segment.head = b.next
    if b.next is not None:
        b.next.prev = b.prev


def _growable(b: Block) -> int:
    """A free block's size counting the unmapped space right after it (``expandable_size``)."""
    return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)


class OutOfMemory(Exception):
    def __init__(self, size: int, reserved: int, capacity: int):
        super().__init__(f"OOM: {size} bytes requested, {reserved} reserved of {capacity}")
        self.size, self.reserved, self.capacity = size, reserved, capacity


def round_size(size: int, divisions: int | None = None) -> int:
    """Request size -> block size (512-byte multiples, or the next 1/N power-of-two step)."""
    if size < K_MIN_BLOCK:
        return K_MIN_BLOCK
    if divisions and divisions > 1 and size > K_MIN_BLOCK:
        floor = 1 << (size.bit_length() - 1)
        if floor == size:
            return size
        step = floor // divisions
        if step > K_MIN_BLOCK:
            return size if size % step == 0 else (size // step + 1) * step
    return (size + K_MIN_BLOCK - 1) // K_MIN_BLOCK * K_MIN_BLOCK


def should_split(rest: int, size: int, small: bool, expandable: bool, max_split: int | None) -> bool:
    """Whether a free block that leaves ``rest`` bytes after a ``size``-byte block is split
    (``should_split`` in CUDACachingAllocator.cpp); unsplit, the whole free block is allocated."""
    if small or expandable:
        return rest >= K_MIN_BLOCK
    return (max_split is None or size < max_split) and rest > K_SMALL_SIZE


def allocation_size(size: int) -> int:
    """Block size -> size of a new segment for it."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return (size + K_ROUND_LARGE - 1) // K_ROUND_LARGE * K_ROUND_LARGE


class CachingAllocatorModel:
    """Replay ``malloc``/``free``/``empty_cache`` against a device of ``capacity`` bytes."""

    def __init__(self, capacity: int, settings: AllocatorSettings = AllocatorSettings()):
        self.capacity, self.s = capacity, settings
        self.max_split = settings.max_split_size_mb * (1 << 20) if settings.max_split_size_mb else None
        self.segments: dict[int, Segment] = {}
        self._free: dict[tuple[str, int], list[tuple[int, int, int, Block]]] = {}
        self._ids = itertools.count()
        self._tick = 0
        self.reserved = self.allocated = self.requested = 0
        self.peak_reserved = self.peak_allocated = 0
        self.num_alloc_retries = self.num_ooms = self.segment_allocs = 0

    # -- free-block index ---------------------------------------------------------------------------

    def _index_add(self, b: Block) -> None:
        """Free blocks per (pool, stream), ordered by (size, segment, offset) as the allocator's set is."""
        lst = self._free.setdefault((b.segment.pool, b.segment.stream), [])
        bisect.insort(lst, (b.size, b.segment.sid, b.offset, b), key=lambda k: k[:3])

    def _index_remove(self, b: Block) -> None:
        lst = self._free[(b.segment.pool, b.segment.stream)]
        i = bisect.bisect_left(lst, (b.size, b.segment.sid, b.offset), key=lambda k: k[:3])
        assert lst[i][3] is b
        del lst[i]

    # -- policy pieces ------------------------------------------------------------------------------

    def _usable(self, block_size: int, size: int) -> bool:
        if self.max_split is None:
            return True
        if size < self.max_split and block_size >= self.max_split:
            return False  # do not hand oversize blocks to small requests
        if size >= self.max_split and block_size >= size + K_LARGE_BUFFER:
            return False  # nor much larger oversize blocks to oversize requests
        return True

    def _best_fit(self, pool: str, stream: int, size: int) -> Block | None:
        """``get_free_block``: the smallest free block that holds ``size``; in expandable segments the
        search moves on while the next block would grow less into unmapped space. None when that block
        is oversize for the request (max_split_size_mb): every larger one is too."""
        lst = self._free.get((pool, stream), [])
        k = bisect.bisect_left(lst, (size, -1, -1), key=lambda e: e[:3])
        if k == len(lst):
            return None
        while lst[k][3].segment.expandable and k + 1 < len(lst) and _growable(lst[k + 1][3]) < _growable(lst[k][3]):
            k += 1
        block = lst[k][3]
        return block if self._usable(block.size, size) else None

    def _limit(self) -> int:
        return int(self.capacity * self.s.memory_fraction) if self.s.memory_fraction else self.capacity

    def _new_segment(self, pool: str, stream: int, size: int) -> Block | None:
        seg_size = allocation_size(size)
        if self.reserved + seg_size > self._limit():
            return None
        seg = Segment(next(self._ids), pool, stream, seg_size)
        block = Block(seg, 0, seg_size)
        seg.head = block
        self.segments[seg.sid] = seg
        self.reserved += seg_size
        self.segment_allocs += 1
        return block

    def _expand(self, pool: str, stream: int, size: int) -> Block | None:
        """``try_allocate_expandable_block``: the lowest-address run of free and unmapped blocks that
        holds ``size`` (a new segment when none does), its unmapped part mapped page by page."""
        segs = [s for s in self.segments.values() if s.expandable and s.pool == pool and s.stream == stream]
        cand = next((c for c in map(lambda s: self._expandable_run(s, size), segs) if c is not None), None)
        if cand is None:
            seg = Segment(next(self._ids), pool, stream, 0, expandable=True)
            seg.head = Block(seg, 0, -(-max(self.capacity, size) // seg.page) * seg.page, mapped=False)
            self.segments[seg.sid] = seg
            cand = seg.head
        if not cand.mapped:
            cand = self._map(cand, min(cand.size, size))
            if cand is None:
                return None
        while cand.size < size:  # free mapped, then unmapped: map what is missing, merging into cand
            nxt = cand.next
            merged = self._map(nxt, min(size - cand.size, nxt.size))
            if merged is None:
                return None
            cand = merged
        self._index_remove(cand)
        return cand

    @staticmethod
    def _expandable_run(seg: Segment, size: int) -> Block | None:
        """``find_expandable_block``: per unmapped block in address order, the run from it (or from the
        free block before it) over free and unmapped blocks; the first that holds ``size``."""
        b = seg.head
        while b is not None:
            if not b.mapped:
                start = b.prev if b.prev is not None and not b.prev.allocated else b
                total, c = 0, start
                while c is not None and total < size and not c.allocated:
                    total, c = total + c.size, c.next
                if total >= size:
                    return start
            b = b.next
        return None

    def _map(self, block: Block, nbytes: int) -> Block | None:
        """``map_block``: map the pages covering the first ``nbytes`` of unmapped ``block``, merge them
        with free mapped neighbours and index the result; None when the device is full."""
        seg = block.segment
        mapped = min(block.size, -(-nbytes // seg.page) * seg.page)
        if self.reserved + mapped > self._limit():
            return None
        if mapped < block.size:
            _insert_after(block, Block(seg, block.offset + mapped, block.size - mapped, mapped=False))
            block.size = mapped
        block.mapped, block.last_used = True, self._tick
        seg.size += mapped
        self.reserved += mapped
        self.segment_allocs += 1
        return self._merge_free(block, index=False)

    def _merge_free(self, block: Block, index: bool = True) -> Block:
        """Merge free ``block`` with free neighbours of the same mapped state; index the result when mapped.
        ``index``: whether ``block`` itself is in the free index."""
        if index and block.mapped:
            self._index_remove(block)
        for other in (block.next, block.prev):  # the next, then the previous neighbour
            if other is not None and not other.allocated and other.mapped == block.mapped:
                if other.mapped:
                    self._index_remove(other)
                lo, hi = (block, other) if other is block.next else (other, block)
                lo.size += hi.size
                lo.last_used = max(lo.last_used, hi.last_used)
                _unlink(hi)
                block = lo
        if block.mapped:
            self._index_add(block)
        return block

    def _unmap_free(self, block: Block) -> None:
        """``unmap_block``: unmap the whole pages inside free mapped ``block``."""
        seg, page = block.segment, block.segment.page
        begin = -(-block.offset // page) * page
        end = (block.offset + block.size) // page * page
        if end <= begin:
            return
        self._index_remove(block)
        pieces = [
            Block(seg, block.offset, begin - block.offset, last_used=block.last_used),
            Block(seg, begin, end - begin, mapped=False),
            Block(seg, end, block.offset + block.size - end, last_used=block.last_used),
        ]
        at = block
        for b in [b for b in pieces if b.size]:
            _insert_after(at, b)
            at = b
            if b.mapped:
                self._index_add(b)
        _unlink(block)
        seg.size -= end - begin
        self.reserved -= end - begin
        self._merge_free(next(b for b in pieces if not b.mapped))

    def _release_segment(self, seg: Segment) -> None:
        for b in seg.blocks:
            self._index_remove(b)
        self.reserved -= seg.size
        del self.segments[seg.sid]

    def _release(self, candidates: list[Segment]) -> int:
        freed = 0
        for seg in candidates:
            freed += seg.size
            self._release_segment(seg)
        return freed

    def _garbage_collect(self) -> None:
        """``garbage_collect_cached_blocks``: once reserved exceeds threshold x allowed memory, release
        the large pool's wholly free segments whose age (allocations since they were freed) is at least
        the average age, a whole pass at a time, until the excess is reclaimed or none is old enough."""
        excess = self.reserved - int(self.s.garbage_collection_threshold * self._limit())
        if excess <= 0:
            return
        freeable = sorted(
            (s for s in self.segments.values() if not s.expandable and s.pool == "large" and s.wholly_free()),
            key=lambda s: (s.size, s.sid),
        )  # the pool's order: size, then address
        age = {s.sid: self._tick - s.head.last_used for s in freeable}
        total_age, reclaimed, freed = sum(age.values()), 0, True
        while reclaimed < excess and freed and freeable:
            threshold, freed = total_age / len(freeable), False
            for seg in list(freeable):  # the whole pass, even past the target
                if age[seg.sid] >= threshold:
                    freed, reclaimed, total_age = True, reclaimed + seg.size, total_age - age[seg.sid]
                    freeable.remove(seg)
                    self._release_segment(seg)

    def _release_oversize(self, pool: str, stream: int, size: int) -> bool:
        """``release_available_cached_blocks``: with max_split_size set, the smallest cached block of the
        pool and stream at least max(size, max_split) large (oversize blocks are whole segments), or
        else oversize blocks from the largest down until that much is released. False when it cannot."""
        if self.max_split is None or self.s.expandable_segments:
            return False
        want = max(size, self.max_split)
        lst = self._free.get((pool, stream), [])
        k = bisect.bisect_left(lst, (want, -1, -1), key=lambda e: e[:3])
        if k < len(lst):
            self._release_segment(lst[k][3].segment)
            return True
        released = 0
        for entry in list(reversed(lst)):
            if released >= want or entry[0] < self.max_split:
                break
            released += entry[0]
            self._release_segment(entry[3].segment)
        return released >= want

    def empty_cache(self) -> None:
        """Return every wholly free segment to the device, and every whole free page of expandable ones."""
        self._release([s for s in self.segments.values() if not s.expandable and s.wholly_free()])
        for seg in [s for s in self.segments.values() if s.expandable]:
            for b in [b for b in seg.blocks if b.mapped and not b.allocated]:
                self._unmap_free(b)
            if seg.size == 0:
                del self.segments[seg.sid]

    # -- the allocator API --------------------------------------------------------------------------

    def malloc(self, requested: int, stream: int = 0) -> Block:
        size = round_size(requested, self.s.roundup_power2_divisions)
        pool = "small" if size <= K_SMALL_SIZE else "large"
        self._tick += 1
        block = self._best_fit(pool, stream, size)
        if block is not None:
            self._index_remove(block)
        else:
            grow = self._expand if self.s.expandable_segments else self._new_segment
            if self.s.memory_fraction and self.s.garbage_collection_threshold:
                self._garbage_collect()
            block = grow(pool, stream, size)
            if block is None and self._release_oversize(pool, stream, size):
                block = grow(pool, stream, size)
            if block is None:
                self.num_alloc_retries += 1
                self.empty_cache()
                block = grow(pool, stream, size)
            if block is None:
                self.num_ooms += 1
                raise OutOfMemory(size, self.reserved, self._limit())
        if should_split(
            block.size - size, size, block.segment.pool == "small", block.segment.expandable, self.max_split
        ):
            seg = block.segment
            rest = Block(seg, block.offset + size, block.size - size, last_used=self._tick)
            _insert_after(block, rest)
            block.size = size
            self._index_add(rest)
        block.allocated = True
        self.allocated += block.size
        self.requested += requested
        block.requested = requested  # type: ignore[attr-defined]
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block

    def free(self, block: Block) -> None:
        block.allocated = False
        block.last_used = self._tick
        self.allocated -= block.size
        self.requested -= getattr(block, "requested", block.size)
        self._merge_free(block, index=False)

    # -- observations -------------------------------------------------------------------------------

    def segment_count(self) -> int:
        """Segments as a snapshot lists them: an expandable one as one per contiguous mapped range."""
        n = 0
        for seg in self.segments.values():
            if not seg.expandable:
                n += 1
                continue
            n += sum(1 for b in seg.blocks if b.mapped and (b.prev is None or not b.prev.mapped))
        return n

    def largest_free_block(self) -> int:
        """The free index is ordered by size: the last entry of each (pool, stream) list."""
        return max((lst[-1][0] for lst in self._free.values() if lst), default=0)

    def fragmentation_ratio(self) -> float:
        external = self.reserved - self.allocated
        return 0.0 if external == 0 else 1.0 - self.largest_free_block() / external
