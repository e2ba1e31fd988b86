"""The HTML page of a run directory: loss, learning rate and tokens/s over steps, memory over steps (allocated,
reserved and fragmentation ratio on a GPU; resident memory on a CPU) beside the planner's prediction, the events
(restarts, out-of-memory switches), the summary and the config that ran.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from memfit.config.loader import json_value
from memfit.errors import UserError
from memfit.pages.html import Cell, Page, Series, key_values, paragraph, pre, table
from memfit.units import GIB

GPU_MEMORY = (
    ("allocated_bytes", "allocated (end of step)", "#3b6fb6", False),
    ("reserved_bytes", "reserved (end of step)", "#c0392b", False),
    ("peak_allocated_bytes", "peak allocated", "#1f4e8c", True),
    ("peak_reserved_bytes", "peak reserved", "#8e1b10", True),
)
CPU_MEMORY = (
    ("rss_bytes", "RSS (end of step)", "#3b6fb6", False),
    ("peak_rss_bytes", "peak RSS", "#c0392b", True),
)
VERSUS = (
    ("step tensor peak (torch.profiler / allocator)", "predicted_peak_bytes", "profiled_peak_bytes"),
    ("peak allocated", "predicted_peak_bytes", "peak_allocated_bytes"),
    ("peak reserved (allocator model)", "modelled_peak_reserved_bytes", "peak_reserved_bytes"),
    ("host memory", "predicted_host_bytes", "host_state_bytes"),
)


def read_run(run_dir: Path) -> tuple[list[dict[str, Any]], int]:
    """The records of ``run_dir/metrics.jsonl`` and how many unreadable lines were skipped (a killed run's torn
    last line).

    Raises:
        UserError: no metrics file, or no record in it.
    """
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"'{run_dir}' has no metrics.jsonl: give a run directory that memfit train wrote")
    records, skipped = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            rec = json_value(line)
        except json.JSONDecodeError:
            skipped += 1
            continue
        if isinstance(rec, dict):
            records.append(rec)
        else:
            skipped += 1
    if not records:
        raise UserError(f"'{path}' holds no readable record; has the run logged a step yet?")
    return records, skipped


def _value(key: str, v: Any) -> str:
    if key.endswith("_bytes") and isinstance(v, int) and not isinstance(v, bool):
        return f"{v / GIB:.3f} GiB ({v:,} bytes)"
    if isinstance(v, float):
        return f"{v:.6g}"
    return json.dumps(v) if isinstance(v, (list, dict)) else str(v)


def _column(steps: list[dict[str, Any]], key: str, scale: float = 1.0) -> list[float | None]:
    return [None if not isinstance(r.get(key), (int, float)) else r[key] / scale for r in steps]


MAX_POINTS = 10_000
"""Steps drawn at most per chart: a longer run keeps one step per bucket of consecutive steps (the one with the
highest memory peak, so the peaks stay), and every evaluated step."""
PEAK_KEYS = ("peak_reserved_bytes", "peak_allocated_bytes", "peak_rss_bytes", "reserved_bytes", "rss_bytes")


def _drawn(x: list[int], by_step: dict[int, dict[str, Any]], eval_at: dict[int, Any]) -> tuple[list[int], int]:
    """The steps of ``x`` to draw and the bucket size (1: all of them)."""
    size = -(-len(x) // MAX_POINTS)
    if size == 1:
        return x, 1

    def peak(step: int) -> float:
        values = [by_step.get(step, {}).get(k) for k in PEAK_KEYS]
        return max((v for v in values if isinstance(v, (int, float))), default=float("-inf"))

    kept = {max(x[i : i + size], key=peak) for i in range(0, len(x), size)}
    return sorted(kept | set(eval_at) | {x[0], x[-1]}), size


def _row(what: str, predicted: float, measured: float, unit: str, scale: float) -> list[Any]:
    return [
        what,
        Cell(f"{predicted / scale:.3f} {unit}", predicted),
        Cell(f"{measured / scale:.3f} {unit}", measured),
        Cell(f"{100 * (predicted - measured) / measured:+.2f}", (predicted - measured) / measured),
    ]


def _versus(summary: dict[str, Any]) -> str:
    rows = []
    for what, predicted_key, measured_key in VERSUS:
        p, m = summary.get(predicted_key), summary.get(measured_key)
        if isinstance(p, (int, float)) and isinstance(m, (int, float)) and m:
            rows.append(_row(what, p, m, "GiB", GIB))
    p, base, m = (summary.get(k) for k in ("predicted_peak_bytes", "baseline_rss_bytes", "peak_rss_bytes"))
    if not rows and all(isinstance(v, int) for v in (p, base, m)) and m:  # a CPU run: tensors + the runtime's RSS
        rows.append(_row("process peak (tensors + RSS before model load)", p + base, m, "GiB", GIB))
    p, m = summary.get("predicted_step_time_s"), summary.get("median_step_time_s")
    if isinstance(p, (int, float)) and isinstance(m, (int, float)) and m:  # the cost model ranks; see plan.md
        rows.append(_row("step time (cost model, for ranking)", p, m, "s", 1.0))
    if not rows:
        return paragraph("no prediction and measurement of the same quantity in this run's summary", "note")
    return table(["quantity", "predicted", "measured", "error %"], rows, table_id="versus")


def run_page(run_dir: Path) -> Page:
    """The page of one run directory."""
    records, skipped = read_run(run_dir)
    steps = [r for r in records if r.get("kind") == "step" and isinstance(r.get("step"), int)]
    evals = [
        r
        for r in records
        if r.get("kind") == "eval" and isinstance(r.get("step"), int) and isinstance(r.get("eval_loss"), (int, float))
    ]
    summary = next((r for r in reversed(records) if r.get("kind") == "summary"), {})
    events = [r for r in records if r.get("kind") not in ("step", "eval", "summary")]
    page = Page(
        f"memfit run: {run_dir.resolve().name}",
        "run",
        f"{len(steps)} steps logged"
        + (f", eval loss {evals[0]['eval_loss']:.4f} -> {evals[-1]['eval_loss']:.4f}" if len(evals) > 1 else "")
        + (f"; {skipped} unreadable line(s) skipped" if skipped else ""),
    )
    page.section("plan against measurement", _versus(summary), section_id="versus-section")
    if steps:
        by_step = {r["step"]: r for r in steps}
        eval_at = {r["step"]: r.get("eval_loss") for r in evals}
        x, bucket = _drawn(sorted(set(by_step) | set(eval_at)), by_step, eval_at)
        rows = [by_step.get(s, {}) for s in x]
        loss = [
            Series("train loss", _column(rows, "loss"), "#3b6fb6"),
            Series("eval loss", [eval_at.get(s) for s in x], "#c0392b", dash=True),
            Series("learning rate", _column(rows, "lr"), "#95a5a6", scale="y2"),
        ]
        speed = [Series("tokens/s", _column(rows, "tokens_per_s"), "#2e8b57")]
        if any(r.get("supervised_tokens_per_s") != r.get("tokens_per_s") for r in steps):
            speed.append(Series("supervised tokens/s", _column(rows, "supervised_tokens_per_s"), "#7d3c98"))
        speed.append(Series("step s", _column(rows, "step_time_s"), "#8c6d31", scale="y2"))
        on_gpu = any("peak_allocated_bytes" in r for r in steps)
        memory = [
            Series(label, _column(rows, key, GIB), color, "line", dash)
            for key, label, color, dash in (GPU_MEMORY if on_gpu else CPU_MEMORY)
            if any(key in r for r in steps)
        ]
        predicted = summary.get("predicted_peak_bytes")
        if isinstance(predicted, (int, float)):
            memory.append(
                Series(
                    "planner's predicted peak" + ("" if on_gpu else " (tensors)"),
                    [predicted / GIB] * len(x),
                    "#1d2330",
                    dash=True,
                )
            )
        frag = any("fragmentation_ratio" in r for r in steps)
        if frag:
            memory.append(
                Series("fragmentation ratio", _column(rows, "fragmentation_ratio"), "#e59b2e", "points", scale="y2")
            )
        page.section(
            "over steps",
            paragraph(
                "drag to zoom, double-click to reset"
                + (
                    f"; {len(by_step):,} steps logged, one drawn per {bucket} (the highest memory peak of each run of "
                    f"{bucket}) and every evaluated step"
                    if bucket > 1
                    else ""
                ),
                "note",
            ),
            page.chart(
                "loss", "loss and learning rate", x, "step", loss, "loss", y2_label="learning rate", hover="steps"
            ),
            page.chart("speed", "throughput", x, "step", speed, "tokens/s", y2_label="step s", hover="steps"),
            page.chart(
                "memory",
                "memory" + (" (GPU)" if on_gpu else " (CPU process)"),
                x,
                "step",
                memory,
                "GiB",
                y2_label="fragmentation ratio" if frag else None,
                hover="steps",
            ),
            section_id="steps-section",
        )
    if events:
        page.section(
            "events",
            table(
                ["kind", "step", "record"],
                [[e.get("kind"), e.get("step", ""), json.dumps(e)] for e in events],
                table_id="events",
            ),
        )
    if summary:
        page.section(
            "summary", key_values([(k, _value(k, v)) for k, v in summary.items() if k != "kind"]), section_id="summary"
        )
    for name, heading in (("config.yaml", "config that ran"), ("auto-plan.json", "the plan --auto chose from")):
        path = run_dir / name
        if path.is_file():
            page.section(f"{heading} ({name})", pre(path.read_text(encoding="utf-8", errors="replace")))
    return page
