"""Each rule of the caching-allocator model on hand-built traces; expected values are worked out
here from the rules in c10/cuda/CUDACachingAllocator.cpp (constants cited in the model's docstring)."""

import pytest

from memfit.allocator.model import (
    K_LARGE_BUFFER,
    K_SMALL_BUFFER,
    AllocatorSettings,
    CachingAllocatorModel,
    OutOfMemory,
    allocation_size,
    round_size,
)

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def test_rounding_to_512_and_power2_divisions():
    assert round_size(1) == 512 and round_size(512) == 512 and round_size(513) == 1024
    # 1/4 steps between powers of two: 1.1 MiB -> floor 1 MiB, step 256 KiB -> 1.25 MiB
    assert round_size(int(1.1 * MiB), divisions=4) == 1 * MiB + 256 * KiB
    assert round_size(2 * MiB, divisions=4) == 2 * MiB  # powers of two stay
    assert round_size(1000, divisions=4) == 1024  # step below 512: plain rounding


def test_segment_sizes_by_request():
    assert allocation_size(512) == 2 * MiB  # small pool: kSmallBuffer
    assert allocation_size(1 * MiB) == 2 * MiB
    assert allocation_size(1 * MiB + 512) == 20 * MiB  # large, < kMinLargeAlloc: kLargeBuffer
    assert allocation_size(10 * MiB) == 10 * MiB  # >= 10 MiB: rounded to 2 MiB
    assert allocation_size(11 * MiB) == 12 * MiB


def test_small_and_large_pools_do_not_share():
    m = CachingAllocatorModel(GiB)
    small = m.malloc(4 * KiB)
    large = m.malloc(2 * MiB)
    assert small.segment.pool == "small" and large.segment.pool == "large"
    assert m.reserved == 2 * MiB + 20 * MiB


def test_best_fit_picks_the_smallest_block_that_fits():
    m = CachingAllocatorModel(GiB)
    a, b, c = m.malloc(12 * MiB), m.malloc(16 * MiB), m.malloc(14 * MiB)  # three 2 MiB-rounded segments
    m.free(a), m.free(b), m.free(c)
    got = m.malloc(13 * MiB)
    assert got.segment is c.segment  # 14 MiB is the smallest free block >= 13 MiB


def test_split_rules():
    m = CachingAllocatorModel(GiB)
    blk = m.malloc(3 * MiB)  # 20 MiB segment, rest 17 MiB > 1 MiB: split
    assert blk.size == 3 * MiB and len(blk.segment.blocks) == 2
    m2 = CachingAllocatorModel(GiB)
    whole = m2.malloc(19 * MiB + 512)  # 20 MiB? no: >= 10 MiB -> 20 MiB segment, rest 1 MiB - 512: not > 1 MiB
    assert whole.size == 20 * MiB and len(whole.segment.blocks) == 1
    m3 = CachingAllocatorModel(GiB)
    s = m3.malloc(1000)  # small pool: rest of the 2 MiB segment >= 512: split
    assert s.size == 1024 and len(s.segment.blocks) == 2


def test_free_merges_neighbours():
    m = CachingAllocatorModel(GiB)
    a, b, c = m.malloc(2 * MiB), m.malloc(3 * MiB), m.malloc(4 * MiB)  # all in one 20 MiB segment
    assert a.segment is b.segment is c.segment
    m.free(a)
    m.free(c)  # merges with the free tail
    assert [blk.size for blk in a.segment.blocks] == [2 * MiB, 3 * MiB, 15 * MiB]
    m.free(b)  # merges both sides: one free block
    assert [blk.size for blk in a.segment.blocks] == [20 * MiB]
    assert m.largest_free_block() == 20 * MiB and m.fragmentation_ratio() == 0.0


def test_max_split_size_keeps_oversize_blocks_whole():
    m = CachingAllocatorModel(GiB, AllocatorSettings(max_split_size_mb=64))
    big = m.malloc(100 * MiB)
    m.free(big)
    small = m.malloc(30 * MiB)  # may not take the oversize 100 MiB block: new 30 MiB segment
    assert small.segment is not big.segment and m.reserved == 130 * MiB
    again = m.malloc(90 * MiB)  # oversize request, block 100 MiB < 90 + 20: reused, not split
    assert again.segment is big.segment and again.size == 100 * MiB
    m.free(again)
    m2 = CachingAllocatorModel(GiB, AllocatorSettings(max_split_size_mb=64))
    huge = m2.malloc(200 * MiB)
    m2.free(huge)
    other = m2.malloc(70 * MiB)  # 200 >= 70 + 20: too much larger, new segment
    assert other.segment is not huge.segment


