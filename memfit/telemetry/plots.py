"""PNG plots with matplotlib (Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
from matplotlib.patches import Patch  # noqa: E402

from memfit.memory.snapshot import FragReport, TimelinePoint  # noqa: E402

MIB = 1 << 20
GIB = 1 << 30
COLORS = {"active_allocated": "#3b6fb6", "active_awaiting_free": "#e59b2e", "inactive": "#d9d9d9"}


def segment_map(report: FragReport, path: Path, max_segments: int = 48) -> Path:
    """One row per segment (largest first), blocks drawn to scale: active, awaiting free, free."""
    segs = sorted(report.segments, key=lambda s: s.total_bytes, reverse=True)[:max_segments]
    fig, ax = plt.subplots(figsize=(11, 0.28 * len(segs) + 1.8))
    for row, s in enumerate(segs):
        for offset, size, state in s.blocks:
            ax.barh(row, size / MIB, left=offset / MIB, height=0.8, color=COLORS.get(state, "#999999"),
                    edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(segs)), [f"{s.segment_type} {s.total_bytes / MIB:.0f} MiB" for s in segs], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("offset in segment (MiB)")
    shown = f"{len(segs)} of {len(report.segments)} segments" if len(report.segments) > len(segs) else f"{len(segs)} segments"
    ax.set_title(
        f"device {report.device}: reserved {report.reserved_bytes / GIB:.2f} GiB, allocated {report.allocated_bytes / GIB:.2f} GiB, "
        f"largest free block {report.largest_free_bytes / MIB:.0f} MiB, fragmentation {report.fragmentation_ratio:.2f} ({shown})",
        fontsize=9,
    )
    ax.legend(handles=[Patch(color=c, label=s.replace("_", " ")) for s, c in COLORS.items()], loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def memory_timeline(points: list[TimelinePoint], path: Path, title: str) -> Path:
    """Allocated and reserved GiB over the trace (time in s when recorded, else event index)."""
    fig, ax = plt.subplots(figsize=(11, 4))
    if points and all(p.time_us is not None for p in points):
        t0 = points[0].time_us
        x = [(p.time_us - t0) / 1e6 for p in points]
        ax.set_xlabel("time since first trace entry (s)")
    else:
        x = [p.index for p in points]
        ax.set_xlabel("allocator event")
    ax.step(x, [p.reserved_bytes / GIB for p in points], where="post", label="reserved", color="#c0392b")
    ax.step(x, [p.allocated_bytes / GIB for p in points], where="post", label="allocated", color="#3b6fb6")
    ax.fill_between(x, [p.allocated_bytes / GIB for p in points], [p.reserved_bytes / GIB for p in points],
                    step="post", color="#c0392b", alpha=0.15, label="reserved − allocated (cached)")
    ax.set_ylabel("GiB")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
