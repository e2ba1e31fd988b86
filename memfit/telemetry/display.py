"""What the user sees while training: a rich progress bar (or plain lines when not a terminal),
and the end-of-run summary of speed, loss and where the memory went."""

from __future__ import annotations

import statistics
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from memfit.telemetry.readings import StateBytes
from memfit.units import GIB


class TrainDisplay:
    """Progress for ``total`` optimizer steps; ``update`` takes the step record."""

    def __init__(self, total: int, start: int, console: Console | None = None, enabled: bool = True):
        self.enabled = enabled  # False on ranks other than 0: they only print what concerns them alone
        self.console = console or Console()
        self.interactive = self.console.is_terminal and enabled
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=self.console,
            disable=not self.interactive,
        )
        self.task = self.progress.add_task("train", total=total, completed=start, status="")

    def __enter__(self) -> "TrainDisplay":
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def update(self, rec: dict[str, Any]) -> None:
        mem = rec.get("peak_allocated_bytes", rec.get("peak_rss_bytes", 0)) / GIB
        label = "alloc" if "peak_allocated_bytes" in rec else "rss"
        status = (
            f"loss {rec['loss']:.4f}  lr {rec['lr']:.2e}  {rec['tokens_per_s']:.0f} tok/s  peak {label} {mem:.2f} GiB"
        )
        if "fragmentation_ratio" in rec:
            status += f"  frag {rec['fragmentation_ratio']:.2f}"
        if "fragmentation_at_peak" in rec:
            status += f" (at the step's peak {rec['fragmentation_at_peak']:.2f})"
        self.progress.update(self.task, completed=rec["step"], status=status)
        if not self.interactive and self.enabled:
            self.console.print(f"step {rec['step']:>5}  {status}", highlight=False)

    def log(self, message: str, everywhere: bool = False) -> None:
        if self.enabled or everywhere:
            self.console.print(message, highlight=False)

    def print(self, renderable) -> None:
        if self.enabled:
            self.console.print(renderable)


