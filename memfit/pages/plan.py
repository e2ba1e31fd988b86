"""The HTML page of a plan (``memfit plan --json``'s data): every fitting candidate in a sortable table, the
breakdown by phase and category of the one clicked, and the closest candidates that do not fit.

The columns are the strategy vocabulary's levers (``memfit.config.strategy.levers``): a new lever shows up here
without a change.
"""

from __future__ import annotations

from typing import Any

from memfit.config.strategy import levers
from memfit.errors import UserError
from memfit.pages.html import Cell, Page, key_values, paragraph, table
from memfit.planner.categories import DEVICE_CATEGORIES, Category
from memfit.units import GIB

CLOSEST_SHOWN = 20
COLORS = {
    "params": "#3b6fb6",
    "grads": "#e59b2e",
    "optimizer": "#7d3c98",
    "activations": "#2e8b57",
    "temporaries": "#95a5a6",
    "host": "#8c6d31",
    "host_state": "#c0392b",
}
LIMITS = {"max_seq_len": "max seq", "max_micro_batch": "max mb"}


def _gib(n: int | None) -> Cell:
    return Cell("" if n is None else f"{n / GIB:.2f}", None if n is None else n)


def _label(c: dict[str, Any]) -> str:
    return ", ".join(f"{name}={c[name]}" for name in levers() if name in c)


def check_plan(data: Any, where: str) -> None:
    """Raises UserError unless ``data`` is ``memfit plan --json`` output."""
    keys = (
        "model",
        "gpu",
        "gpu_memory_bytes",
        "gpus_per_node",
        "nodes",
        "seq_len",
        "global_batch",
        "fitting",
        "pruned",
    )
    if not isinstance(data, dict) or any(k not in data for k in keys) or not isinstance(data["fitting"], list):
        raise UserError(f"'{where}' is not the output of memfit plan --json (it lacks {', '.join(keys)})")
    if not isinstance(data["pruned"], list):
        raise UserError(f"'{where}': 'pruned' is not a list; write it again with memfit plan --json")
    for c in (*data["fitting"], *data["pruned"]):
        if not isinstance(c, dict) or not isinstance(c.get("phase_peaks_bytes"), dict) or "peak_bytes" not in c:
            raise UserError(f"'{where}': a candidate has no phase_peaks_bytes; write it again with memfit plan --json")


def _candidate_rows(cands: list[dict[str, Any]], shown: list[str], usable_bytes: bool) -> tuple[list[str], list[list]]:
    limits = [k for k in LIMITS if any(k in c for c in cands)]
    header = ["#", *(n.replace("_", " ") for n in shown)]
    header += [c.value for c in Category] + ["peak", "reserved*", "free" if usable_bytes else "over by", "step s"]
    header += [LIMITS[k] for k in limits]
    rows = []
    for i, c in enumerate(cands, 1):
        cats = c.get("peak_by_category_bytes", {})
        room = c.get("usable_bytes", 0) - c.get("predicted_reserved_bytes", 0)
        row: list[Any] = [i, *(Cell(str(c.get(n)), None) for n in shown)]
        row += [_gib(cats.get(cat.value, 0)) for cat in Category]
        row += [
            _gib(c.get("peak_bytes")),
            _gib(c.get("predicted_reserved_bytes")),
            _gib(room if usable_bytes else -room),
        ]
        t = c.get("estimated_step_time_s")
        row.append(Cell("" if t is None else f"{t:.3f}", t))
        for k in limits:
            lim = c.get(k) or {}
            value = lim.get("value")
            row.append(Cell("" if value is None else f"{value}{'+' if lim.get('at_ceiling') else ''}", value))
        rows.append(row)
    return header, rows


def plan_page(data: dict[str, Any], where: str) -> Page:
    """The page of one plan (``where``: the JSON file, or the command that made it)."""
    check_plan(data, where)
    fitting, pruned = data["fitting"], data["pruned"]
    every = [*fitting, *pruned]
    shown = [n for n in levers() if len({str(c.get(n)) for c in every}) > 1] or [n for n in levers() if n in every[0]]
    gpus = data["gpus_per_node"] * data["nodes"]
    page = Page(
        f"memfit plan: {data['model']} on {gpus} x {data['gpu']}",
        "plan",
        f"{len(fitting)} candidates fit, {len(pruned)} do not; sequence {data['seq_len']}, global batch "
        f"{data['global_batch']}, {'LoRA' if data.get('lora') else 'full fine-tune'}",
    )
    lora = data.get("lora_config") or {}
    page.section(
        "the question",
        key_values(
            [
                ("model", data["model"]),
                ("device", f"{data['gpu']}, {data['gpu_memory_bytes'] / GIB:.2f} GiB"),
                ("GPUs", f"{data['nodes']} node(s) x {data['gpus_per_node']}"),
                (
                    "host memory per node",
                    "" if not data.get("host_mem_bytes") else f"{data['host_mem_bytes'] / GIB:.1f} GiB",
                ),
                ("sequence length, global batch", f"{data['seq_len']}, {data['global_batch']}"),
                ("LoRA", ", ".join(f"{k} {v}" for k, v in lora.items()) if lora else "no (full fine-tune)"),
                ("headroom, allocator margin", f"{data.get('headroom')}, {data.get('allocator_margin')}"),
                ("step time model", data.get("assumptions", "")),
                ("traces (from the cache)", f"{data.get('traces')} ({data.get('cached_traces')})"),
            ]
        ),
    )
    page.data["candidates"] = [
        {
            "label": _label(c),
            "peak_bytes": c["peak_bytes"],
            "peak_phase": c.get("peak_phase", ""),
            "host_peak_bytes": c.get("host_peak_bytes", 0),
            "phase_peaks_bytes": c["phase_peaks_bytes"],
        }
        for c in fitting
    ]
    page.data["categories"] = [c.value for c in Category]
    page.data["device_categories"] = [c.value for c in DEVICE_CATEGORIES]
    page.data["colors"] = COLORS
    if fitting:
        header, rows = _candidate_rows(fitting, shown, True)
        page.section(
            "candidates that fit",
            paragraph(
                "GiB per rank at the step's peak, by category; reserved* is the allocator's predicted reservation; "
                "click a header to sort, a row for its breakdown by phase",
                "note",
            ),
            '<div class="scroll">'
            + table(header, rows, table_id="candidates", row_ids=[str(i) for i in range(len(rows))]),
            "</div>",
            section_id="fitting",
        )
        page.section("breakdown of the chosen candidate", '<div id="breakdown"></div>', section_id="breakdown-section")
    else:
        page.section("candidates that fit", paragraph("nothing fits", "verdict bad"), section_id="fitting")
    if pruned:
        header, rows = _candidate_rows(pruned[:CLOSEST_SHOWN], shown, False)
        header.append("why not")
        for row, c in zip(rows, pruned):
            row.append(Cell(c.get("reason", ""), None))
        page.section(
            f"closest that do not fit ({min(len(pruned), CLOSEST_SHOWN)} of {len(pruned)})",
            f'<div class="scroll">{table(header, rows, table_id="closest")}</div>',
            section_id="closest-section",
        )
    return page
