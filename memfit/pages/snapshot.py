"""The HTML page of a memory snapshot: the timeline with each entry's stack frames, every segment at the dump and at
the peak, the fragmentation numbers, the OOM entries with their verdict and the what-if replay.

Known limitations: a trace longer than ``TIMELINE_POINTS`` entries is drawn from buckets, each shown by the entry
with the most allocated bytes in it (peaks are kept; the hover names the entry shown); stacks keep their innermost
``STACK_DEPTH`` frames; the what-if curves are each replay's highest reserved bytes per bucket of trace entries.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memfit.allocator.layout import Moment, Rebuilt, TimelinePoint
from memfit.allocator.simulation import Simulation
from memfit.allocator.snapshot import FragReport, SegmentStats, quantities
from memfit.allocator.whatif import not_here
from memfit.pages.html import Page, Series, esc, paragraph, table
from memfit.units import GIB, MIB

TIMELINE_POINTS = 40_000
STACK_DEPTH = 12
WHATIF_POINTS = 2_000
STATE_CLASS = {"active_allocated": "a", "active_awaiting_free": "w", "inactive": "f"}
WHATIF_COLORS = ("#1d2330", "#3b6fb6", "#e59b2e", "#7d3c98", "#2e8b57", "#c0392b", "#8c6d31", "#17becf")


def _kept(points: list[TimelinePoint], limit: int) -> list[TimelinePoint]:
    """All points, or per bucket of the trace the one with the most allocated bytes."""
    if len(points) <= limit:
        return points
    size = -(-len(points) // limit)
    return [max(points[i : i + size], key=lambda p: p.allocated_bytes) for i in range(0, len(points), size)]


class _Frames:
    """Interned frame texts and stacks (many entries share them)."""

    def __init__(self) -> None:
        self.frames: list[str] = []
        self.stacks: list[list[int]] = [[]]
        self._frame_ids: dict[str, int] = {}
        self._stack_ids: dict[tuple[int, ...], int] = {(): 0}

    def stack(self, frames: Any) -> int:
        ids = []
        for f in (frames or [])[:STACK_DEPTH]:
            if not isinstance(f, dict):
                continue
            text = f"{f.get('name', '?')} ({f.get('filename', '?')}:{f.get('line', '?')})"
            ids.append(self._frame_ids.setdefault(text, len(self.frames)))
            if ids[-1] == len(self.frames):
                self.frames.append(text)
        key = tuple(ids)
        if key not in self._stack_ids:
            self._stack_ids[key] = len(self.stacks)
            self.stacks.append(ids)
        return self._stack_ids[key]


def _timeline_data(rebuilt: Rebuilt, points: list[TimelinePoint]) -> dict[str, Any]:
    frames = _Frames()
    actions: list[str] = []
    out: dict[str, list] = {k: [] for k in ("entry", "time", "allocated", "reserved", "action", "size", "stream")}
    out["stack"] = []
    allocated_by: dict[int, int] = {}  # address -> stack of the alloc entry that made the block there
    kept = {p.index for p in points}
    for i, e in enumerate(rebuilt.entries):  # a free entry records no frames: it is shown with its alloc's
        if e.get("action") == "alloc" and e.get("frames"):
            allocated_by[int(e.get("addr", 0))] = frames.stack(e.get("frames"))
        elif i in kept and not e.get("frames"):
            allocated_by.setdefault(-1 - i, allocated_by.get(int(e.get("addr", 0)), 0))
    for p in points:
        e = rebuilt.entries[p.index]
        action = str(e.get("action", "?"))
        if action not in actions:
            actions.append(action)
        out["entry"].append(p.index)
        out["time"].append(None if p.time_us is None else p.time_us - (points[0].time_us or 0))
        out["allocated"].append(p.allocated_bytes)
        out["reserved"].append(p.reserved_bytes)
        out["action"].append(actions.index(action))
        out["size"].append(int(e.get("size", 0)))
        out["stream"].append(int(e.get("stream", 0)))
        out["stack"].append(frames.stack(e.get("frames")) if e.get("frames") else allocated_by.get(-1 - p.index, 0))
    return {**out, "actions": actions, "frames": frames.frames, "stacks": frames.stacks}


def block_frames(snap: dict[str, Any], device: int) -> dict[int, str]:
    """Each live block's innermost frames at the dump, by address (where the snapshot recorded them)."""
    out = {}
    for seg in snap["segments"]:
        if seg.get("device", 0) != device:
            continue
        for b in seg.get("blocks", []):
            frames = [f for f in (b.get("frames") or [])[:4] if isinstance(f, dict)]
            if frames:
                out[int(b["address"])] = " < ".join(f"{f.get('name', '?')} ({f.get('filename', '?')})" for f in frames)
    return out