def summary_tables(
    steps: list[dict[str, Any]],
    evals: list[dict[str, Any]],
    states: StateBytes,
    baseline_rss_bytes: int,
    device_label: str,
    predicted_peak_bytes: int | None = None,
    modelled_reserved_bytes: int | None = None,
) -> tuple[Table, Table, dict[str, Any]]:
    """The run table, the memory table and the summary record (all bytes as ints); on a GPU the
    allocator model's peak reserved (``modelled_reserved_bytes``) is shown beside the measured one."""
    step_times = [r["step_time_s"] for r in steps]
    tps = [r["tokens_per_s"] for r in steps]
    summary: dict[str, Any] = {
        "kind": "summary",
        "steps": steps[-1]["step"] if steps else 0,
        "median_step_time_s": statistics.median(step_times) if step_times else None,
        "median_tokens_per_s": statistics.median(tps) if tps else None,
        "first_eval_loss": evals[0]["eval_loss"] if evals else None,
        "last_eval_loss": evals[-1]["eval_loss"] if evals else None,
        "params": states.params,
        "trainable_params": states.trainable_params,
        "params_bytes": states.params_bytes,
        "grads_bytes": states.grads_bytes,
        "optimizer_bytes": states.optimizer_bytes,
    }
    run = Table(title=f"run summary ({device_label})")
    run.add_column("metric")
    run.add_column("value", justify="right")
    run.add_row("optimizer steps", str(summary["steps"]))
    if step_times:
        run.add_row("median step time", f"{summary['median_step_time_s']:.3f} s")
        run.add_row("median tokens/s", f"{summary['median_tokens_per_s']:.0f}")
    if evals:
        run.add_row("eval loss (first → last)", f"{summary['first_eval_loss']:.4f} → {summary['last_eval_loss']:.4f}")
    run.add_row("parameters (trainable)", f"{states.params:,} ({states.trainable_params:,})")
    readings = [r for r in steps if "fragmentation_ratio" in r]
    if readings:
        worst = max(readings, key=lambda r: r["fragmentation_ratio"])
        summary["max_fragmentation_ratio"] = worst["fragmentation_ratio"]
        run.add_row(
            f"fragmentation ratio, highest of {len(readings)} readings",
            f"{worst['fragmentation_ratio']:.3f} (step {worst['step']})",
        )
    traced = [r for r in steps if "fragmentation_at_peak" in r]
    if traced:
        summary["fragmentation_at_peak"] = traced[-1]["fragmentation_at_peak"]
        run.add_row(f"fragmentation at step {traced[-1]['step']}'s peak", f"{traced[-1]['fragmentation_at_peak']:.3f}")

    mem = Table(title=f"where the memory went ({device_label})")
    mem.add_column("category")
    mem.add_column("GiB", justify="right")
    mem.add_column("how measured")
    mem.add_row("parameters", f"{states.params_bytes / GIB:.3f}", "sum of parameter tensors")
    mem.add_row("gradients", f"{states.grads_bytes / GIB:.3f}", "sum of .grad tensors at the optimizer step")
    mem.add_row("optimizer state", f"{states.optimizer_bytes / GIB:.3f}", "sum of AdamW state tensors")
    peaks = [r for r in steps if "peak_allocated_bytes" in r]
    if peaks:
        peak_alloc = max(r["peak_allocated_bytes"] for r in peaks)
        peak_res = max(r["peak_reserved_bytes"] for r in peaks)
        summary.update(
            peak_allocated_bytes=peak_alloc, peak_reserved_bytes=peak_res, alloc_retries=peaks[-1]["alloc_retries"]
        )
        mem.add_row(
            "activations + temporaries",
            f"{max(0, peak_alloc - states.total_bytes) / GIB:.3f}",
            "peak allocated − model states",
        )
        mem.add_row("peak allocated", f"{peak_alloc / GIB:.3f}", "torch.cuda.memory_stats")
        if predicted_peak_bytes is not None:
            mem.add_row(
                "planner's predicted peak",
                f"{predicted_peak_bytes / GIB:.3f}",
                "fake-tensor trace "
                f"({100 * (predicted_peak_bytes - peak_alloc) / max(1, peak_alloc):+.1f}% vs allocated)",
            )
        mem.add_row("peak reserved", f"{peak_res / GIB:.3f}", "torch.cuda.memory_stats")
        if modelled_reserved_bytes is not None:
            summary["modelled_peak_reserved_bytes"] = modelled_reserved_bytes
            mem.add_row(
                "allocator model's peak reserved",
                f"{modelled_reserved_bytes / GIB:.3f}",
                "planned first two steps replayed "
                f"({100 * (modelled_reserved_bytes - peak_res) / max(1, peak_res):+.1f}% vs reserved)",
            )
        mem.add_row(
            "reserved − allocated (at peak)", f"{(peak_res - peak_alloc) / GIB:.3f}", "cache the allocator holds"
        )
    elif steps:
        peak_rss = max(r["peak_rss_bytes"] for r in steps)
        other = max(0, peak_rss - baseline_rss_bytes - states.total_bytes)
        summary.update(peak_rss_bytes=peak_rss, baseline_rss_bytes=baseline_rss_bytes)
        mem.add_row(
            "activations, temporaries, heap slack",
            f"{other / GIB:.3f}",
            "peak step RSS − RSS before model load − model states",
        )
        mem.add_row("RSS before model load", f"{baseline_rss_bytes / GIB:.3f}", "runtime, libraries, data")
        mem.add_row("peak RSS during steps", f"{peak_rss / GIB:.3f}", "VmHWM, reset before each step")
        if predicted_peak_bytes is not None:
            mem.add_row(
                "planner's predicted tensor peak",
                f"{predicted_peak_bytes / GIB:.3f}",
                "fake-tensor trace of this step (tensors only, no runtime)",
            )
    profiled = [r for r in steps if "profiled_peak_bytes" in r]
    if profiled:
        rec = profiled[-1]
        summary.update(profiled_peak_bytes=rec["profiled_peak_bytes"], profiled_step=rec["step"])
        ranks = rec.get("rank_profiled_peak_bytes")
        how = f"{rec.get('profiled_with', 'torch.profiler')}, step {rec['step']}" + (
            f", worst of {len(ranks)} ranks" if ranks else ""
        )
        if predicted_peak_bytes is not None:
            profiled = rec["profiled_peak_bytes"]
            how += f"; planner {100 * (predicted_peak_bytes - profiled) / profiled:+.1f}%"
        mem.add_row("measured tensor peak", f"{rec['profiled_peak_bytes'] / GIB:.3f}", how)
    rank_peaks = _rank_peaks(steps)
    if rank_peaks:
        key, values = rank_peaks
        summary["rank_peak_bytes"] = values
        summary[f"{key}_min_rank"] = min(values)
        mem.add_row(
            f"{key.replace('_bytes', '').replace('_', ' ')} per rank, max / min",
            f"{max(values) / GIB:.3f} / {min(values) / GIB:.3f}",
            f"ranks 0..{len(values) - 1}: " + ", ".join(f"{v / GIB:.3f}" for v in values),
        )
    if predicted_peak_bytes is not None:
        summary["predicted_peak_bytes"] = predicted_peak_bytes
    return run, mem, summary


def _rank_peaks(steps: list[dict[str, Any]]) -> tuple[str, list[int]] | None:
    """(peak key, each rank's highest value over the steps) of a multi-rank run, else None."""
    per_step = [r["rank_memory"] for r in steps if "rank_memory" in r]
    if not per_step:
        return None
    key = "peak_allocated_bytes" if "peak_allocated_bytes" in per_step[0] else "peak_rss_bytes"
    return key, [max(m[key][i] for m in per_step) for i in range(len(per_step[0][key]))]
