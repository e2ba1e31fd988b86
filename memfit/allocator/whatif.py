"""Replay a recorded allocator trace under other settings and say which one helps.

The trace is a snapshot's ``device_traces[d]`` (``alloc`` / ``free_completed`` entries with address,
size and stream). Blocks allocated before recording started are not in the trace: the layout rebuilt
from the dump (``layout.Rebuilt``) names those still alive when it began, and a replay allocates them
first (``live_at_start``). The cache the process had built by then is not known under other settings;
a replay starts it empty.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from memfit.allocator.conf import UNSAFE_ON_ROCM, expandable_takes_effect, parse
from memfit.allocator.layout import Rebuilt
from memfit.allocator.model import AllocatorSettings, CachingAllocatorModel, OutOfMemory
from memfit.allocator.snapshot import analyze
from memfit.errors import UserError

SCENARIOS = (
    AllocatorSettings(),
    AllocatorSettings(expandable_segments=True),
    AllocatorSettings(expandable_segments=True, max_split_size_mb=512),  # unsafe on ROCm: shown, never advised
    AllocatorSettings(max_split_size_mb=128),
    AllocatorSettings(max_split_size_mb=512),
    AllocatorSettings(roundup_power2_divisions=4),
    AllocatorSettings(garbage_collection_threshold=0.8, memory_fraction=0.95),
)


@dataclass(frozen=True)
class SeriesPoint:
    """The model after one trace entry."""

    index: int
    reserved_bytes: int
    allocated_bytes: int
    fragmentation_ratio: float
    alloc_retries: int


@dataclass(frozen=True)
class Replay:
    settings: AllocatorSettings
    peak_reserved_bytes: int
    peak_allocated_bytes: int
    segment_allocs: int
    alloc_retries: int
    oom: bool
    fragmentation_at_end: float
    events: int
    series: tuple[SeriesPoint, ...] = ()  # after every alloc / free entry (and the failing one on OOM)


SERIES_POINTS = 20_000  # about this many points over time per replay (plus every change of reserved)


def _replayed(
    entries: list[dict[str, Any]],
    settings: AllocatorSettings,
    capacity: int,
    series: list[SeriesPoint] | None = None,
    prefix: Sequence[tuple[int, tuple[int, int]]] = (),
) -> tuple[CachingAllocatorModel, bool, int, int]:
    """The model after the ``prefix`` allocations ((address, (requested bytes, stream)) of the blocks
    alive when recording began, see ``live_at_start``) and the trace's ``alloc`` / ``free_completed`` entries:
    (model, OOM, entries replayed, frees of addresses neither the trace nor the prefix allocated);
    ``series`` collects the model's state after alloc / free entries: every one on traces of up to
    SERIES_POINTS entries, on longer ones every n-th and each that changed reserved memory.

    Where the trace releases segments the model empties its cache: the program's ``empty_cache()``
    and the allocator's release before a retry (``release_cached_blocks``) both free every wholly
    free segment. Known limitation: garbage collection and the oversize release free fewer, so a
    trace made with ``garbage_collection_threshold`` or ``max_split_size_mb`` replays with less cache."""
    model = CachingAllocatorModel(capacity, settings)
    live: dict[int, object] = {}
    oom, n, unmatched, released = False, 0, 0, False
    try:
        for addr, (requested, stream) in prefix:
            live[addr] = model.malloc(requested, stream)
    except OutOfMemory:
        return model, True, 0, 0
    every, last_reserved = max(1, len(entries) // SERIES_POINTS), -1
    for i, e in enumerate(entries):
        action = e.get("action")
        if action in ("segment_free", "segment_unmap"):
            released = True
        elif released:
            model.empty_cache()
            released = False
        if action == "alloc":
            try:
                live[e["addr"]] = model.malloc(int(e["size"]), int(e.get("stream", 0)))
            except OutOfMemory:
                oom = True
        elif action == "free_completed":
            if e.get("addr") in live:
                model.free(live.pop(e["addr"]))
            else:
                unmatched += 1
        if (
            series is not None
            and action in ("alloc", "free_completed")
            and (i % every == 0 or oom or model.reserved != last_reserved or i == len(entries) - 1)
        ):
            series.append(
                SeriesPoint(i, model.reserved, model.allocated, model.fragmentation_ratio(), model.num_alloc_retries)
            )
            last_reserved = model.reserved
        if oom:
            break
        n += 1
    if released and not oom:
        model.empty_cache()
    return model, oom, n, unmatched


def replay(
    entries: list[dict[str, Any]],
    settings: AllocatorSettings,
    capacity: int,
    prefix: Sequence[tuple[int, tuple[int, int]]] = (),
) -> Replay:
    series: list[SeriesPoint] = []
    model, oom, n, _ = _replayed(entries, settings, capacity, series, prefix)
    return Replay(
        settings,
        model.peak_reserved,
        model.peak_allocated,
        model.segment_allocs,
        model.num_alloc_retries,
        oom,
        model.fragmentation_ratio(),
        n,
        tuple(series),
    )


@dataclass(frozen=True)
class TraceCheck:
    """The model's replay of a snapshot's trace beside the allocator's own numbers: its state at the
    dump, and its peak reserved over the trace (exact: from the trace's segment events)."""

    model_reserved_bytes: int
    snapshot_reserved_bytes: int
    model_segments: int
    snapshot_segments: int
    model_peak_reserved_bytes: int
    model_peak_allocated_bytes: int
    events: int
    unmatched_frees: int  # > 0: recording started after some allocations, the replay misses them
    trace_peak_reserved_bytes: int = 0

    @property
    def reserved_error(self) -> float:
        return (self.model_reserved_bytes - self.snapshot_reserved_bytes) / max(self.snapshot_reserved_bytes, 1)

    @property
    def peak_reserved_error(self) -> float:
        return (self.model_peak_reserved_bytes - self.trace_peak_reserved_bytes) / max(
            self.trace_peak_reserved_bytes, 1
        )


def trace_entries(snap: dict[str, Any], device: int, where: str = "the snapshot") -> list[dict[str, Any]]:
    """``device``'s allocator trace in ``snap``.

    Raises:
        UserError: when it holds no allocation (history was not recorded).
    """

    traces = snap.get("device_traces") or []
    entries = traces[device] if device < len(traces) else []
    if not any(e.get("action") == "alloc" for e in entries):
        raise UserError(
            f"{where} has no alloc entries for device {device}; record with "
            "torch.cuda.memory._record_memory_history() before the workload"
        )
    return entries


def replay_check(
    snap: dict[str, Any], device: int, settings: AllocatorSettings, rebuilt: "Rebuilt | None" = None
) -> TraceCheck:
    """Replay ``device``'s whole trace under ``settings`` (those the process ran with) and set the
    model's end state beside the snapshot's segments, and its peak reserved beside the trace's: how
    far to trust the model on this workload. ``rebuilt``: the snapshot's ``layout.Rebuilt`` for
    ``device`` when the caller has one (its reserved timeline comes from segment events alone).

    Raises:
        UserError: when the snapshot holds no trace for ``device``.
    """

    rebuilt = rebuilt if rebuilt is not None else Rebuilt(snap, device, settings)
    model, _, n, unmatched = _replayed(trace_entries(snap, device), settings, 1 << 62, prefix=live_at_start(rebuilt))
    report = analyze(snap, device)
    trace_peak = max(p.reserved_bytes for p in rebuilt.totals())
    return TraceCheck(
        model.reserved,
        report.reserved_bytes,
        model.segment_count(),
        len(report.segments),
        model.peak_reserved,
        model.peak_allocated,
        n,
        unmatched,
        trace_peak,
    )


def not_here(settings: AllocatorSettings, hip: str | None, torch_version: str | None = None) -> str | None:
    """Why a scenario is not one to take on this build (``hip``, ``torch_version``): expandable segments it ignores
    (or may ignore: ``conf.expandable_takes_effect``), or a combination unsafe on it (``conf.UNSAFE_ON_ROCM``);
    None when it applies. Such a scenario is still replayed (as the allocator would run it where it applies), never
    recommended."""
    if settings.expandable_segments:
        takes, why = expandable_takes_effect(hip, torch_version)
        if not takes:
            return why
        if settings.max_split_size_mb is not None and hip:
            return UNSAFE_ON_ROCM
    return None


def settings_from_conf(
    text: str, memory_fraction: float | None, hip: str | None, torch_version: str | None = None
) -> AllocatorSettings:
    """The settings a process runs with, from its allocator settings string (``PYTORCH_*ALLOC_CONF``)
    and memory fraction, as far as the model knows them: a ``roundup_power2_divisions`` list with
    per-size entries stays at the default, and expandable segments are off where the build ignores
    them (``conf.expandable_takes_effect``; on where it may)."""
    s = parse(text).settings
    divisions = s.get("roundup_power2_divisions", "")
    settings = AllocatorSettings(
        max_split_size_mb=int(s["max_split_size_mb"]) if s.get("max_split_size_mb", "").isdigit() else None,
        roundup_power2_divisions=int(divisions) if divisions.isdigit() else None,
        garbage_collection_threshold=_float(s.get("garbage_collection_threshold")),
        memory_fraction=memory_fraction or _float(s.get("per_process_memory_fraction")),
        expandable_segments=s.get("expandable_segments", "").lower() == "true",
    )
    if expandable_takes_effect(hip, torch_version)[0] is False:
        settings = replace(settings, expandable_segments=False)
    return settings


def _float(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


MIN_GAIN = 0.02  # a setting is recommended over the defaults when it saves this much peak reserved memory


def live_at_start(rebuilt: "Rebuilt") -> list[tuple[int, tuple[int, int]]]:
    """(address, (requested bytes, stream)) of the blocks alive when the trace began, by address: a
    trace recorded from one step on (``train.snapshot_at_step``) starts with the weights and optimizer
    state already allocated. A replay allocates them first, under its own settings; measured on a 7B
    LoRA step trace from an H200 (529 segments, 12.8 GiB alive at the start) the default-settings
    replay then gave the trace's segment count and its peak reserved within 0.4%."""
    out = []
    for addr, b in sorted(rebuilt.start.blocks.items()):
        seg = rebuilt.start.segment_at(addr)  # None for a block the dump's segments do not hold
        out.append((addr, (b.requested, seg.stream if seg is not None else 0)))
    return out


def compare(
    entries: list[dict[str, Any]],
    capacity: int,
    hip: str | None,
    prefix: Sequence[tuple[int, tuple[int, int]]] = (),
    torch_version: str | None = None,
) -> tuple[list[Replay], Replay | None]:
    """Replays of every scenario (the defaults first) and the recommended one."""
    results = [replay(entries, s, capacity, prefix) for s in SCENARIOS]
    return results, recommend(results, hip, torch_version)


def recommend(results: list[Replay], hip: str | None, torch_version: str | None = None) -> Replay | None:
    """No OOM, applicable here, the fewest retries (each one a synchronising release of the whole
    cache), then the lowest peak reserved; the defaults (``results[0]``) stay recommended unless a
    setting retries less or saves MIN_GAIN of their peak reserved. None when every applicable setting
    runs out of memory."""
    usable = [r for r in results if not r.oom and not_here(r.settings, hip, torch_version) is None]
    best = min(usable, key=lambda r: (r.alloc_retries, r.peak_reserved_bytes), default=None)
    default = results[0]
    if (
        best is not None
        and default in usable
        and best.alloc_retries == default.alloc_retries
        and best.peak_reserved_bytes > (1 - MIN_GAIN) * default.peak_reserved_bytes
    ):
        return default
    return best


ADVISED_KEYS = ("expandable_segments", "max_split_size_mb", "garbage_collection_threshold", "memory_fraction")
"""The allocator settings a restart may change, as ``allocator.*`` config keys (the run config has no
``roundup_power2_divisions``: scenarios with it are not advised there)."""


def restart_advice(
    results: list[Replay], now: AllocatorSettings, hip: str | None, torch_version: str | None = None
) -> dict[str, Any] | None:
    """What a restart in a fresh process should change in the ``allocator`` section: the recommended scenario
    (``recommend`` over those the config can set) where it is not the settings in effect (``now``), as
    ``allocator.key=value`` overrides with the replay's peaks; None where nothing is to change. A memory
    fraction the run set is never dropped (it may share the device)."""
    settable = [r for r in results if r.settings.roundup_power2_divisions is None]
    best = recommend(settable, hip, torch_version)
    if best is None or best.settings == now:
        return None
    overrides = []
    for key in ADVISED_KEYS:
        value, was = getattr(best.settings, key), getattr(now, key)
        if value != was and not (key == "memory_fraction" and value is None):
            text = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
            overrides.append(f"allocator.{key}={text}")
    current = next((r for r in results if r.settings == now), None)
    return {
        "settings": best.settings.label(),
        "overrides": overrides,
        "peak_reserved_bytes": best.peak_reserved_bytes,
        "alloc_retries": best.alloc_retries,
        "now_peak_reserved_bytes": current.peak_reserved_bytes if current is not None else None,
    }


def recorded_advice(
    snap: dict[str, Any],
    device: int,
    capacity: int,
    now: AllocatorSettings,
    hip: str | None,
    torch_version: str | None = None,
) -> tuple[dict[str, Any] | None, int]:
    """``restart_advice`` from a run's own recorded allocator trace (``snap``: ``torch.cuda.memory._snapshot()``
    with history recorded since the start), every scenario replaying the trace from the blocks alive when the
    recording began, as ``memfit frag --simulate`` does; and the number of trace events replayed (0: ``device``'s
    trace holds no allocation, nothing was replayed and the advice is None)."""
    try:
        entries = trace_entries(snap, device)
    except UserError:  # no history recorded on this device
        return None, 0
    results, _ = compare(entries, capacity, hip, live_at_start(Rebuilt(snap, device)), torch_version)
    return restart_advice(results, now, hip, torch_version), len(entries)


def as_trace(events: list[tuple[int, int]]) -> list[dict[str, Any]]:
    """A traced step's storage allocations (``trace_allocations``: (serial, +bytes) then (serial, -bytes))
    as snapshot trace entries, the serial standing for the address."""
    return [
        {"action": "alloc" if delta > 0 else "free_completed", "addr": serial, "size": abs(delta)}
        for serial, delta in events
    ]


def replay_allocations(
    events: list[tuple[int, int]], settings: AllocatorSettings = AllocatorSettings(), capacity: int = 1 << 62
) -> CachingAllocatorModel:
    """Replay a traced step's storage allocations through the allocator model."""
    return _replayed(as_trace(events), settings, capacity)[0]
