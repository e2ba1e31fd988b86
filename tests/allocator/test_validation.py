"""The allocator model against what an allocator reported: the layout rebuilt at recorded moments and a
snapshot's trace replayed, with the summary lines the GPU check prints (``memfit.allocator.validation``)."""

from support.snapshots import model_workload

from memfit.allocator.model import AllocatorSettings
from memfit.allocator.validation import compare_moments, layout_line, replay_line, replay_row


def test_layout_comparison_and_its_summary_line_from_a_snapshot():
    """The GPU layout part's comparison, fed the allocator model's workload with 'snapshot' entries
    where memory_snapshot() would have been called and the model's own numbers as the ground truth."""
    snap, truth = model_workload(AllocatorSettings(expandable_segments=True), seed=2)
    trace = snap["device_traces"][0]
    picks = [i for i, t in enumerate(truth) if t[2] is not None][100::150][:3]
    truths = [
        dict(zip(("allocated_bytes", "reserved_bytes", "external_free_bytes", "largest_free_bytes"), truth[i]))
        for i in picks
    ]
    for n, i in enumerate(picks):  # after entry i (shifted by the marks already inserted)
        trace.insert(i + 1 + n, {"action": "snapshot", "addr": 0, "size": 0, "stream": 0})
    result = compare_moments(snap, truths)
    assert result["status"] == "ok" and [m["exact"] for m in result["moments"]] == [True, True, True]
    assert result["size_misses"] == 0 and result["blocks_checked"] > 0
    truths[1]["largest_free_bytes"] += 512
    off = compare_moments(snap, truths)
    assert [m["exact"] for m in off["moments"]] == [True, False, True]
    md = layout_line({"settings": "expandable_segments", **off})
    assert "rebuilt = memory_snapshot() at 2 of 3 moments (largest difference 512 bytes)" in md


def test_replay_row_and_its_summary_line_from_a_snapshot():
    """The GPU replay part's arithmetic and its summary line, fed a snapshot in PyTorch's format (the
    allocator model's own workload) and step records as the trainer writes them."""
    snap, truth = model_workload(AllocatorSettings(), seed=5)
    peak_reserved, peak_allocated = max(t[1] for t in truth), max(t[0] for t in truth)
    steps = [
        {
            "peak_reserved_bytes": peak_reserved,
            "peak_allocated_bytes": peak_allocated,
            "step_time_s": 1.0,
            "frag_time_s": 0.004,
            "fragmentation_at_peak": 0.5,
        }
    ]
    row = replay_row("default", AllocatorSettings(), snap, steps)
    assert row["peak_reserved_error_pct"] == 0 and row["model_segments"] == row["snapshot_segments"]
    assert row["layout_blocks_checked"] > 0 and row["layout_size_misses"] == 0
    assert row["allocated_at_peak_bytes"] == peak_allocated and 0 <= row["fragmentation_at_peak"] <= 1
    md = replay_line(row)
    assert (
        "(+0.00%; +0.00% vs the whole trace" in md
        and f"block sizes {row['layout_blocks_checked']}/{row['layout_blocks_checked']} right" in md
    )
