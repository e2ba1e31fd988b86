"""PNG plots with matplotlib (Agg backend: no display needed)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
from matplotlib.patches import Patch  # noqa: E402

from memfit.allocator.layout import Moment, TimelinePoint  # noqa: E402
from memfit.allocator.snapshot import FragReport  # noqa: E402
from memfit.units import GIB, MIB

COLORS = {"active_allocated": "#3b6fb6", "active_awaiting_free": "#e59b2e", "inactive": "#d9d9d9"}


def segment_map(report: FragReport, path: Path, when: str = "", max_segments: int = 48) -> Path:
    """One row per segment (largest first), blocks drawn to scale: active, awaiting free, free."""
    segs = sorted(report.segments, key=lambda s: s.total_bytes, reverse=True)[:max_segments]
    fig, ax = plt.subplots(figsize=(11, 0.28 * len(segs) + 1.8))
    for row, s in enumerate(segs):
        for offset, size, state in s.blocks:
            ax.barh(
                row,
                size / MIB,
                left=offset / MIB,
                height=0.8,
                color=COLORS.get(state, "#999999"),
                edgecolor="white",
                linewidth=0.3,
            )
    ax.set_yticks(range(len(segs)), [f"{s.segment_type} {s.total_bytes / MIB:.0f} MiB" for s in segs], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("offset in segment (MiB)")
    shown = (
        f"{len(segs)} of {len(report.segments)} segments"
        if len(report.segments) > len(segs)
        else f"{len(segs)} segments"
    )
    ax.set_title(
        f"device {report.device}{' ' + when if when else ''}: reserved {report.reserved_bytes / GIB:.2f} "
        f"GiB, allocated {report.allocated_bytes / GIB:.2f} GiB, "
        f"largest free block {report.largest_free_bytes / MIB:.0f} MiB, fragmentation "
        f"{report.fragmentation_ratio:.2f} ({shown})",
        fontsize=9,
    )
    ax.legend(
        handles=[Patch(color=c, label=s.replace("_", " ")) for s, c in COLORS.items()], loc="lower right", fontsize=8
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def memory_timeline(points: list[TimelinePoint], path: Path, title: str, peak: Moment | None = None) -> Path:
    """Allocated and reserved GiB over the trace (time in s when recorded, else event index), the
    peak marked with its fragmentation."""
    fig, ax = plt.subplots(figsize=(11, 4))
    timed = bool(points) and all(p.time_us is not None for p in points)
    t0 = points[0].time_us if timed else 0
    x = [(p.time_us - t0) / 1e6 for p in points] if timed else [p.index for p in points]
    ax.set_xlabel("time since first trace entry (s)" if timed else "allocator event")
    ax.step(x, [p.reserved_bytes / GIB for p in points], where="post", label="reserved", color="#c0392b")
    ax.step(x, [p.allocated_bytes / GIB for p in points], where="post", label="allocated", color="#3b6fb6")
    ax.fill_between(
        x,
        [p.allocated_bytes / GIB for p in points],
        [p.reserved_bytes / GIB for p in points],
        step="post",
        color="#c0392b",
        alpha=0.15,
        label="reserved − allocated (cached)",
    )
    if peak is not None:
        at = x[peak.index]
        ax.axvline(at, color="#555555", linestyle="--", linewidth=0.8)
        ax.annotate(
            f"peak allocated {peak.report.allocated_bytes / GIB:.2f} GiB\n"
            f"fragmentation {peak.report.fragmentation_ratio:.2f}, largest free "
            f"{peak.report.largest_free_bytes / MIB:.0f} MiB",
            (at, peak.report.allocated_bytes / GIB),
            xytext=(6, -28),
            textcoords="offset points",
            fontsize=8,
        )
    ax.set_ylabel("GiB")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def whatif_timeline(replays, path: Path, title: str, capacity_bytes: int | None = None) -> Path:
    """Reserved GiB over the trace under each allocator setting (what-if replays), allocated under the
    defaults for reference, the capacity if one was set; an OOM ends its line with a cross."""
    fig, ax = plt.subplots(figsize=(13, 4.5))
    for r in replays:
        if not r.series:
            continue
        x = [p.index for p in r.series]
        (line,) = ax.step(
            x, [p.reserved_bytes / GIB for p in r.series], where="post", label=r.settings.label(), linewidth=1.1
        )
        if r.oom:
            ax.plot(x[-1], r.series[-1].reserved_bytes / GIB, "x", color=line.get_color(), markersize=9)
    base = replays[0]
    if base.series:
        ax.step(
            [p.index for p in base.series],
            [p.allocated_bytes / GIB for p in base.series],
            where="post",
            color="#555555",
            linestyle="--",
            linewidth=0.9,
            label="allocated (defaults)",
        )
    if capacity_bytes:
        ax.axhline(capacity_bytes / GIB, color="#c0392b", linewidth=0.8, linestyle=":", label="capacity")
    ax.set_xlabel("trace entry")
    ax.set_ylabel("reserved GiB")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def bench_memory(cells, path: Path, title: str) -> Path:
    """Peak memory per cell, stacked by category where known (model states exact; the rest measured)."""
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(cells) + 2) + 3, 4.8))  # + the legend, right of the axes
    names = [c.name for c in cells]
    for i, c in enumerate(cells):
        if c.status != "ok" or c.peak_bytes is None:
            ax.bar(i, 0.02, color="#c0392b")
            ax.text(i, 0.03, c.status.upper(), ha="center", va="bottom", fontsize=8, color="#c0392b", rotation=90)
            continue
        states = [c.params_bytes or 0, c.grads_bytes or 0, c.optimizer_bytes or 0]
        bottom = 0.0
        for value, color in zip(states, ("#3b6fb6", "#e59b2e", "#7d3c98")):
            ax.bar(i, value / GIB, bottom=bottom, color=color)
            bottom += value / GIB
        ax.bar(i, max(0.0, c.peak_bytes / GIB - bottom), bottom=bottom, color="#95a5a6")
        if c.predicted_peak_bytes:
            ax.plot([i - 0.4, i + 0.4], [c.predicted_peak_bytes / GIB] * 2, color="black", linewidth=1.2)
    ax.set_xticks(range(len(cells)), names, rotation=35, ha="right", fontsize=7)
    ax.set_ylabel("GiB at the step peak")
    ax.set_title(textwrap.fill(title, 70), fontsize=8)
    ax.legend(
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        handles=[
            Patch(color="#3b6fb6", label="parameters"),
            Patch(color="#e59b2e", label="gradients"),
            Patch(color="#7d3c98", label="optimizer state"),
            Patch(color="#95a5a6", label="activations, temporaries (and runtime on CPU)"),
            plt.Line2D([0], [0], color="black", label="planner prediction (tensors)"),
        ],
        fontsize=7,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # rotated cell names and the outside legend stay whole
    plt.close(fig)
    return path


def bench_pareto(cells, path: Path, title: str) -> Path:
    """Tokens/s against peak memory; the Pareto front (no cell faster with less memory) is joined."""
    ok = [c for c in cells if c.status == "ok" and c.peak_bytes and c.tokens_per_s]
    fig, ax = plt.subplots(figsize=(8, 5))
    for c in ok:
        ax.scatter(c.peak_bytes / GIB, c.tokens_per_s, color="#3b6fb6")
        ax.annotate(c.name, (c.peak_bytes / GIB, c.tokens_per_s), fontsize=6, xytext=(3, 3), textcoords="offset points")
    front, best = [], -1.0
    for c in sorted(ok, key=lambda c: (c.peak_bytes, -c.tokens_per_s)):
        if c.tokens_per_s > best:
            front.append(c)
            best = c.tokens_per_s
    if front:
        ax.plot(
            [c.peak_bytes / GIB for c in front], [c.tokens_per_s for c in front], color="#c0392b", label="Pareto front"
        )
        ax.legend(fontsize=8)
    ax.set_xlabel("peak memory (GiB)")
    ax.set_ylabel("tokens/s")
    ax.set_title(textwrap.fill(title, 90), fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # labels of points at the edge stay whole
    plt.close(fig)
    return path
