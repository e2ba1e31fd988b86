"""How a run stops early, each with one line that says what survived: a stop signal (SIGTERM from a scheduler,
Ctrl-C) acted on at a step boundary, a non-finite step, and an out-of-memory error (a snapshot and an ``oom``
record first)."""

from __future__ import annotations

import math
import signal
import threading
from pathlib import Path
from typing import Any

from memfit.errors import Interrupted, OutOfMemoryExit, UserError
from memfit.telemetry.metrics_file import append_record
from memfit.units import GIB


class StopSignals:
    """SIGTERM and SIGINT while training: noted, and acted on at the next step boundary, where the trainer writes
    a final checkpoint (schedulers send SIGTERM some seconds before they kill). A second signal interrupts at
    once. Handlers are installed only in the main thread (Python allows no other) and restored on exit."""

    CAUGHT = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._note) for s in self.CAUGHT}
        return self

    def _note(self, signum, frame) -> None:
        if self.received is not None:
            self.__exit__()
            raise KeyboardInterrupt
        self.received = signal.Signals(signum)

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}


def out_of_memory_exit(
    step: int, requested: int, watch, predicted, run, rank: int, advice: dict | None = None
) -> OutOfMemoryExit:
    """Dump a snapshot on a GPU (``watch``), record the failure as an ``oom`` record in the run's
    ``metrics.jsonl`` (with ``advice``: ``fit_check.restart_allocator``'s, for ``train.on_oom=next``), and say what
    was asked, what the planner ``predicted`` (or None) and what to try."""
    path, cause = watch.oom_snapshot(step)
    where = f"; snapshot {path} (memfit frag {path} --simulate)" if path else ""
    where += f"; {cause}" if cause else ""
    said = ""
    if predicted is not None:
        parts = ", ".join(f"{c.value} {v / GIB:.2f}" for c, v in predicted.peak.bytes_by_category.items() if v)
        said = f"; planner predicted a {predicted.peak_bytes / GIB:.2f} GiB peak in {predicted.peak_phase} ({parts})"
    append_record(
        run.metrics_path,
        {
            "kind": "oom",
            "step": step,
            "rank": rank,
            "requested_bytes": requested,
            "predicted_peak_bytes": predicted.peak_bytes if predicted is not None else None,
            "snapshot": str(path) if path else None,
            "cause": cause or None,
            **(advice or {}),
        },
    )
    return OutOfMemoryExit(
        f"out of memory at step {step}: an allocation of {requested / GIB:.2f} GiB ({requested} bytes) failed"
        f"{said}{where}; try `memfit plan --config {run.config_path}` for a configuration that fits"
    )


def interrupted(
    received: signal.Signals, step: int, max_steps: int, kept: Path | None, took_s: float | None, echo: bool
) -> Interrupted:
    """The line for a run stopped by ``received`` after ``step``: the checkpoint that holds it (written now, in
    ``took_s``, or already at this step), or that nothing is kept."""
    where = f"interrupted by {received.name} after step {step} of {max_steps}"
    if kept is None:
        return Interrupted(received, f"{where}: nothing of this run is kept (train.keep_checkpoints=0)", echo=echo)
    took = f", written in {took_s:.1f} s" if took_s is not None else ""
    line = f"{where}: checkpoint {kept} holds it{took}; continue with train.resume=true"
    return Interrupted(received, line, echo=echo)


def check_finite(step: int, loss: float, grad_norm: float, scaled: bool, lr: float) -> None:
    """Stop before a non-finite step is checkpointed or exported (with loss scaling, ``scaled``, overflowing
    steps are skipped by the scaler itself: there only the loss is checked).

    Raises:
        UserError: naming the step, the values and what to change.
    """
    if math.isfinite(loss) and (scaled or math.isfinite(grad_norm)):
        return
    if step == 1 and not math.isfinite(loss):
        raise UserError(
            f"step 1: the loss is {loss} before any update, so the model as loaded computes it (optimizer.lr plays "
            "no part yet); training stopped: check model.source's weights and config.json, or use fp32 precision"
        )
    raise UserError(
        f"step {step}: the loss is {loss} and the gradient norm {grad_norm}; training stopped, nothing of it "
        f"is checkpointed or exported; lower optimizer.lr ({lr:g}), keep optimizer.grad_clip > 0, or use "
        "fp32/bf16-mixed precision"
    )


def restart_due(condition, record: dict[str, Any], here: tuple[int, float], ctx) -> str | None:
    """Why the run restarts after the step ``record`` describes (``condition``: a ``RestartCondition``; ``here``:
    this process's steps and seconds of training), or None; with several ranks, every rank restarts after the same
    step when the condition holds on any of them."""
    why = condition.due(record, *here)
    if ctx.distributed and max(r[0] for r in ctx.gather_numbers([float(why is not None)])) and why is None:
        why = "another rank's reading"
    return why
