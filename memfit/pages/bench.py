"""The HTML page of a ``memfit bench`` directory: the cell table, memory per cell stacked by category beside the
planner's prediction, and tokens/s against peak memory with the Pareto front."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from memfit.config.loader import json_value
from memfit.errors import UserError
from memfit.pages.html import Page, Series, paragraph, table
from memfit.telemetry.bench import Cell as BenchCell
from memfit.telemetry.bench import rows
from memfit.units import GIB

STATES = (
    ("params_bytes", "parameters", "#3b6fb6"),
    ("grads_bytes", "gradients", "#e59b2e"),
    ("optimizer_bytes", "optimizer state", "#7d3c98"),
)


def read_cells(bench_dir: Path) -> tuple[list[dict[str, Any]], str]:
    """The cells of ``bench_dir/results.json`` and the bench's one-line context (``results.md``'s first line).

    Raises:
        UserError: no results, or not a list of cells.
    """
    path = bench_dir / "results.json"
    if not path.is_file():
        raise UserError(f"'{bench_dir}' has no results.json: give a directory that memfit bench wrote")
    try:
        cells = json_value(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"'{path}' is not readable JSON ({e}); run memfit bench again") from None
    if not isinstance(cells, list) or not all(isinstance(c, dict) and "name" in c and "status" in c for c in cells):
        raise UserError(f"'{path}' is not a list of bench cells (each with a name and a status)")
    md = bench_dir / "results.md"
    context = md.read_text(encoding="utf-8", errors="replace").splitlines()[0] if md.is_file() else ""
    return cells, context


def _peak(c: dict[str, Any]) -> int | None:
    return c.get("peak_allocated_bytes") if c.get("peak_allocated_bytes") is not None else c.get("peak_rss_bytes")


def _table(cells: list[dict[str, Any]]) -> str:
    """The table ``memfit bench`` prints (``telemetry.bench.rows``), numbered, each column sortable."""
    header, body = rows([BenchCell.from_dict(c) for c in cells])
    return table(["#", *header], [[i, *row] for i, row in enumerate(body, 1)], table_id="cells")


def bench_page(bench_dir: Path) -> Page:
    cells, context = read_cells(bench_dir)
    ok = [c for c in cells if c["status"] == "ok" and _peak(c)]
    page = Page(f"memfit bench: {bench_dir.resolve().name}", "bench", context or f"{len(cells)} cells")
    page.data["cells"] = [
        {
            "name": c["name"],
            "status": c["status"],
            "peak": _peak(c),
            "predicted": c.get("predicted_peak_bytes"),
            "tokens_per_s": c.get("tokens_per_s"),
            "step_s": c.get("median_step_time_s"),
        }
        for c in cells
    ]
    page.section("cells", f'<div class="scroll">{_table(cells)}</div>', section_id="cells-section")
    x = list(range(len(cells)))
    running = [0.0] * len(cells)
    stacked = []
    for key, label, color in STATES:
        running = [r + ((c.get(key) or 0) / GIB if c in ok else 0.0) for r, c in zip(running, cells)]
        stacked.append(Series(label, list(running), color, "bars"))
    total = Series(
        "activations, temporaries (and runtime on CPU)",
        [(_peak(c) or 0) / GIB if c in ok else None for c in cells],
        "#95a5a6",
        "bars",
    )
    predicted = Series(
        "planner prediction", [(c.get("predicted_peak_bytes") or 0) / GIB or None for c in cells], "#1d2330", "points"
    )
    page.section(
        "memory per cell",
        paragraph(
            "cells numbered in the table's order (hover for the name); bars stacked from parameters up to the "
            "measured peak; "
            "cells that did not finish have no bar",
            "note",
        ),
        page.chart(
            "memory-per-cell",
            "GiB at the step peak",
            x,
            "cell",
            [total, *reversed(stacked), predicted],
            "GiB",
            hover="cells",
            x_names=[str(i + 1) for i in x],
        ),
        section_id="memory-section",
    )
    if ok:
        order = sorted(range(len(cells)), key=lambda i: (_peak(cells[i]) or 0, -(cells[i].get("tokens_per_s") or 0)))
        order = [i for i in order if cells[i] in ok and cells[i].get("tokens_per_s")]
        front, best = set(), -1.0
        for i in order:
            if cells[i]["tokens_per_s"] > best:
                front.add(i)
                best = cells[i]["tokens_per_s"]
        px = [_peak(cells[i]) / GIB for i in order]
        pareto = [
            Series("cells", [cells[i]["tokens_per_s"] for i in order], "#3b6fb6", "points"),
            Series("Pareto front", [cells[i]["tokens_per_s"] if i in front else None for i in order], "#c0392b"),
        ]
        page.section(
            "tokens/s against peak memory",
            page.chart(
                "pareto",
                "no cell on the front is beaten by one faster with less memory",
                px,
                "peak GiB",
                pareto,
                "tokens/s",
                hover="cells",
                order=order,
            ),
            section_id="pareto-section",
        )
    return page
