"""``memfit doctor``: the platform report (``memfit.telemetry.platform``) as a table or JSON; exit 1 on a problem."""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console
from rich.table import Table

from memfit.telemetry.platform import report
from memfit.units import GIB


def run(ns) -> int:
    r = report()
    if ns.json:
        print(json.dumps(r))
    else:
        render(r, Console())
    return 1 if r["problems"] else 0


def numa_line(nodes: list[dict[str, Any]]) -> str:
    if not nodes:
        return "no NUMA information (not Linux, or sysfs lists no node)"
    parts = [
        f"node {n['index']}: CPUs {n['cpus'] or '?'}"
        + (f", {n['memory_bytes'] / GIB:.0f} GiB" if n["memory_bytes"] is not None else "")
        for n in nodes
    ]
    return f"{len(nodes)} node(s): " + "; ".join(parts)


def render(r: dict[str, Any], console) -> None:
    t = Table(title="memfit doctor", show_header=False)
    t.add_column("what")
    t.add_column("value")
    t.add_row("torch", f"{r['torch']} ({r['build']}), Python {r['python']}, CPU {r['cpu_capability']}")
    if not r["devices"]:
        t.add_row("devices", "no GPU visible (CPU: fp32 and bf16 autocast; fp16-mixed unavailable)")
    for d in r["devices"]:
        t.add_row(
            f"device {d['index']}",
            f"{d['name']} [{d['arch']}], {d['memory_bytes'] / GIB:.1f} GiB, "
            f"bf16 {d['bf16']}, fp16 {d['fp16']}, TF32 {d['tf32']}, "
            + ("NUMA node unknown" if d.get("numa_node") is None else f"NUMA node {d['numa_node']}"),
        )
    t.add_row("NUMA", numa_line(r.get("numa_nodes", [])))
    t.add_row("collectives", ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in r["collectives"].items()))
    t.add_row("extras", ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in r["extras"].items()))
    if not r["allocator"]:
        t.add_row("allocator", "defaults (no PYTORCH_*ALLOC_CONF set)")
    for var, a in r["allocator"].items():
        t.add_row(var, f"{a['value']} -> {a['settings']}")
    if r["hip"]:
        e = r["expandable_segments"]
        verdict = {True: "taken", False: "ignored", None: "depends on the build"}[e["expected"]]
        why = f": {e['why']}" if e["why"] else ""
        t.add_row("expandable_segments", f"{verdict}{why}; {e.get('probe', 'no live probe (no GPU)')}")
    console.print(t)
    for w in r["warnings"]:
        console.print(f"warning: {w}", highlight=False)
    for p in r["problems"]:
        console.print(f"problem: {p}", highlight=False)
