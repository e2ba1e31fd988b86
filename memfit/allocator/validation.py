"""The allocator model held against a real allocator: a recorded snapshot's trace replayed and its layout
rebuilt, beside what the allocator reported at the same moments. ``benchmarks/gpu_check.py`` runs these on a
GPU; the tests run them on snapshots in PyTorch's format made by the model itself."""

from __future__ import annotations

from typing import Any

from memfit.allocator.layout import Rebuilt
from memfit.allocator.whatif import replay_check
from memfit.units import GIB


def replay_row(label: str, settings, snap: dict, steps: list[dict]) -> dict:
    """One setting's numbers: the model's replay of the snapshot's trace and the layout rebuilt from
    it, beside what the allocator reported in the step records."""
    rebuilt = Rebuilt(snap, 0)
    check = replay_check(snap, 0, settings, rebuilt)
    peak = rebuilt.peak()
    measured_peak = max(r["peak_reserved_bytes"] for r in steps)
    return {
        "settings": label,
        "status": "ok",
        "events": check.events,
        "unmatched_frees": check.unmatched_frees,
        "measured_peak_reserved_bytes": measured_peak,
        "model_peak_reserved_bytes": check.model_peak_reserved_bytes,
        "peak_reserved_error_pct": 100 * (check.model_peak_reserved_bytes - measured_peak) / measured_peak,
        "trace_peak_reserved_bytes": check.trace_peak_reserved_bytes,
        "peak_reserved_error_vs_trace_pct": 100 * check.peak_reserved_error,
        "snapshot_reserved_bytes": check.snapshot_reserved_bytes,
        "model_reserved_bytes": check.model_reserved_bytes,
        "snapshot_segments": check.snapshot_segments,
        "model_segments": check.model_segments,
        "measured_peak_allocated_bytes": max(r["peak_allocated_bytes"] for r in steps),
        "model_peak_allocated_bytes": check.model_peak_allocated_bytes,
        "frag_time_s": [r.get("frag_time_s") for r in steps],
        "step_time_s": [r["step_time_s"] for r in steps],
        "layout_blocks_checked": rebuilt.size_rule_checked,
        "layout_size_misses": rebuilt.size_rule_misses,
        "layout_settings": rebuilt.settings.label(),
        "fragmentation_at_peak": peak.report.fragmentation_ratio if peak else None,
        "allocated_at_peak_bytes": peak.report.allocated_bytes if peak else None,
        "fragmentation_at_step3_peak": steps[-1].get("fragmentation_at_peak"),
    }


LAYOUT_FIELDS = (
    "reserved_bytes",
    "allocated_bytes",
    "requested_bytes",
    "external_free_bytes",
    "largest_free_bytes",
    "segments",
)


def compare_moments(snap: dict, truths: list[dict]) -> dict:
    """The layout rebuilt from ``snap``'s trace at its first ``snapshot`` entries, field by field beside
    ``truths`` (reports the allocator gave at those moments, in order; only the fields they hold)."""
    rebuilt = Rebuilt(snap, 0)
    marks = [i for i, e in enumerate(rebuilt.entries) if e.get("action") == "snapshot"][: len(truths)]
    moments = []
    for index, truth in zip(marks, truths):
        got = rebuilt.at(index).report.as_dict()
        fields = {k: (got[k], truth[k]) for k in LAYOUT_FIELDS if k in truth}
        moments.append({"trace_entry": index, "fields": fields, "exact": all(a == b for a, b in fields.values())})
    return {
        "status": "ok" if len(moments) == len(truths) else f"found {len(marks)} of {len(truths)} snapshot entries",
        "moments": moments,
        "blocks_checked": rebuilt.size_rule_checked,
        "size_misses": rebuilt.size_rule_misses,
        "events": len(rebuilt.entries),
    }


def replay_line(r: dict[str, Any]) -> str:
    """One ``replay_row`` as a line of the GPU check's summary."""
    return (
        f"- {r['settings']}: peak reserved measured {r['measured_peak_reserved_bytes'] / GIB:.3f} GiB, "
        f"model {r['model_peak_reserved_bytes'] / GIB:.3f} GiB ({r['peak_reserved_error_pct']:+.2f}%; "
        f"{r['peak_reserved_error_vs_trace_pct']:+.2f}% vs the whole trace's "
        f"{r['trace_peak_reserved_bytes'] / GIB:.3f} GiB); "
        f"at the dump {r['snapshot_reserved_bytes'] / GIB:.3f} vs {r['model_reserved_bytes'] / GIB:.3f} GiB, "
        f"segments {r['snapshot_segments']} vs {r['model_segments']}; {r['events']} events, "
        f"{r['unmatched_frees']} unmatched frees; layout rebuilt from the trace: block sizes "
        f"{r['layout_blocks_checked'] - r['layout_size_misses']}/{r['layout_blocks_checked']} right, "
        f"fragmentation at the peak {r['fragmentation_at_peak']}"
    )


def layout_line(r: dict[str, Any]) -> str:
    """One ``compare_moments`` row (with its ``settings`` label) as a line of the GPU check's summary."""
    exact = sum(m["exact"] for m in r["moments"])
    worst = max((abs(a - b) for m in r["moments"] for a, b in m["fields"].values()), default=0)
    return (
        f"- layout, {r['settings']}: rebuilt = memory_snapshot() at {exact} of {len(r['moments'])} moments "
        f"(largest difference {worst} bytes); block sizes {r['blocks_checked'] - r['size_misses']}/"
        f"{r['blocks_checked']} right; {r['events']} events"
    )