def segment_map(report: FragReport, frames: dict[int, str] | None = None) -> str:
    """Every segment, by address: a full-width bar each, its blocks to scale within it (hover: offset, size,
    state and, at the dump, the block's frames)."""
    rows = []
    for s in sorted(report.segments, key=lambda s: s.address):
        rows.append(_segment_row(s, frames or {}))
    legend = (
        '<div class="legend">one row per segment, blocks to scale within it:<i class="a"></i>allocated'
        '<i class="w"></i>awaiting free (another stream)<i class="f"></i>free (inactive)</div>'
    )
    return legend + f'<div class="segmap scroll">{"".join(rows)}</div>'


def _segment_row(s: SegmentStats, frames: dict[int, str]) -> str:
    label = (
        f"{s.address:#x} {s.segment_type:5} {s.total_bytes / MIB:9.1f} MiB, {len(s.blocks)} blocks, "
        f"largest free {s.largest_free_bytes / MIB:.1f} MiB"
    )
    blocks = []
    for offset, size, state in s.blocks:
        title = f"+{offset:#x}: {size / MIB:.3f} MiB, {state}"
        where = frames.get(s.address + offset)
        if where:
            title += f"\n{where}"
        grow = 100 * size / s.total_bytes if s.total_bytes else 0
        blocks.append(f'<i class="{STATE_CLASS.get(state, "f")}" style="flex:{grow:.3g} 1 0" title="{esc(title)}"></i>')
    head = f'<span class="label">{esc(label)}</span>'
    return f'<div class="seg">{head}<div class="bar">{"".join(blocks)}</div></div>'


