"""``memfit frag SNAPSHOT``: fragmentation numbers, per-segment breakdown and PNG plots."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from memfit.allocator.layout import Moment, Rebuilt
from memfit.allocator.simulation import Simulation
from memfit.allocator.simulation import simulate as replay_scenarios
from memfit.allocator.snapshot import FragReport, analyze, devices_in, load_snapshot, quantities
from memfit.allocator.whatif import MIN_GAIN, Replay, not_here
from memfit.errors import UserError
from memfit.train.disk import check_creatable
from memfit.units import GIB, MIB, parse_memory


def _peak_dict(peak: Moment | None) -> dict | None:
    if peak is None:
        return None
    return {
        **peak.report.as_dict(),
        "trace_entry": peak.index,
        "time_us": peak.time_us,
        "inferred_blocks": peak.inferred_blocks,
    }


def open_snapshot(path: str, device: int | None) -> tuple[dict[str, Any], FragReport, Rebuilt]:
    """The snapshot at ``path``, the numbers of ``device`` (default: the first) at the dump, and its trace rebuilt
    (``memfit frag`` and ``memfit report``).

    Raises:
        UserError: an unreadable snapshot, or a device it has no segments on.
    """
    snap = load_snapshot(path)
    devices = devices_in(snap)
    device = device if device is not None else devices[0]
    if device not in devices:
        raise UserError(f"--device {device}: the snapshot has segments on device(s) {', '.join(map(str, devices))}")
    return snap, analyze(snap, device, where=path), Rebuilt(snap, device)


def check_replay_options(ns) -> None:
    """``--capacity``, ``--hip-version`` and ``--torch-version`` shape the ``--simulate`` replay: refused without it
    (they were ignored in silence), and a capacity that is no size is refused before anything is read."""
    keys = ("capacity", "hip_version", "torch_version")
    given = [f"--{k.replace('_', '-')} {v}" for k in keys if (v := getattr(ns, k, None)) is not None]
    if given and not ns.simulate:
        these, them = ("these", "them") if len(given) > 1 else ("this", "it")
        raise UserError(f"{', '.join(given)}: only --simulate reads {these}; add --simulate, or leave {them} out")
    if getattr(ns, "capacity", None) is not None:
        parse_memory(ns.capacity, "--capacity")


def scenarios(snap: dict[str, Any], report: FragReport, rebuilt: Rebuilt, where: str, ns) -> Simulation:
    """``--simulate``: the trace replayed under every allocator scenario, with ``--capacity``, judged for
    ``--hip-version`` and ``--torch-version`` (default: this build)."""
    import torch

    capacity = parse_memory(ns.capacity, "--capacity") if ns.capacity else None
    hip = ns.hip_version if ns.hip_version is not None else torch.version.hip
    torch_version = ns.torch_version or torch.__version__
    return replay_scenarios(snap, report, rebuilt, where, capacity, hip, torch_version)


def run(ns) -> int:
    if ns.top < 0:
        raise UserError(f"--top must be >= 0 (got {ns.top})")
    check_replay_options(ns)
    snap, report, rebuilt = open_snapshot(ns.snapshot, ns.device)
    device = report.device
    points = rebuilt.totals()
    peak = rebuilt.peak()
    out_dir = Path(ns.out) if ns.out else Path(str(ns.snapshot) + ".frag")
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--out {out_dir} is a file; give a directory for the plots")
    check_creatable(out_dir, "--out")
    out_dir.mkdir(parents=True, exist_ok=True)
    from memfit.telemetry.plots import memory_timeline, segment_map

    pngs = [segment_map(report, out_dir / f"segments_device{device}.png", "at the dump")]
    if peak is not None:
        pngs.append(
            segment_map(
                peak.report,
                out_dir / f"segments_at_peak_device{device}.png",
                f"at peak allocated (trace entry {peak.index})",
            )
        )
        pngs.append(
            memory_timeline(
                points,
                out_dir / f"timeline_device{device}.png",
                f"{Path(ns.snapshot).name}, device {device}: allocated vs reserved",
                peak,
            )
        )
    ooms = rebuilt.ooms()
    sim, sim_plot = simulate(snap, report, ns, out_dir, rebuilt) if ns.simulate else (None, None)
    if ns.json:
        print(
            json.dumps(
                {
                    **report.as_dict(),
                    "at_peak": _peak_dict(peak),
                    "ooms": len(ooms),
                    "oom_details": [o.as_dict() for o in ooms],
                    "plots": [str(p) for p in pngs],
                    "simulate": {**sim.as_dict(), "plot": str(sim_plot)} if sim else None,
                }
            )
        )
        return 0
    console = Console() if sys.stdout.isatty() else Console(width=130)
    t = Table(title=f"{ns.snapshot}: device {device}")
    t.add_column("quantity")
    t.add_column("at the dump", justify="right")
    if peak is not None:
        t.add_column(f"at peak (entry {peak.index})", justify="right")
    t.add_column("meaning")
    at_peak = quantities(peak.report) if peak is not None else None
    for i, (name, value, meaning) in enumerate(quantities(report)):
        t.add_row(name, value, *([at_peak[i][1]] if at_peak else []), meaning)
    console.print(t)
    if peak is not None and peak.inferred_blocks:
        console.print(
            f"note: live at the peak and freed before the dump: {peak.inferred_blocks} block(s); their sizes "
            "follow from the allocator's rounding and split rules",
            highlight=False,
        )
    seg = Table(title="largest segments at the dump")
    for col in ("address", "type", "size MiB", "allocated MiB", "free MiB", "largest free MiB", "blocks"):
        seg.add_column(col, justify="right")
    for s in sorted(report.segments, key=lambda s: s.total_bytes, reverse=True)[: ns.top or None]:
        seg.add_row(
            hex(s.address),
            s.segment_type,
            f"{s.total_bytes / MIB:.1f}",
            f"{s.allocated_bytes / MIB:.1f}",
            f"{(s.total_bytes - s.allocated_bytes) / MIB:.1f}",
            f"{s.largest_free_bytes / MIB:.1f}",
            str(len(s.blocks)),
        )
    console.print(seg)
    for o in ooms:
        console.print(o.explain(), highlight=False)
    for p in pngs:
        console.print(f"wrote {p}", highlight=False)
    if sim is not None:
        render_simulation(sim, console)
        console.print(f"wrote {sim_plot}", highlight=False)
    return 0


def render_whatif(
    results: list[Replay],
    best: Replay | None,
    hip: str | None,
    console: Console,
    title: str,
    rocm: bool | None = None,
    torch_version: str | None = None,
) -> None:
    """The what-if table (one row per allocator setting) and the recommendation, in the variable of a
    ROCm stack when ``rocm`` (default: when ``hip`` is given); settings not to take on the build (``hip``,
    ``torch_version``) are marked and their reasons printed below."""
    t = Table(title=title)
    for col in ("settings", "peak reserved GiB", "peak allocated GiB", "segments mapped", "retries", "OOM", "note"):
        t.add_column(col, justify="left" if col in ("settings", "note") else "right")
    for r in results:
        t.add_row(
            r.settings.label(),
            f"{r.peak_reserved_bytes / GIB:.3f}",
            f"{r.peak_allocated_bytes / GIB:.3f}",
            str(r.segment_allocs),
            str(r.alloc_retries),
            "yes" if r.oom else "no",
            ("not here" if not_here(r.settings, hip, torch_version) else "") + ("recommended" if r is best else ""),
        )
    console.print(t)
    for reason in sorted({not_here(r.settings, hip, torch_version) for r in results} - {None}):
        console.print(f"note: {reason}", highlight=False)
    if best is not None:
        var = f"PYTORCH_{'HIP' if (hip is not None if rocm is None else rocm) else 'CUDA'}_ALLOC_CONF"
        conf, fraction = best.settings.conf(), best.settings.memory_fraction
        advice = [f"{var}={conf}"] if conf else []
        if fraction is not None:
            advice.append(f"allocator.memory_fraction={fraction} (torch.cuda.set_per_process_memory_fraction)")
        console.print(
            f"recommendation: {' and '.join(advice)}"
            if advice
            else "recommendation: keep the default settings (no other setting retries less or saves "
            f"{MIN_GAIN:.0%} of peak reserved memory)",
            highlight=False,
        )
    else:
        console.print("recommendation: none; every applicable setting runs out of memory", highlight=False)


def simulate(snap: dict[str, Any], report: FragReport, ns, out_dir: Path, rebuilt: Rebuilt) -> tuple[Simulation, Path]:
    """Replay the snapshot's trace under several allocator settings, side by side, and plot it."""
    from memfit.telemetry.plots import whatif_timeline

    sim = scenarios(snap, report, rebuilt, str(ns.snapshot), ns)
    plot = whatif_timeline(
        sim.results,
        out_dir / f"whatif_device{report.device}.png",
        f"{Path(ns.snapshot).name}: {sim.title}",
        sim.capacity_bytes,
    )
    return sim, plot


