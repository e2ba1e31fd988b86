"""What the user sees while training: a rich progress bar (or plain lines when not a terminal),
and the end-of-run summary of speed, loss and where the memory went."""

from __future__ import annotations

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

from memfit.telemetry.summary import RunSummary
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


def summary_tables(summary: RunSummary) -> tuple[Table, Table]:
    """The run table and the memory table of a summary; on a GPU the allocator model's peak reserved is
    shown beside the measured one."""
    sm, states, label = summary, summary.states, summary.device_label
    run = Table(title=f"run summary ({label})")
    run.add_column("metric")
    run.add_column("value", justify="right")
    run.add_row("optimizer steps", str(sm.steps))
    if sm.median_step_time_s is not None:
        run.add_row("median step time", f"{sm.median_step_time_s:.3f} s")
        run.add_row("median tokens/s", f"{sm.median_tokens_per_s:.0f}")
    if sm.predicted_step_time_s is not None:
        run.add_row("planner's modelled step time", f"{sm.predicted_step_time_s:.3f} s (for ranking; docs/plan.md)")
    if sm.first_eval_loss is not None:
        run.add_row("eval loss (first → last)", f"{sm.first_eval_loss:.4f} → {sm.last_eval_loss:.4f}")
    run.add_row("parameters (trainable)", f"{states.params:,} ({states.trainable_params:,})")
    if sm.max_fragmentation_ratio is not None:
        run.add_row(
            f"fragmentation ratio, highest of {sm.readings} readings",
            f"{sm.max_fragmentation_ratio:.3f} (step {sm.max_fragmentation_step})",
        )
    if sm.fragmentation_at_peak is not None:
        run.add_row(f"fragmentation at step {sm.fragmentation_at_peak_step}'s peak", f"{sm.fragmentation_at_peak:.3f}")
    if sm.kernels:
        named = [k for k in sm.kernels if k["name"] != "other"][:3]
        run.add_row(
            f"top {sm.kernels_of} (step {sm.kernels_step}, share of the step)",
            ", ".join(f"{k['name'][:40]} {k['share']:.0%}" for k in named),
        )
        cost = sm.kernel_profile_cost_s / max(sm.training_s, 1e-9)
        steps = f"{sm.kernel_profiles} step" + ("s" if sm.kernel_profiles != 1 else "")
        run.add_row(f"kernel profiling ({steps}), its cost", f"{sm.kernel_profile_cost_s:.2f} s ({cost:.1%})")

    mem = Table(title=f"where the memory went ({label})")
    mem.add_column("category")
    mem.add_column("GiB", justify="right")
    mem.add_column("how measured")
    mem.add_row("parameters", f"{states.params_bytes / GIB:.3f}", "sum of parameter tensors")
    mem.add_row("gradients", f"{states.grads_bytes / GIB:.3f}", "sum of .grad tensors at the optimizer step")
    mem.add_row("optimizer state", f"{states.optimizer_bytes / GIB:.3f}", "sum of AdamW state tensors")
    predicted = sm.predicted_peak_bytes
    if sm.peak_allocated_bytes is not None:
        peak_alloc, peak_res = sm.peak_allocated_bytes, sm.peak_reserved_bytes
        mem.add_row(
            "activations + temporaries",
            f"{max(0, peak_alloc - states.total_bytes) / GIB:.3f}",
            "peak allocated − model states",
        )
        mem.add_row("peak allocated", f"{peak_alloc / GIB:.3f}", "torch.cuda.memory_stats")
        if predicted is not None:
            mem.add_row(
                "planner's predicted peak",
                f"{predicted / GIB:.3f}",
                f"fake-tensor trace ({100 * (predicted - peak_alloc) / max(1, peak_alloc):+.1f}% vs allocated)",
            )
        mem.add_row("peak reserved", f"{peak_res / GIB:.3f}", "torch.cuda.memory_stats")
        if sm.host_state_bytes is not None:
            mem.add_row("host: offloaded model states", f"{sm.host_state_bytes / GIB:.3f}", "sum of their host tensors")
            if sm.predicted_host_bytes is not None:
                mem.add_row(
                    "planner's predicted host peak",
                    f"{sm.predicted_host_bytes / GIB:.3f}",
                    "fake-tensor trace (the states, and what offloading copies come and go)",
                )
        modelled = sm.modelled_peak_reserved_bytes
        if modelled is not None:
            mem.add_row(
                "allocator model's peak reserved",
                f"{modelled / GIB:.3f}",
                "planned first two steps replayed "
                f"({100 * (modelled - peak_res) / max(1, peak_res):+.1f}% vs reserved)",
            )
        mem.add_row(
            "reserved − allocated (at peak)", f"{(peak_res - peak_alloc) / GIB:.3f}", "cache the allocator holds"
        )
    elif sm.peak_rss_bytes is not None:
        other = max(0, sm.peak_rss_bytes - sm.baseline_rss_bytes - states.total_bytes)
        mem.add_row(
            "activations, temporaries, heap slack",
            f"{other / GIB:.3f}",
            "peak step RSS − RSS before model load − model states",
        )
        mem.add_row("RSS before model load", f"{sm.baseline_rss_bytes / GIB:.3f}", "runtime, libraries, data")
        mem.add_row("peak RSS during steps", f"{sm.peak_rss_bytes / GIB:.3f}", "VmHWM, reset before each step")
        if predicted is not None:
            mem.add_row(
                "planner's predicted tensor peak",
                f"{predicted / GIB:.3f}",
                "fake-tensor trace of this step (tensors only, no runtime)",
            )
    if sm.profiled_peak_bytes is not None:
        how = f"{sm.profiled_with}, step {sm.profiled_step}" + (
            f", worst of {sm.profiled_ranks} ranks" if sm.profiled_ranks else ""
        )
        if predicted is not None:
            how += f"; planner {100 * (predicted - sm.profiled_peak_bytes) / sm.profiled_peak_bytes:+.1f}%"
        mem.add_row("measured tensor peak", f"{sm.profiled_peak_bytes / GIB:.3f}", how)
    if sm.rank_peak_bytes:
        values = sm.rank_peak_bytes
        mem.add_row(
            f"{sm.rank_peak_key.replace('_bytes', '').replace('_', ' ')} per rank, max / min",
            f"{max(values) / GIB:.3f} / {min(values) / GIB:.3f}",
            f"ranks 0..{len(values) - 1}: " + ", ".join(f"{v / GIB:.3f}" for v in values),
        )
    return run, mem
