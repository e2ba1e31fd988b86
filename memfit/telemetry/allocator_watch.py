"""What the trainer reads from the CUDA/HIP caching allocator during a run: fragmentation every few
steps, a snapshot with the allocator trace of a chosen step (and the fragmentation at that step's
peak, rebuilt from the trace), and a snapshot on out-of-memory. Nothing here runs on CPU."""

from __future__ import annotations

import math
import pickle
import time
from pathlib import Path
from typing import Any

import torch

from memfit.allocator.layout import Rebuilt
from memfit.allocator.snapshot import analyze
from memfit.units import MIB

FRAG_OVERHEAD = 0.01  # the most of the training time that reading fragmentation may take
HISTORY_ENTRIES = 1_000_000  # allocator trace ring buffer (entries, a few hundred bytes each)


def frag_interval(cost_s: float, step_time_s: float, every: int) -> int:
    """Steps until the next fragmentation reading: ``train.frag_every``, or more when one reading
    (``cost_s``, a snapshot of every segment) would exceed FRAG_OVERHEAD of the steps between."""
    return max(every, math.ceil(cost_s / (FRAG_OVERHEAD * max(step_time_s, 1e-9))))


def current_segments() -> list[dict[str, Any]]:
    """The allocator's segments now, without its recorded trace where this torch can leave it out
    (``include_traces=False``, added to ``torch.cuda.memory_snapshot`` in early 2026): with a whole-run
    trace of 89k entries recorded, a full snapshot took 1.9-2.1 s on an H200 against 8 ms without one."""
    try:
        return torch.cuda.memory_snapshot(include_traces=False)
    except TypeError:  # an older torch: no such argument
        return torch.cuda.memory_snapshot()


def snapshot_name(stem: str, rank: int, world_size: int) -> str:
    """File name of a snapshot pickle; one per rank when there are several."""
    return f"{stem}_rank{rank}.pickle" if world_size > 1 else f"{stem}.pickle"


class AllocatorWatch:
    """The trainer's allocator readings on one CUDA/ROCm device (a no-op on any other).

    Args:
        device: the run device.
        run_root: the run directory, where snapshots go.
        rank, world_size: this process in the job (snapshot names).
        frag_every: ``train.frag_every`` (0: never read fragmentation).
        record_history: ``train.record_memory_history``: record the allocator trace from the start.
        snapshot_at_step: ``train.snapshot_at_step``: dump a snapshot after this step, with the step's
            trace (recorded for that step alone unless the whole run is recorded).
    """

    def __init__(
        self,
        device: torch.device,
        run_root: Path,
        rank: int,
        world_size: int,
        frag_every: int,
        record_history: bool,
        snapshot_at_step: int | None,
    ):
        self.on = device.type == "cuda"
        self.index = device.index or 0
        self.root, self.rank, self.world_size = run_root, rank, world_size
        self.frag_every, self.record_history, self.snapshot_at_step = frag_every, record_history, snapshot_at_step
        self._next_frag = frag_every
        self._step_start_us: int | None = None

    def start(self) -> None:
        """Before the weights arrive: a whole-run trace starts here."""
        if self.on and self.record_history:
            torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES)

    def before_step(self, step: int) -> None:
        if self.on and step == self.snapshot_at_step:
            self._step_start_us = time.time_ns() // 1000  # the trace's time_us is Unix time in microseconds
            if not self.record_history:
                torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES, stacks="python")

    def _dump(self, stem: str) -> tuple[dict[str, Any], Path]:
        """The allocator's snapshot, also written to the run directory (one file per rank)."""
        snap = torch.cuda.memory._snapshot()
        path = self.root / snapshot_name(stem, self.rank, self.world_size)
        with open(path, "wb") as fh:
            pickle.dump(snap, fh)
        return snap, path

    def after_step(self, step: int, rec: dict[str, Any]) -> None:
        """Fragmentation into the step record every ``frag_every`` steps or more (with what the reading
        cost), and at ``snapshot_at_step`` the snapshot plus the fragmentation at the step's peak."""
        if not self.on:
            return
        if self.frag_every and step >= self._next_frag:
            start = time.perf_counter()
            report = analyze({"segments": current_segments()}, self.index)
            cost_s = time.perf_counter() - start
            every = frag_interval(cost_s, rec["step_time_s"], self.frag_every)
            self._next_frag = step + every
            rec.update(
                fragmentation_ratio=report.fragmentation_ratio,
                largest_free_block_bytes=report.largest_free_bytes,
                frag_time_s=cost_s,
                frag_every=every,
            )
        if step == self.snapshot_at_step:
            snap, path = self._dump(f"snapshot_step{step}")
            if not self.record_history:
                torch.cuda.memory._record_memory_history(enabled=None)
            peak = Rebuilt(snap, self.index).peak(since_us=self._step_start_us)  # this step's, in a whole-run trace
            rec["snapshot"] = str(path)
            if peak is not None:
                rec.update(
                    fragmentation_at_peak=peak.report.fragmentation_ratio,
                    largest_free_at_peak_bytes=peak.report.largest_free_bytes,
                    reserved_at_peak_bytes=peak.report.reserved_bytes,
                    allocated_at_peak_bytes=peak.report.allocated_bytes,
                )

    def recorded(self) -> dict[str, Any] | None:
        """The allocator's snapshot with this run's whole trace so far (``train.record_memory_history``), for the
        what-if replay a restart takes its allocator settings from; None where the run records no whole trace."""
        return torch.cuda.memory._snapshot() if self.on and self.record_history else None

    def oom_snapshot(self, step: int) -> tuple[Path | None, str]:
        """The allocator's state after an out-of-memory error (None off a GPU), and, when the trace was
        being recorded, what the layout at the failed request says caused it ("" otherwise)."""
        if not self.on:
            return None, ""
        snap, path = self._dump(f"oom_step{step}_snapshot")
        ooms = Rebuilt(snap, self.index).ooms()
        if not ooms:
            return path, ""
        o, r = ooms[-1], ooms[-1].moment.report
        return path, (
            f"{o.cause} at the failed request: {r.external_free_bytes / MIB:.0f} MiB free in the cache, "
            f"the largest block {r.largest_free_bytes / MIB:.0f} MiB"
        )