def render_simulation(sim: Simulation, console: Console) -> None:
    check = sim.check
    if sim.prefix_blocks:
        console.print(
            f"recording began with {sim.prefix_blocks} blocks ({sim.prefix_bytes / GIB:.3f} GiB) alive: every "
            "replay allocates them first, into an empty cache",
            highlight=False,
        )
    if check.unmatched_frees:
        console.print(
            f"note: {check.unmatched_frees} frees of blocks that neither the trace nor the dump's layout "
            "accounts for; the replay misses those blocks",
            highlight=False,
        )
    console.print(
        f"model check ({sim.ran_with.label()} settings, as the snapshot was taken): peak reserved "
        f"{check.model_peak_reserved_bytes / GIB:.3f} GiB in the replay, {check.trace_peak_reserved_bytes / GIB:.3f} "
        f"GiB in the trace ({100 * check.peak_reserved_error:+.1f}%); at the dump "
        f"{check.model_reserved_bytes / GIB:.3f} "
        f"GiB in {check.model_segments} segments, the allocator held {check.snapshot_reserved_bytes / GIB:.3f} GiB in "
        f"{check.snapshot_segments}",
        highlight=False,
    )
    render_whatif(sim.results, sim.best, sim.hip, console, sim.title, torch_version=sim.torch_version)
