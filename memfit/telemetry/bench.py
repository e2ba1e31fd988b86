"""``memfit bench``: run a matrix of strategies, each cell its own ``memfit train`` subprocess (clean
allocator state), and tabulate what was measured beside what the planner predicted.

A cell runs ``warmup + steps`` optimizer steps; statistics use the steps after warm-up. One more step,
outside the timed ones, is inspected: its tensor peak (torch.profiler on CPU, the caching allocator's
counters on a GPU, where the profiler misses the autograd thread's releases) beside the planner's
prediction, and on a GPU with the allocator trace recorded, from which the fragmentation at
that step's peak is rebuilt (``memfit.allocator.layout``). Cells with a
ZeRO stage (``--zero 0,2``) run on ``--nproc-per-node`` ranks through torchrun (FSDP2 engine); their
memory is the worst rank's and the prediction the planner's per-rank one. The global batch
is the same in every cell (micro-batch x gradient accumulation), so cells of one precision must reach
the same loss: a cell that does not is flagged. A cell that runs out of memory (exit code 3) is reported
as OOM with the bytes its failed allocation asked for; one that ``--mem-limit``'s cap stopped before its
training step (a signal, a refused import or model build) is OOM too, named by what stopped it.
"""

from __future__ import annotations

import csv
import itertools
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from memfit.config.loader import load_config
from memfit.config.strategy import ENGINE_OF_STAGE, Strategy, levers
from memfit.errors import EXIT_OUT_OF_MEMORY, UserError
from memfit.telemetry.metrics_file import read_metrics
from memfit.units import GIB, size_text, statm_bytes

LOSS_TOLERANCE = {"fp32": 1e-3}  # relative; others (bf16/fp16) use DEFAULT_TOLERANCE
DEFAULT_TOLERANCE = 3e-2
CAP_REFUSALS = ("MemoryError", "failed to map segment", "Cannot allocate memory", "std::bad_alloc")
"""What a cell's last line says when ``--mem-limit``'s address-space cap refused a mapping outside the training
step (which exits 3 with the size it asked for): in an import, the tokenizer, building the model."""


BENCH_AXES = {
    "activation_checkpointing": "none,full",
    "precision": "fp32",
    "quantize_base": "none",
    "loss_chunks": "0",
    "activation_offload": "false",
    "optimizer_in_backward": "false",
    "optimizer_name": "adamw",
    "optimizer_offload": "false",
    "packing": "auto",
    "micro_batch_size": "2",
}
"""Levers every cell sets explicitly, with the command's default values (the others follow the base config,
except a multi-rank cell's ZeRO stage). ``auto`` packing is the base config's (on for chat data)."""


