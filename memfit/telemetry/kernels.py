"""``train.kernel_profile_every``: one step in every N run under torch.profiler, and where its time went: the top
kernels by self time (CUDA/HIP kernels on a GPU, CPU ops on a CPU) with their share of the step.

The profiled step's extra wall time over the step before it is its cost; the interval stretches so that the costs
stay under 1% of the training time between profiles (as the fragmentation reading's do), and the record says both.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch.autograd import DeviceType

from memfit.telemetry.allocator_watch import frag_interval

TOP_KERNELS = 10
"""Kernels a profile names (the rest are summed as ``other``): the Prometheus label set stays bounded."""
NAME_CHARS = 120  # a templated CUDA kernel's name runs to hundreds of characters

T = TypeVar("T")


def top_kernels(events, on_gpu: bool, step_s: float, top: int = TOP_KERNELS) -> list[dict[str, Any]]:
    """The ``top`` names by self time among ``events`` (``prof.key_averages()``): device kernels on a GPU, CPU ops
    otherwise; then ``other`` for the rest. Shares are of the profiled step's wall time."""
    if on_gpu:
        rows = [(e.key, e.self_device_time_total, e.count) for e in events if e.device_type == DeviceType.CUDA]
    else:
        rows = [(e.key, e.self_cpu_time_total, e.count) for e in events if e.device_type == DeviceType.CPU]
    rows = sorted((r for r in rows if r[1] > 0), key=lambda r: -r[1])
    out = [
        {"name": name[:NAME_CHARS], "self_time_s": us / 1e6, "share": us / 1e6 / step_s, "calls": int(calls)}
        for name, us, calls in rows[:top]
    ]
    rest = sum(us for _, us, _ in rows[top:])
    if rest:
        out.append({"name": "other", "self_time_s": rest / 1e6, "share": rest / 1e6 / step_s, "calls": 0})
    return out


@dataclass
class KernelProfiler:
    """Profiles one step every ``every`` steps or more (0: never) on ``device``."""

    every: int
    device: torch.device
    next_step: int = 0

    def __post_init__(self) -> None:
        self.next_step = self.every

    def due(self, step: int) -> bool:
        return bool(self.every) and step >= self.next_step

    def profile(self, run: Callable[[], T], step: int, last_step_s: float | None) -> tuple[T, dict[str, Any]]:
        """``run()`` (the step) under torch.profiler; its result and the record's fields: the top kernels, the
        profiled step's wall time, its cost over ``last_step_s`` (the step before, unprofiled) and the interval
        to the next profile."""
        on_gpu = self.device.type == "cuda"
        activities = [torch.profiler.ProfilerActivity.CPU]
        if on_gpu:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        with torch.profiler.profile(activities=activities) as prof:
            out = run()
            if on_gpu:
                torch.cuda.synchronize(self.device)
        wall = time.perf_counter() - start
        top = top_kernels(prof.key_averages(), on_gpu, wall)
        cost = max(0.0, wall - last_step_s) if last_step_s is not None else wall
        every = frag_interval(cost, last_step_s or wall, self.every)
        self.next_step = step + every
        return out, {
            "kernels": top,
            "kernels_of": "device kernels" if on_gpu else "CPU ops",
            "kernel_profile_s": wall,
            "kernel_profile_cost_s": cost,
            "kernel_profile_every": every,
        }
