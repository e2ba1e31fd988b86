"""The layout rebuilt from a snapshot's trace, checked against hand-worked cases and against the
allocator model's own state after every event of random workloads (written out as PyTorch writes
snapshots: requested sizes in the trace, block sizes only in the final segments)."""

import random

import pytest
from support.snapshots import BASE, MIB, entry, fragmented, model_workload, segment, snapshot

from memfit.allocator.layout import Rebuilt, settings_in
from memfit.allocator.model import AllocatorSettings
from memfit.allocator.snapshot import analyze


def test_an_unsplit_rest_stays_in_the_block_and_the_peak_is_where_allocated_was_highest():
    # a 20 MiB segment; 19.5 MiB asked: the 0.5 MiB rest is <= 1 MiB (kSmallSize), not split, so the
    # block is the whole 20 MiB. Freed, then 12 MiB asked: the 8 MiB rest is split off.
    trace = [
        entry("segment_alloc", BASE, 20 * MIB, 0),
        entry("alloc", BASE, 20 * MIB - MIB // 2, 1),
        entry("free_requested", BASE, 20 * MIB - MIB // 2, 2),
        entry("free_completed", BASE, 20 * MIB - MIB // 2, 3),
        entry("alloc", BASE, 12 * MIB, 4),
    ]
    snap = snapshot([segment(BASE, [(12 * MIB, "active_allocated", None), (8 * MIB, "inactive", 0)])], [trace])
    r = Rebuilt(snap)
    assert [p.allocated_bytes for p in r.totals()] == [0, 20 * MIB, 20 * MIB, 0, 12 * MIB]
    assert all(p.reserved_bytes == 20 * MIB for p in r.totals())
    peak = r.peak()
    assert peak.index == 1 and peak.time_us == 1 and peak.inferred_blocks == 1
    assert peak.report.allocated_bytes == 20 * MIB and peak.report.requested_bytes == 20 * MIB - MIB // 2
    assert peak.report.external_free_bytes == 0 and peak.report.fragmentation_ratio == 0.0
    assert r.size_rule_checked == 1 and r.size_rule_misses == 0  # the 12 MiB block, also in the snapshot
    assert r.at(len(trace) - 1).report.as_dict() == analyze(snap).as_dict()
    start = r.at(-1).report
    assert start.reserved_bytes == 0 and start.allocated_bytes == 0


def test_a_trace_that_starts_late_keeps_what_was_there_before():
    snap = fragmented()  # segments b and c and the 20 MiB block of a predate the trace
    r = Rebuilt(snap)
    end = analyze(snap)
    points = r.totals()
    assert points[-1].allocated_bytes == end.allocated_bytes and points[-1].reserved_bytes == end.reserved_bytes
    assert points[2].allocated_bytes - points[0].allocated_bytes == 52 * MIB  # +40 MiB, +12 MiB
    assert points[4].allocated_bytes == points[1].allocated_bytes
    peak = r.peak()
    # at the peak the 12 MiB hole of segment a is taken: the largest hole is its 8 MiB tail
    assert peak.index == 2 and peak.report.largest_free_bytes == 8 * MIB
    assert peak.report.external_free_bytes == end.external_free_bytes - 12 * MIB
    assert peak.report.fragmentation_ratio == pytest.approx(1 - 8 * MIB / (end.external_free_bytes - 12 * MIB))
    r_ = peak.report
    assert r_.requested_bytes + r_.internal_free_bytes + r_.external_free_bytes == r_.reserved_bytes


def test_settings_come_from_the_snapshot():
    snap = snapshot([])
    assert settings_in(snap) == AllocatorSettings()
    snap["allocator_settings"] = {
        "max_split_size": 256 * MIB,
        "expandable_segments": True,
        "roundup_power2_divisions": {"1": 4, "2": 4, "4": 0},
    }
    assert settings_in(snap) == AllocatorSettings(
        max_split_size_mb=256, roundup_power2_divisions=4, expandable_segments=True
    )
    snap["allocator_settings"] = {"max_split_size": (1 << 64) - 1, "roundup_power2_divisions": {"1": 2, "2": 8}}
    assert settings_in(snap) == AllocatorSettings()


@pytest.mark.parametrize(
    "settings",
    [
        AllocatorSettings(),
        AllocatorSettings(expandable_segments=True),
        AllocatorSettings(max_split_size_mb=64),
        AllocatorSettings(roundup_power2_divisions=4),
    ],
    ids=lambda s: s.label(),
)
def test_rebuilt_layout_matches_the_allocator_model_after_every_event(settings):
    snap, truth = model_workload(settings, seed=7)
    r = Rebuilt(snap, settings=settings)
    assert [(p.allocated_bytes, p.reserved_bytes) for p in r.totals()] == [t[:2] for t in truth]
    assert r.size_rule_checked > 20 and r.size_rule_misses == 0
    rng = random.Random(1)
    events = [i for i, t in enumerate(truth) if t[2] is not None]
    for i in sorted(rng.sample(events, 12)) + [r.peak().index]:
        report = r.at(i).report
        assert (
            report.allocated_bytes,
            report.reserved_bytes,
            report.external_free_bytes,
            report.largest_free_bytes,
        ) == truth[i], f"entry {i}"
    assert r.at(len(truth) - 1).report.as_dict() == analyze(snap).as_dict()


def test_the_peak_of_a_window_of_the_trace():
    # a whole-run trace: the step to inspect starts at time_us 3, after a higher peak at entry 1
    trace = [
        entry("segment_alloc", BASE, 20 * MIB, 0),
        entry("alloc", BASE, 12 * MIB, 1),
        entry("free_completed", BASE, 12 * MIB, 2),
        entry("alloc", BASE, 4 * MIB, 3),
        entry("free_completed", BASE, 4 * MIB, 4),
    ]
    r = Rebuilt(snapshot([segment(BASE, [(20 * MIB, "inactive", 0)])], [trace]))
    assert r.peak().index == 1 and r.peak(since_us=3).index == 3
    assert r.peak(since_us=99).index == 1  # no entry that late: the whole trace