@dataclass
class Cell:
    strategy: Strategy  # grad_accum_steps is derived from the global batch when the cell's command is built
    lora: bool
    nproc: int = 1  # ranks: 1 runs one process, more run torchrun with strategy.zero_stage
    axes: tuple[str, ...] = tuple(BENCH_AXES)  # the levers this cell passes to memfit train
    status: str = "pending"  # ok | oom | failed
    median_step_time_s: float | None = None
    step_time_spread_s: float | None = None
    predicted_step_time_s: float | None = None  # the planner's cost model for this cell on this device
    step_time_error_pct: float | None = None
    tokens_per_s: float | None = None
    supervised_tokens_per_s: float | None = None  # tokens that take a loss (what packing raises)
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    modelled_reserved_bytes: int | None = None  # GPU: the allocator model's replay of the planned steps
    peak_rss_bytes: int | None = None
    fragmentation_ratio: float | None = None  # GPU: at the inspected step's peak (else the highest end-of-step reading)
    profiled_peak_bytes: int | None = None  # the inspected step's tensor peak (see train.profile_step)
    predicted_peak_bytes: int | None = None
    prediction_error_pct: float | None = None
    params_bytes: int | None = None
    grads_bytes: int | None = None
    optimizer_bytes: int | None = None
    loss: float | None = None
    oom_request_bytes: int | None = None
    loss_flag: str = ""
    message: str = ""

    @property
    def name(self) -> str:
        s = self.strategy
        ranks = "" if self.nproc == 1 else f"_zero{s.zero_stage}x{self.nproc}"
        ac = str(s.activation_checkpointing).replace(":", "")
        chunks = f"_ce{s.loss_chunks}" if s.loss_chunks else ""
        chunks += "_offload" if s.activation_offload else ""
        chunks += "_optbwd" if s.optimizer_in_backward else ""
        chunks += f"_{s.optimizer_name}" if s.optimizer_name != "adamw" else ""
        chunks += f"_{s.quantize_base}" if s.quantize_base != "none" else ""
        chunks += "_packed" if s.packing else ""
        chunks += "_opthost" if s.optimizer_offload else ""
        return f"ac-{ac}_{s.precision}{chunks}_mb{s.micro_batch_size}_{'lora' if self.lora else 'full'}{ranks}"

    def as_dict(self) -> dict[str, Any]:
        """The cell for ``results.json``: its levers by name beside what was measured."""
        fields = {k: v for k, v in asdict(self).items() if k not in ("strategy", "axes")}
        return {"name": self.name, **self.strategy.as_dict(), **fields}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "Cell":
        """A cell as ``as_dict`` wrote it to ``results.json``."""
        known = {f.name for f in fields(cls)} - {"strategy", "axes"}
        return cls(Strategy.from_dict(values), **{k: v for k, v in values.items() if k in known})

    @property
    def peak_bytes(self) -> int | None:
        return self.peak_allocated_bytes if self.peak_allocated_bytes is not None else self.peak_rss_bytes


def matrix(
    axes: dict[str, list], loras: list[bool], zeros: list[int | None] = (None,), nproc: int = 2
) -> tuple[list[Cell], list[str]]:
    """Every combination of the ``axes`` (``Strategy`` lever name to values, in lever order), LoRA and ZeRO
    stage; cells with a ZeRO stage (not None) run on ``nproc`` ranks through torchrun. A combination that cannot
    run is left out, as the planner's search space leaves it: levers that do not combine on the cell's ranks and
    engine (``Strategy.conflict``, the rule ``memfit train`` refuses by), an NF4 base without LoRA.

    Returns:
        the cells, and one "<cell>: <why>" for each combination left out.

    Raises:
        UserError: when every combination is left out (the first one's reason).
    """
    names = [n for n in levers() if n in axes]
    cells, skipped = [], []
    for values in itertools.product(*(axes[n] for n in names)):
        for lora, zero in itertools.product(loras, zeros):
            strategy = Strategy(**dict(zip(names, values)), zero_stage=zero or 0)
            if strategy.optimizer_name != "adamw" and "optimizer" not in names:  # auto: low-bit steps one by one
                strategy = strategy.replace(optimizer="for-loop")
            cell = Cell(strategy, lora, 1 if zero is None else nproc, tuple(names))
            engine = "single" if zero is None else ENGINE_OF_STAGE[zero]
            why = strategy.conflict(world_size=cell.nproc, engine=engine)
            if not lora and strategy.quantize_base != "none":
                why = "--quantize-base nf4 quantizes a LoRA run's frozen base: add true to --lora"
            if why:
                skipped.append(f"{cell.name}: {why}")
            else:
                cells.append(cell)
    if not cells and skipped:
        raise UserError(f"no bench cell can run: {skipped[0]}")
    return cells, skipped


def profiled(cell: Cell) -> bool:
    """Engines whose every buffer torch.profiler sees (not DDP's gradient buckets, made at start-up)."""
    return cell.nproc == 1 or cell.strategy.zero_stage in (2, 3)