def _bucket_max(series, n_entries: int, buckets: int) -> list[int | None]:
    """A replay's reserved bytes as the highest value in each bucket of trace entries, carried forward."""
    size = max(1, -(-n_entries // buckets))
    out: list[int | None] = [None] * (-(-n_entries // size))
    for p in series:
        b = min(p.index // size, len(out) - 1)
        if out[b] is None or p.reserved_bytes > out[b]:
            out[b] = p.reserved_bytes
    last = None
    for i, v in enumerate(out):
        out[i] = last = v if v is not None else last
    return out


def _numbers(report: FragReport, peak: Moment | None) -> str:
    at_peak = quantities(peak.report) if peak is not None else None
    header = ["quantity", "at the dump", *([f"at peak (entry {peak.index})"] if peak else []), "meaning"]
    rows = [
        [name, value, *([at_peak[i][1]] if at_peak else []), meaning]
        for i, (name, value, meaning) in enumerate(quantities(report))
    ]
    return table(header, rows, sortable=False, table_id="numbers")


def _whatif(page: Page, sim: Simulation, n_entries: int) -> str:
    rows = []
    for r in sim.results:
        note = not_here(r.settings, sim.hip, sim.torch_version)
        rows.append(
            [
                r.settings.label(),
                r.peak_reserved_bytes / GIB,
                r.peak_allocated_bytes / GIB,
                r.segment_allocs,
                r.alloc_retries,
                "yes" if r.oom else "no",
                ("not here: " + note if note else "") + ("recommended" if r is sim.best else ""),
            ]
        )
    check = sim.check
    parts = [
        paragraph(
            f"model check ({sim.ran_with.label()} settings, as the snapshot was taken): peak reserved "
            f"{check.model_peak_reserved_bytes / GIB:.3f} GiB in the replay, "
            f"{check.trace_peak_reserved_bytes / GIB:.3f} GiB in the trace ({100 * check.peak_reserved_error:+.1f}%)"
        ),
        table(
            ["settings", "peak reserved GiB", "peak allocated GiB", "segments mapped", "retries", "OOM", "note"],
            rows,
            table_id="whatif",
        ),
        paragraph(
            f"recommendation: {sim.best.settings.label()}"
            if sim.best
            else "recommendation: none; every applicable setting runs out of memory",
            "verdict",
        ),
    ]
    curves = [_bucket_max(r.series, n_entries, WHATIF_POINTS) for r in sim.results]
    width = max((len(c) for c in curves), default=0)
    size = max(1, -(-n_entries // WHATIF_POINTS))
    x = [i * size for i in range(width)]
    series = [
        Series(
            r.settings.label(),
            [None if v is None else v / GIB for v in c],
            WHATIF_COLORS[i % len(WHATIF_COLORS)],
            "step",
        )
        for i, (r, c) in enumerate(zip(sim.results, curves))
    ]
    if sim.capacity_bytes:
        series.append(Series("capacity", [sim.capacity_bytes / GIB] * width, "#b42318", dash=True))
    parts.append(page.chart("whatif-chart", sim.title, x, "trace entry", series, "reserved GiB", height=340))
    return "".join(parts)


def snapshot_page(
    snap: dict[str, Any], device: int, where: str, report: FragReport, rebuilt: Rebuilt, sim: Simulation | None
) -> Page:
    """The page of one device of a snapshot (``where``: the file, as the user named it)."""
    points = rebuilt.totals()
    peak = rebuilt.peak()
    kept = _kept(points, TIMELINE_POINTS)
    page = Page(
        f"memory snapshot: {Path(where).name}, device {device}",
        "snapshot",
        f"{len(rebuilt.entries)} trace entries, {len(report.segments)} segments at the dump, reserved "
        f"{report.reserved_bytes / GIB:.3f} GiB, fragmentation ratio {report.fragmentation_ratio:.3f}",
    )
    page.section("requested, allocated, reserved", _numbers(report, peak), section_id="numbers-section")
    if kept:
        page.data["snapshot"] = _timeline_data(rebuilt, kept)
        series = [Series("allocated GiB", [], "#3b6fb6"), Series("reserved GiB", [], "#c0392b")]
        shown = (
            f"{len(kept)} of {len(points)} entries shown (the most allocated in each bucket)"
            if len(kept) < len(points)
            else f"all {len(points)} entries"
        )
        page.section(
            "timeline",
            paragraph(
                f"drag to zoom, double-click to reset; hover for the entry and its stack frames ({shown})", "note"
            ),
            page.chart(  # x and values are filled from data.snapshot by memfit.js: the page holds them once
                "timeline",
                "allocated and reserved after each trace entry",
                [],
                "trace entry",
                series,
                "GiB",
                hover="snapshot",
                height=360,
            ),
            section_id="timeline-section",
        )
    else:
        page.section(
            "timeline",
            paragraph(
                "the snapshot has no trace for this device (record one with torch.cuda.memory._record_memory_history)",
                "note",
            ),
        )
    ooms = rebuilt.ooms()
    page.section(
        "out of memory",
        *(
            [paragraph(f"{o.cause}: {o.explain()}", "verdict bad") for o in ooms]
            or [paragraph("no OOM entry in the trace", "good")]
        ),
        section_id="ooms",
    )
    frames = block_frames(snap, device)
    page.section(f"segments at the dump ({len(report.segments)})", segment_map(report, frames), section_id="seg-dump")
    if peak is not None:
        page.section(
            f"segments at peak allocated, trace entry {peak.index} ({len(peak.report.segments)})",
            segment_map(peak.report)
            + (
                paragraph(
                    f"{peak.inferred_blocks} live blocks were freed before the dump: their sizes follow from the "
                    "allocator's rounding and split rules",
                    "note",
                )
                if peak.inferred_blocks
                else ""
            ),
            section_id="seg-peak",
        )
    if sim is not None:
        page.section(
            "what-if: other allocator settings", _whatif(page, sim, len(rebuilt.entries)), section_id="whatif-section"
        )
    return page
