"""A snapshot's trace replayed under every allocator scenario, beside the model's check against the trace.

This is the computation behind ``memfit frag --simulate`` and the what-if part of a snapshot's HTML page; the
commands render it (tables, PNG, HTML) and never recompute it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from memfit.allocator.layout import Rebuilt, settings_in
from memfit.allocator.model import AllocatorSettings
from memfit.allocator.snapshot import FragReport
from memfit.allocator.whatif import Replay, TraceCheck, compare, live_at_start, not_here, replay_check, trace_entries
from memfit.units import GIB


@dataclass(frozen=True)
class Simulation:
    """The trace replayed under every scenario, and the model beside the allocator."""

    results: list[Replay]
    best: Replay | None
    hip: str | None
    capacity_bytes: int | None
    ran_with: AllocatorSettings
    check: TraceCheck
    prefix_blocks: int = 0  # blocks alive when recording began, allocated first by every replay
    prefix_bytes: int = 0
    torch_version: str | None = None  # the build judged (--torch-version, default this one)

    @property
    def title(self) -> str:
        return f"what-if replay of {self.results[0].events} trace events" + (
            f" at capacity {self.capacity_bytes / GIB:.1f} GiB" if self.capacity_bytes else " (no capacity limit)"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "capacity_bytes": self.capacity_bytes,
            "settings": [
                {
                    "label": r.settings.label(),
                    "alloc_conf": r.settings.conf(),
                    "memory_fraction": r.settings.memory_fraction,
                    "peak_reserved_bytes": r.peak_reserved_bytes,
                    "peak_allocated_bytes": r.peak_allocated_bytes,
                    "segment_allocs": r.segment_allocs,
                    "alloc_retries": r.alloc_retries,
                    "oom": r.oom,
                    "not_here": not_here(r.settings, self.hip, self.torch_version),
                }
                for r in self.results
            ],
            "recommended": self.best.settings.label() if self.best else None,
            "model_check": {"settings": self.ran_with.label(), **asdict(self.check)},
            "live_at_start": {"blocks": self.prefix_blocks, "requested_bytes": self.prefix_bytes},
        }


def simulate(
    snap: dict[str, Any],
    report: FragReport,
    rebuilt: Rebuilt,
    where: str,
    capacity_bytes: int | None,
    hip: str | None,
    torch_version: str | None,
) -> Simulation:
    """Replay the snapshot's trace on ``report.device`` under every scenario (``whatif.SCENARIOS``), judged for
    the ROCm version ``hip`` (None: CUDA) and ``torch_version``, with ``capacity_bytes`` of device memory (None:
    unlimited).

    Raises:
        UserError: the snapshot has no trace for the device (``where`` names the file).
    """
    entries = trace_entries(snap, report.device, where)
    prefix = live_at_start(rebuilt)
    results, best = compare(entries, capacity_bytes or 1 << 62, hip, prefix, torch_version)
    ran_with = settings_in(snap)
    return Simulation(
        results,
        best,
        hip,
        capacity_bytes,
        ran_with,
        replay_check(snap, report.device, ran_with, rebuilt),
        len(prefix),
        sum(requested for _, (requested, _) in prefix),
        torch_version,
    )