def check_cell(config: str, cell: Cell, global_batch: int, extra: list[str]) -> None:
    """Raises UserError where the cell's levers do not combine at ``global_batch`` on its ranks and engine, or where
    its train config (``config``, ``extra`` and the cell's pins) is one ``memfit train`` would refuse."""
    s = cell.strategy.replace(grad_accum_steps=global_batch // (cell.strategy.micro_batch_size * cell.nproc))
    conflict = s.conflict(world_size=cell.nproc, engine="single" if cell.nproc == 1 else ENGINE_OF_STAGE[s.zero_stage])
    if conflict:
        raise UserError(f"bench cell {cell.name}: {conflict}")
    try:
        load_config(config, _cell_overrides(cell, s, Path("bench"), 1, global_batch, extra))
    except UserError as e:
        raise UserError(f"bench cell {cell.name}: {e}") from None


def _cell_overrides(cell: Cell, s: Strategy, out: Path, steps: int, global_batch: int, extra: list[str]) -> list[str]:
    """The ``memfit train`` overrides of a cell running strategy ``s`` for ``steps`` steps (the inspected one
    included) into ``out``."""
    pins = s.overrides(cell.axes)
    if cell.nproc > 1:
        pins.append(f"{levers()['zero_stage'].config_key}={s.zero_stage}")
    inspect = [f"train.snapshot_at_step={steps}"]
    if profiled(cell):
        inspect.append(f"train.profile_step={steps}")
    return [
        *extra,
        *inspect,
        *pins,
        f"train.global_batch_size={global_batch}",
        f"lora.enabled={'true' if cell.lora else 'false'}",
        f"train.max_steps={steps}",
        "train.eval_every=0",
        "train.eval_batches=1",
        "train.keep_checkpoints=0",
        "train.frag_every=1",
        "train.log_every=1",
        "output.export=false",
        f"output.dir={out / 'cells' / cell.name}",
    ]


def _cell_command(config: str, cell: Cell, out: Path, steps: int, global_batch: int, extra: list[str]) -> list[str]:
    s = cell.strategy
    per_pass = s.micro_batch_size * cell.nproc
    if global_batch % per_pass:
        raise UserError(
            f"--micro-batch {s.micro_batch_size} x {cell.nproc} rank(s) does not divide the global batch {global_batch}"
        )
    cell.strategy = s = s.replace(grad_accum_steps=global_batch // per_pass)
    launch = [] if cell.nproc == 1 else ["--nproc-per-node", str(cell.nproc)]
    # the inspected step, outside the timed ones
    overrides = _cell_overrides(cell, s, out, steps + 1, global_batch, extra)
    return [sys.executable, "-m", "memfit.cli", "train", config, *overrides, *launch]


def check_mem_limit(mem_limit: int) -> None:
    """Refuse a ``--mem-limit`` no cell can start under: a cell is a Python that imports torch, as this process
    has, and the address space this process maps already exceeds the cap (``/proc/self/statm``; Linux).

    Raises:
        UserError: naming both sizes.
    """
    try:
        mapped = statm_bytes()[0]
    except OSError:  # no /proc: the cells say it themselves
        return
    if mem_limit < mapped:
        raise UserError(
            f"--mem-limit {size_text(mem_limit)} is below the {size_text(mapped)} of address space this process "
            "maps with torch imported, as every cell must before its first step; raise --mem-limit above that"
        )


def exit_text(returncode: int, stderr: str) -> str:
    """A failed cell's note: the signal that killed it, else its last line on stderr, else its exit code."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name} (signal {-returncode})"
        except ValueError:
            return f"killed by signal {-returncode}"
    return (stderr.strip().splitlines() or [f"exit code {returncode}"])[-1]


def run_cell(
    config: str,
    cell: Cell,
    out: Path,
    warmup: int,
    steps: int,
    global_batch: int,
    extra: list[str],
    mem_limit: int | None,
) -> Cell:
    cmd = _cell_command(config, cell, out, warmup + steps, global_batch, extra)

    def cap() -> None:
        if mem_limit:
            resource.setrlimit(resource.RLIMIT_AS, (mem_limit, mem_limit))

    proc = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=cap)
    metrics = out / "cells" / cell.name / "metrics.jsonl"
    if proc.returncode == EXIT_OUT_OF_MEMORY:
        ooms = [r for r in read_metrics(metrics) if r["kind"] == "oom"] if metrics.is_file() else []
        cell.status = "oom"
        cell.oom_request_bytes = ooms[-1]["requested_bytes"] if ooms else None
        cell.message = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
        return cell
    if proc.returncode != 0:
        cell.message = exit_text(proc.returncode, proc.stderr)
        refused = mem_limit and (proc.returncode < 0 or any(s in cell.message for s in CAP_REFUSALS))
        cell.status = "oom" if refused else "failed"
        if refused:
            cell.message += f" under --mem-limit {size_text(mem_limit)}, before the training step; raise --mem-limit"
        return cell
    records = read_metrics(metrics)
    measured = [r for r in records if r["kind"] == "step" and warmup < r["step"] <= warmup + steps]
    summary = next(r for r in records if r["kind"] == "summary")
    times = [r["step_time_s"] for r in measured]
    cell.status = "ok"
    cell.median_step_time_s = statistics.median(times)
    cell.step_time_spread_s = max(times) - min(times)
    cell.tokens_per_s = statistics.median(r["tokens_per_s"] for r in measured)
    if all("supervised_tokens_per_s" in r for r in measured):
        cell.supervised_tokens_per_s = statistics.median(r["supervised_tokens_per_s"] for r in measured)
    cell.loss = measured[-1]["loss"]
    if "peak_allocated_bytes" in measured[0]:
        cell.peak_allocated_bytes = max(r["peak_allocated_bytes"] for r in measured)
        cell.peak_reserved_bytes = max(r["peak_reserved_bytes"] for r in measured)
        at_peak = [r["fragmentation_at_peak"] for r in records if r["kind"] == "step" and "fragmentation_at_peak" in r]
        cell.fragmentation_ratio = (
            at_peak[0]
            if at_peak
            else max((r["fragmentation_ratio"] for r in measured if "fragmentation_ratio" in r), default=None)
        )
    else:
        cell.peak_rss_bytes = max(r["peak_rss_bytes"] for r in measured)
    cell.predicted_peak_bytes = summary.get("predicted_peak_bytes")
    cell.predicted_step_time_s = summary.get("predicted_step_time_s")
    if cell.predicted_step_time_s:
        cell.step_time_error_pct = (
            100 * (cell.predicted_step_time_s - cell.median_step_time_s) / cell.median_step_time_s
        )
    cell.modelled_reserved_bytes = summary.get("modelled_peak_reserved_bytes")
    cell.profiled_peak_bytes = next((r["profiled_peak_bytes"] for r in records if "profiled_peak_bytes" in r), None)
    reference = cell.peak_allocated_bytes or cell.profiled_peak_bytes
    if cell.predicted_peak_bytes and reference:
        cell.prediction_error_pct = 100 * (cell.predicted_peak_bytes - reference) / reference
    cell.params_bytes, cell.grads_bytes, cell.optimizer_bytes = (
        summary["params_bytes"],
        summary["grads_bytes"],
        summary["optimizer_bytes"],
    )
    return cell


def flag_losses(cells: list[Cell]) -> None:
    """Cells of one precision and tuning (full/LoRA) share the global batch: their losses must agree."""
    groups: dict[tuple, list[Cell]] = {}
    for c in cells:
        if c.status == "ok":
            groups.setdefault((c.strategy.precision, c.lora), []).append(c)
    for (precision, _), group in groups.items():
        ref = statistics.median(c.loss for c in group)
        tol = LOSS_TOLERANCE.get(precision, DEFAULT_TOLERANCE)
        for c in group:
            if abs(c.loss - ref) > tol * abs(ref):
                c.loss_flag = f"loss {c.loss:.5f} differs from the {precision} median {ref:.5f} by more than {tol:g}"


def _fmt_gib(n: int | None) -> str:
    return "" if n is None else f"{n / GIB:.3f}"


def rows(cells: list[Cell]) -> tuple[list[str], list[list[str]]]:
    header = [
        "cell",
        "status",
        "ranks x mb x acc",
        "peak GiB",
        "reserved GiB",
        "modelled reserved GiB",
        "frag",
        "inspected step peak GiB",
        "predicted GiB",
        "error %",
        "step s (median)",
        "spread s",
        "modelled step s",
        "step-time error %",
        "tokens/s",
        "supervised tokens/s",
        "loss",
        "note",
    ]
    body = []
    for c in cells:
        note = c.loss_flag or (
            f"OOM asking for {c.oom_request_bytes / GIB:.2f} GiB"
            if c.status == "oom" and c.oom_request_bytes
            else c.message
        )
        body.append(
            [
                c.name,
                c.status,
                f"{c.nproc}x{c.strategy.micro_batch_size}x{c.strategy.grad_accum_steps}",
                _fmt_gib(c.peak_bytes),
                _fmt_gib(c.peak_reserved_bytes),
                _fmt_gib(c.modelled_reserved_bytes),
                "" if c.fragmentation_ratio is None else f"{c.fragmentation_ratio:.3f}",
                _fmt_gib(c.profiled_peak_bytes),
                _fmt_gib(c.predicted_peak_bytes),
                "" if c.prediction_error_pct is None else f"{c.prediction_error_pct:+.1f}",
                "" if c.median_step_time_s is None else f"{c.median_step_time_s:.3f}",
                "" if c.step_time_spread_s is None else f"{c.step_time_spread_s:.3f}",
                "" if c.predicted_step_time_s is None else f"{c.predicted_step_time_s:.3g}",
                "" if c.step_time_error_pct is None else f"{c.step_time_error_pct:+.0f}",
                "" if c.tokens_per_s is None else f"{c.tokens_per_s:.0f}",
                "" if c.supervised_tokens_per_s is None else f"{c.supervised_tokens_per_s:.0f}",
                "" if c.loss is None else f"{c.loss:.5f}",
                note,
            ]
        )
    return header, body


def write_outputs(cells: list[Cell], out: Path, context: str) -> dict[str, Path]:
    header, body = rows(cells)
    paths = {"csv": out / "results.csv", "md": out / "results.md", "json": out / "results.json"}
    with paths["csv"].open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(header)
        writer.writerows(body)
    md = [f"{context}\n", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    md += ["| " + " | ".join(r) + " |" for r in body]
    paths["md"].write_text("\n".join(md) + "\n")
    write_progress(cells, out)
    from memfit.telemetry.plots import bench_memory, bench_pareto

    paths["memory_png"] = bench_memory(cells, out / "memory_per_cell.png", context)
    paths["pareto_png"] = bench_pareto(cells, out / "pareto.png", context)
    return paths


def write_progress(cells: list[Cell], out: Path) -> None:
    """``results.json`` after each cell (cells not run yet say "pending"), replaced atomically, so an
    interrupted bench keeps what it measured."""
    tmp = out / ".results.json.tmp"
    tmp.write_text(json.dumps([c.as_dict() for c in cells], indent=1) + "\n")
    tmp.replace(out / "results.json")


def cells_summary(cells: list[Cell]) -> dict[str, Any]:
    return {
        "cells": len(cells),
        "ok": sum(c.status == "ok" for c in cells),
        "oom": sum(c.status == "oom" for c in cells),
        "failed": sum(c.status == "failed" for c in cells),
        "loss_flags": sum(bool(c.loss_flag) for c in cells),
        **step_time_order(cells),
    }


def step_time_order(cells: list[Cell]) -> dict[str, int]:
    """How far the step-time model's ranking can be trusted on this device: of the pairs of cells that ran, how
    many it orders as the measured medians do (pairs within 2% of each other in either are not counted)."""
    timed = [c for c in cells if c.status == "ok" and c.predicted_step_time_s and c.median_step_time_s]
    agree = pairs = 0
    for i, a in enumerate(timed):
        for b in timed[i + 1 :]:
            modelled = a.predicted_step_time_s / b.predicted_step_time_s
            measured = a.median_step_time_s / b.median_step_time_s
            if abs(modelled - 1) < 0.02 or abs(measured - 1) < 0.02:
                continue
            pairs += 1
            agree += (modelled > 1) == (measured > 1)
    return {"step_time_pairs": pairs, "step_time_pairs_ordered_alike": agree}


def run_in_group(cmd: list[str], timeout_s: float, cwd: Path | None = None) -> subprocess.CompletedProcess | None:
    """Run ``cmd`` in its own process group and capture its output; past ``timeout_s`` the whole group is
    killed (a bench's cell subprocesses and torchrun's ranks too, so none keeps holding a GPU), and None is
    returned."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