def test_out_of_room_with_max_split_releases_just_enough_oversize_blocks():
    # release_available_cached_blocks: the smallest cached block >= the request, else oversize blocks
    # from the largest down until as much as the request is released; no retry is counted for it
    m = CachingAllocatorModel(400 * MiB, AllocatorSettings(max_split_size_mb=64))
    a, b = m.malloc(100 * MiB), m.malloc(200 * MiB)
    m.free(a), m.free(b)
    c = m.malloc(150 * MiB)  # 200 >= 150 + 20 may not serve it; 300 + 150 > 400: release the 200 only
    assert m.reserved == 250 * MiB and a.segment.sid in m.segments and m.num_alloc_retries == 0
    m = CachingAllocatorModel(300 * MiB, AllocatorSettings(max_split_size_mb=64))
    a, b = m.malloc(100 * MiB), m.malloc(120 * MiB)
    m.free(a), m.free(b)
    c = m.malloc(150 * MiB)  # none >= 150 cached: release 120, then 100 (220 >= 150), then map 150
    assert m.reserved == 150 * MiB and c.size == 150 * MiB and m.num_alloc_retries == 0


def test_empty_cache_returns_wholly_free_segments():
    m = CachingAllocatorModel(GiB)
    a, b = m.malloc(12 * MiB), m.malloc(30 * MiB)
    m.free(a)
    m.empty_cache()
    assert m.reserved == 30 * MiB
    m.free(b)
    m.empty_cache()
    assert m.reserved == 0


def test_retry_frees_cache_before_oom():
    m = CachingAllocatorModel(100 * MiB)
    a = m.malloc(60 * MiB)
    m.free(a)  # cached, not returned
    b = m.malloc(70 * MiB)  # 60 + 70 > 100: free the cache (a retry), then it fits
    assert m.num_alloc_retries == 1 and m.reserved == 70 * MiB and b.size == 70 * MiB
    with pytest.raises(OutOfMemory):
        m.malloc(40 * MiB)  # 70 in use + 40 > 100, nothing cached to free
    assert m.num_ooms == 1 and m.num_alloc_retries == 2


def test_garbage_collection_needs_a_memory_fraction():
    def run(settings):
        m = CachingAllocatorModel(100 * MiB, settings)
        blocks = [m.malloc(12 * MiB) for _ in range(5)]  # five 12 MiB segments = 60 MiB
        for blk in blocks[:4]:
            m.free(blk)
        m.malloc(14 * MiB)  # needs a new segment: 60 + 14
        return m

    no_fraction = run(AllocatorSettings(garbage_collection_threshold=0.5))
    assert no_fraction.reserved == 74 * MiB  # GC inactive without a fraction
    gc = run(AllocatorSettings(garbage_collection_threshold=0.5, memory_fraction=0.8))
    # threshold 0.5 x 80 MiB = 40 MiB < 60 MiB reserved; the four free segments were all freed at the
    # same allocation, so all are as old as the average: one pass frees them all (60 -> 12), then the
    # 14 MiB segment: 26 MiB, no retry
    assert gc.reserved == 26 * MiB and gc.num_alloc_retries == 0


def test_garbage_collection_frees_segments_at_least_as_old_as_the_average():
    m = CachingAllocatorModel(100 * MiB, AllocatorSettings(garbage_collection_threshold=0.7, memory_fraction=0.8))
    a, b, c, d, e = (m.malloc(n * MiB) for n in (12, 12, 12, 14, 12))  # allocations 1-5: 62 MiB reserved
    for blk in (b, c, d):
        m.free(blk)  # freed after allocation 5
    m.free(m.malloc(14 * MiB))  # allocation 6 reuses d's segment: d is younger now
    m.malloc(16 * MiB)  # allocation 7 needs a segment; 62 MiB > 0.7 x 80 = 56 MiB: GC
    # ages b 2, c 2, d 1, average 5/3: b and c go (24 MiB >= the 6 MiB excess), d stays: 38 + 16 MiB
    assert m.reserved == 54 * MiB and m.num_alloc_retries == 0
    assert sorted(s.size for s in m.segments.values()) == [12 * MiB, 12 * MiB, 14 * MiB, 16 * MiB]


