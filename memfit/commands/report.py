"""``memfit report PATH``: one offline HTML page for a run directory, a memory snapshot, a plan (the JSON of
``memfit plan --json``) or a ``memfit bench`` directory, chosen by what PATH holds."""

from __future__ import annotations

import json
from pathlib import Path

from memfit.config.loader import json_value
from memfit.errors import UserError, not_a_file
from memfit.pages.html import write_page

KINDS = "a run directory (metrics.jsonl), a bench directory (results.json), a snapshot pickle or plan JSON"


def kind_of(path: Path) -> str:
    """run | bench | snapshot | plan, from what ``path`` holds.

    Raises:
        UserError: a path that does not exist or holds none of them.
    """
    if path.is_dir():
        if (path / "metrics.jsonl").is_file():
            return "run"
        if (path / "results.json").is_file():
            return "bench"
        raise UserError(f"'{path}' holds neither metrics.jsonl nor results.json; give {KINDS}")
    if not path.is_file():
        raise UserError(f"'{path}' {not_a_file(path)}; give {KINDS}")
    with path.open("rb") as fh:
        head = fh.read(2)
    if head[:1] == b"\x80" or head == b"\x1f\x8b":  # a pickle's protocol byte, or gzip
        return "snapshot"
    if head[:1] in (b"{", b"[") or path.suffix == ".json":
        return "plan"
    raise UserError(f"'{path}' is neither a pickle nor JSON; give {KINDS}")


def default_out(path: Path, kind: str) -> Path:
    return path / "report.html" if kind in ("run", "bench") else path.with_name(path.name + ".html")


def build(path: Path, kind: str, ns):
    """The page of ``path`` (its ``kind``)."""
    if kind == "run":
        from memfit.pages.run import run_page

        return run_page(path)
    if kind == "bench":
        from memfit.pages.bench import bench_page

        return bench_page(path)
    if kind == "plan":
        from memfit.pages.plan import plan_page

        try:
            data = json_value(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"'{path}' is not readable JSON ({e}); write it with memfit plan ... --json > plan.json")
        return plan_page(data, str(path))
    return _snapshot(path, ns)


def _snapshot(path: Path, ns):
    from memfit.commands.frag import check_replay_options, open_snapshot, scenarios
    from memfit.pages.snapshot import snapshot_page

    check_replay_options(ns)
    snap, report, rebuilt = open_snapshot(str(path), ns.device)
    sim = scenarios(snap, report, rebuilt, str(path), ns) if ns.simulate else None
    return snapshot_page(snap, report.device, str(path), report, rebuilt, sim)


def run(ns) -> int:
    if not ns.path.strip():
        raise UserError(f"memfit report needs a path, not an empty one; give {KINDS}")
    path = Path(ns.path)
    if path.name == "metrics.jsonl" and path.is_file():
        path = path.parent  # a run's own metrics file: the run's page
    kind = kind_of(path)
    if kind != "snapshot" and (ns.simulate or ns.capacity or ns.device is not None):
        raise UserError(f"--simulate, --capacity and --device read a snapshot; '{path}' is a {kind}")
    out = Path(ns.out) if ns.out else default_out(path, kind)
    written = write_page(build(path, kind, ns), out)
    print(f"wrote {written} ({kind} page, {written.stat().st_size / 1024:.0f} KiB, works offline)")
    return 0
