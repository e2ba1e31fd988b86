"""``memfit bench``: parse the matrix from the command line, run its cells (``memfit.telemetry.bench``),
write the results and print the table."""

from __future__ import annotations

import json
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.table import Table

from memfit.config.loader import load_config
from memfit.config.shipped import resolve_config_path
from memfit.config.strategy import ZERO_STAGES, levers
from memfit.errors import UserError
from memfit.telemetry.bench import (
    BENCH_AXES,
    cells_summary,
    check_cell,
    check_mem_limit,
    flag_losses,
    matrix,
    rows,
    run_cell,
    write_outputs,
    write_progress,
)
from memfit.train.data import source_files
from memfit.train.disk import check_creatable
from memfit.train.run_dir import LOCK_NAME, hold, release
from memfit.units import parse_memory, switch


def run(ns) -> int:
    """``memfit bench``: parse the matrix, run the cells, write and print the results."""
    config = str(resolve_config_path(ns.config))
    loras = _distinct(switch(v) for v in _split(ns.lora))
    if None in loras:
        raise UserError(f"--lora must be a comma-separated list of true/false or yes/no (got '{ns.lora}')")
    # validate the base config and overrides before spawning anything, as a LoRA cell reads them where there is one
    # (--set lora.modules_to_save=... describes its adapters; each cell is checked as it runs below)
    base = load_config(config, [*ns.set, "lora.enabled=true"] if True in loras else ns.set)
    source_files(base.data)  # and that its data is there
    stages = {"none": None, "-": None, **{str(z): z for z in ZERO_STAGES}}
    zeros = _distinct(stages.get(v, -1) for v in _split(ns.zero)) or [None]
    if -1 in zeros:
        raise UserError(f"--zero must be comma-separated stages 0-3 or none (got '{ns.zero}')")
    if ns.nproc_per_node < 2 and zeros != [None]:
        raise UserError(f"--nproc-per-node must be >= 2 for the --zero cells (got {ns.nproc_per_node})")
    if ns.steps < 1 or ns.warmup < 0:
        raise UserError(f"--steps must be >= 1 and --warmup >= 0 (got {ns.steps}, {ns.warmup})")
    cells, skipped = matrix(axes(ns, base), loras, zeros, ns.nproc_per_node)
    for line in skipped:
        print(f"memfit bench: left out {line}", file=sys.stderr)
    micro = [c.strategy.micro_batch_size for c in cells]
    global_batch = ns.global_batch or max(micro) * max(c.nproc for c in cells)
    for c in cells:  # every cell checked before anything is written
        per_pass = c.strategy.micro_batch_size * c.nproc
        if global_batch < 1 or global_batch % per_pass:
            raise UserError(
                f"--global-batch {global_batch} is not a positive multiple of micro-batch "
                f"{c.strategy.micro_batch_size} x {c.nproc} rank(s) (cell {c.name}); pick a multiple of {per_pass}"
            )
        check_cell(config, c, global_batch, ns.set)
    mem_limit = parse_memory(ns.mem_limit, "--mem-limit") if ns.mem_limit else None
    if mem_limit:
        check_mem_limit(mem_limit)
    out = Path(ns.out or f"runs/bench-{datetime.now(timezone.utc).strftime('%Y%m%d-%H%M%S')}")
    _check_empty(out)
    check_creatable(out, "--out")
    out.mkdir(parents=True, exist_ok=True)
    hold(out, "--out", "memfit bench")  # a second bench into it would run, and overwrite, the same cells
    try:
        _check_empty(out)  # filled between the check above and the lock
        return _run_matrix(ns, config, cells, out, global_batch, mem_limit)
    finally:
        release(out)


def _check_empty(out: Path) -> None:
    """Refuse an ``--out`` that holds anything but a bench's lock (its holder is named by ``hold``)."""
    if out.is_dir() and any(p.name != LOCK_NAME for p in out.iterdir()):
        raise UserError(f"--out '{out}' is not empty; choose a new directory")


def _run_matrix(ns, config: str, cells: list, out: Path, global_batch: int, mem_limit: int | None) -> int:
    console = Console(stderr=True)
    for i, cell in enumerate(cells, 1):
        run_cell(config, cell, out, ns.warmup, ns.steps, global_batch, ns.set, mem_limit)
        write_progress(cells, out)
        console.print(f"[{i}/{len(cells)}] {cell.name}: {cell.status}", highlight=False)
    flag_losses(cells)
    context = (
        f"memfit bench {Path(config).name} {' '.join(ns.set)}: {ns.warmup} warm-up + {ns.steps} measured steps, "
        f"global batch {global_batch}; {datetime.now(timezone.utc).date()} on {platform.node() or 'this machine'} "
        f"({platform.machine()}, {'GPU' if any(c.peak_allocated_bytes for c in cells) else 'CPU'})"
    )
    paths = write_outputs(cells, out, context)
    header, body = rows(cells)
    table = Table(title=context)
    for col in header:
        table.add_column(col)
    for r in body:
        table.add_row(*r)
    Console(width=200 if not sys.stdout.isatty() else None).print(table)
    print(
        json.dumps(
            {
                "benchmark": "memfit bench",
                "out": str(out),
                **cells_summary(cells),
                "files": {k: str(v) for k, v in paths.items()},
            }
        )
    )
    return 0


def _split(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def _distinct(values) -> list:
    """Each value once, in the order given (``--micro-batch 2,2`` is one cell, not two writing one directory)."""
    return list(dict.fromkeys(values))


def axes(ns, base) -> dict[str, list]:
    """The matrix's lever axes from their comma-separated flags, each value parsed by its lever (``--packing
    auto``: the ``base`` config's).

    Raises:
        UserError: naming the flag and the value.
    """
    table = levers()
    out = {}
    for name in BENCH_AXES:
        flag = table[name].flag
        text = getattr(ns, flag[2:].replace("-", "_"))
        auto = {"auto": base.data.packs()} if name == "packing" else {}
        out[name] = _distinct(auto[v] if v in auto else table[name].parse(v, flag) for v in _split(text))
        if not out[name]:
            raise UserError(f"{flag} needs at least one value (got '{text}')")
    return out