def test_expandable_segments_grow_in_pages_and_avoid_holes():
    m = CachingAllocatorModel(GiB, AllocatorSettings(expandable_segments=True))
    a = m.malloc(30 * MiB)
    assert m.reserved == 40 * MiB  # two 20 MiB pages
    b = m.malloc(15 * MiB)  # 10 MiB free at the end + one more page
    assert b.segment is a.segment and m.reserved == 60 * MiB
    m.free(a)
    c = m.malloc(35 * MiB)  # the 30 MiB hole is too small: extend the tail (15 MiB free) by one page
    assert c.segment is a.segment and m.reserved == 80 * MiB
    s = m.malloc(4 * KiB)
    assert s.segment.pool == "small" and m.reserved == 80 * MiB + K_SMALL_BUFFER


def test_expandable_empty_cache_unmaps_free_pages_anywhere_and_maps_the_lowest_free_range():
    # unmap_block: the whole 20 MiB pages inside any free block go back, not only the tail's;
    # find_expandable_block: the lowest-address unmapped range (with the free block before it) that holds
    # the request is mapped again
    m = CachingAllocatorModel(GiB, AllocatorSettings(expandable_segments=True))
    a = m.malloc(30 * MiB)  # pages 0-1 mapped: [a 0-30][free 30-40]
    b = m.malloc(15 * MiB)  # the 10 MiB free tail + one more page: [a][b 30-45][free 45-60]
    assert b.offset == 30 * MiB and m.reserved == 60 * MiB
    m.free(a)  # [free 0-30][b][free 45-60]
    m.empty_cache()  # page 0 (0-20 MiB) lies inside the first free block; 45-60 holds no whole page
    assert m.reserved == 40 * MiB and [blk.mapped for blk in b.segment.blocks][:2] == [False, True]
    c = m.malloc(25 * MiB)  # unmapped 0-20 + free 20-30 hold it: map page 0 again, not a new one at the end
    assert c.offset == 0 and m.reserved == 60 * MiB and m.segment_allocs == 3  # map calls: a, b, c


def test_expandable_best_fit_passes_over_a_block_that_could_grow():
    # get_free_block: among free blocks that fit, one followed by unmapped space counts with that space,
    # so a request goes to an interior hole rather than the growable tail
    m = CachingAllocatorModel(GiB, AllocatorSettings(expandable_segments=True))
    h = m.malloc(12 * MiB)  # [h 0-12][free 12-20]
    k = m.malloc(18 * MiB)  # one more page: [h][k 12-30][free 30-40][unmapped]
    assert k.offset == 12 * MiB and m.reserved == 40 * MiB
    m.free(h)  # free blocks: 0-12 (12 MiB, next to k) and 30-40 (10 MiB, next to unmapped space)
    x = m.malloc(8 * MiB)  # smallest fit is the 10 MiB tail, but it could grow: the 12 MiB hole is taken
    assert x.offset == 0 and m.reserved == 40 * MiB


def test_expandable_segments_split_off_any_rest_of_512_bytes_or_more():
    # should_split: with expandable segments a large block splits like a small one (rest >= 512 B);
    # by default a rest of up to 1 MiB (kSmallSize) stays inside the block
    exp = CachingAllocatorModel(GiB, AllocatorSettings(expandable_segments=True))
    b = exp.malloc(20 * MiB - 512 * KiB)  # one 20 MiB page, 512 KiB left
    assert b.size == 20 * MiB - 512 * KiB and exp.allocated == b.size and exp.reserved == 20 * MiB
    default = CachingAllocatorModel(GiB)
    d = default.malloc(20 * MiB - 512 * KiB)  # a 20 MiB segment (>= 10 MiB: rounded to 2 MiB), not split
    assert d.size == 20 * MiB and default.allocated == 20 * MiB


def test_fragmentation_what_if_on_a_sawtooth_trace():
    """Growing tensors freed in between: the default allocator strands holes, expandable segments do not."""

    def replay(settings):
        m = CachingAllocatorModel(64 * GiB, settings)
        keep = []
        for i in range(1, 40):
            t = m.malloc(i * 3 * MiB + 512)
            keep.append(m.malloc(K_LARGE_BUFFER // 4))
            m.free(t)
        return m

    default, expandable = replay(AllocatorSettings()), replay(AllocatorSettings(expandable_segments=True))
    assert expandable.peak_reserved < default.peak_reserved
    assert default.reserved - default.allocated > expandable.reserved - expandable.allocated
