"""The run summary as data: computed from the step and eval records, written to ``metrics.jsonl`` as the
``summary`` record, and rendered separately (``display.summary_tables``).

Every byte count is an ``int``; a field that does not apply to the run (GPU-only readings on a CPU run,
the per-rank fields of a one-process run) is ``None`` and left out of the record.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from memfit.telemetry.readings import StateBytes


@dataclass(frozen=True)
class RunSummary:
    """What a run did and where its memory went (this rank's model states; the worst rank's peaks)."""

    device_label: str
    steps: int
    median_step_time_s: float | None
    median_tokens_per_s: float | None
    first_eval_loss: float | None
    last_eval_loss: float | None
    states: StateBytes
    # fragmentation (GPU): the highest end-of-step reading and the reading at the inspected step's peak
    max_fragmentation_ratio: float | None = None
    max_fragmentation_step: int | None = None
    readings: int = 0
    fragmentation_at_peak: float | None = None
    fragmentation_at_peak_step: int | None = None
    # GPU: the caching allocator's counters
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    alloc_retries: int | None = None
    # CPU: resident set size
    peak_rss_bytes: int | None = None
    baseline_rss_bytes: int | None = None
    # predictions beside measurements
    predicted_peak_bytes: int | None = None
    predicted_step_time_s: float | None = None  # the planner's cost model for this device (median measured beside)
    host_state_bytes: int | None = None  # a GPU run's model states in host memory (offloaded), measured
    predicted_host_bytes: int | None = None  # the planner's host peak for this rank
    modelled_peak_reserved_bytes: int | None = None
    profiled_peak_bytes: int | None = None
    profiled_step: int | None = None
    profiled_with: str | None = None
    profiled_ranks: int | None = None
    # several ranks
    rank_peak_key: str | None = None  # peak_allocated_bytes (GPU) or peak_rss_bytes (CPU)
    rank_peak_bytes: list[int] | None = None
    world_size: int | None = None
    engine: str | None = None
    zero_stage: int | None = None
    rank_states: list[dict[str, int]] | None = field(default=None)
    # train.kernel_profile_every: the last profile's top kernels, and what all profiles cost
    kernels: list[dict[str, Any]] | None = None
    kernels_step: int | None = None
    kernels_of: str | None = None
    kernel_profiles: int = 0
    kernel_profile_cost_s: float | None = None
    training_s: float | None = None

    def record(self) -> dict[str, Any]:
        """The ``summary`` record of ``metrics.jsonl`` (fields that do not apply are left out)."""
        s = self.states
        rec: dict[str, Any] = {
            "kind": "summary",
            "steps": self.steps,
            "median_step_time_s": self.median_step_time_s,
            "median_tokens_per_s": self.median_tokens_per_s,
            "first_eval_loss": self.first_eval_loss,
            "last_eval_loss": self.last_eval_loss,
            "params": s.params,
            "trainable_params": s.trainable_params,
            "params_bytes": s.params_bytes,
            "grads_bytes": s.grads_bytes,
            "optimizer_bytes": s.optimizer_bytes,
        }
        optional = asdict(self)
        for key in (
            "max_fragmentation_ratio",
            "fragmentation_at_peak",
            "peak_allocated_bytes",
            "peak_reserved_bytes",
            "alloc_retries",
            "modelled_peak_reserved_bytes",
            "peak_rss_bytes",
            "baseline_rss_bytes",
            "profiled_peak_bytes",
            "profiled_step",
            "rank_peak_bytes",
            "predicted_peak_bytes",
            "predicted_step_time_s",
            "host_state_bytes",
            "predicted_host_bytes",
            "world_size",
            "engine",
            "zero_stage",
            "rank_states",
            "kernels",
            "kernels_step",
            "kernel_profile_cost_s",
        ):
            if optional[key] is not None:
                rec[key] = optional[key]
        if self.rank_peak_bytes:
            rec[f"{self.rank_peak_key}_min_rank"] = min(self.rank_peak_bytes)
        return rec


def summarize(
    steps: list[dict[str, Any]],
    evals: list[dict[str, Any]],
    states: StateBytes,
    baseline_rss_bytes: int,
    device_label: str,
    predicted_peak_bytes: int | None = None,
    modelled_reserved_bytes: int | None = None,
    predicted_host_bytes: int | None = None,
    predicted_step_time_s: float | None = None,
) -> RunSummary:
    """The summary of a run from its step and eval records (as ``metrics.jsonl`` holds them).

    Args:
        states: this rank's model-state bytes (parameters, gradients at the optimizer step, optimizer state).
        baseline_rss_bytes: the process's RSS before the model was loaded (CPU runs).
        modelled_reserved_bytes: on a GPU, the allocator model's peak reserved for the planned steps.
        predicted_step_time_s: the planner's cost model for this run's step (the measured median beside it).
    """
    step_times = [r["step_time_s"] for r in steps]
    tps = [r["tokens_per_s"] for r in steps]
    out: dict[str, Any] = {
        "device_label": device_label,
        "steps": steps[-1]["step"] if steps else 0,
        "median_step_time_s": statistics.median(step_times) if step_times else None,
        "median_tokens_per_s": statistics.median(tps) if tps else None,
        "first_eval_loss": evals[0]["eval_loss"] if evals else None,
        "last_eval_loss": evals[-1]["eval_loss"] if evals else None,
        "states": states,
        "predicted_peak_bytes": predicted_peak_bytes,
        "predicted_step_time_s": predicted_step_time_s,
    }
    if states.host_bytes or predicted_host_bytes:  # a GPU run offloading to host memory
        out.update(host_state_bytes=states.host_bytes, predicted_host_bytes=predicted_host_bytes)
    readings = [r for r in steps if "fragmentation_ratio" in r]
    if readings:
        worst = max(readings, key=lambda r: r["fragmentation_ratio"])
        out.update(
            max_fragmentation_ratio=worst["fragmentation_ratio"],
            max_fragmentation_step=worst["step"],
            readings=len(readings),
        )
    traced = [r for r in steps if "fragmentation_at_peak" in r]
    if traced:
        last = traced[-1]
        out.update(fragmentation_at_peak=last["fragmentation_at_peak"], fragmentation_at_peak_step=last["step"])
    peaks = [r for r in steps if "peak_allocated_bytes" in r]
    if peaks:
        out.update(
            peak_allocated_bytes=max(r["peak_allocated_bytes"] for r in peaks),
            peak_reserved_bytes=max(r["peak_reserved_bytes"] for r in peaks),
            alloc_retries=peaks[-1]["alloc_retries"],
            modelled_peak_reserved_bytes=modelled_reserved_bytes,
        )
    elif steps:
        out.update(peak_rss_bytes=max(r["peak_rss_bytes"] for r in steps), baseline_rss_bytes=baseline_rss_bytes)
    profiled = [r for r in steps if "profiled_peak_bytes" in r]
    if profiled:
        rec = profiled[-1]
        ranks = rec.get("rank_profiled_peak_bytes")
        out.update(
            profiled_peak_bytes=rec["profiled_peak_bytes"],
            profiled_step=rec["step"],
            profiled_with=rec.get("profiled_with", "torch.profiler"),
            profiled_ranks=len(ranks) if ranks else None,
        )
    kernels = [r for r in steps if "kernels" in r]
    if kernels:
        out.update(
            kernels=kernels[-1]["kernels"],
            kernels_step=kernels[-1]["step"],
            kernels_of=kernels[-1]["kernels_of"],
            kernel_profiles=len(kernels),
            kernel_profile_cost_s=sum(r["kernel_profile_cost_s"] for r in kernels),
            training_s=sum(step_times),
        )
    per_step = [r["rank_memory"] for r in steps if "rank_memory" in r]
    if per_step:
        key = "peak_allocated_bytes" if "peak_allocated_bytes" in per_step[0] else "peak_rss_bytes"
        ranks = range(len(per_step[0][key]))
        out.update(rank_peak_key=key, rank_peak_bytes=[max(m[key][i] for m in per_step) for i in ranks])
    return RunSummary(**out)
