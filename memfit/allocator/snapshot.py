"""Read PyTorch memory snapshots safely and explain their fragmentation.

Input is the pickle ``torch.cuda.memory._dump_snapshot(path)`` writes (CUDA and ROCm builds alike).
Fields used (see the ``Snapshot``/``Segment``/``Block``/``TraceEntry`` TypedDicts documented in
``torch.cuda.memory._snapshot``):

    segments[i]: device, address, total_size, stream, segment_type ("small" | "large"), blocks
    blocks[j]:   size, requested_size, address, state ("active_allocated" | "active_awaiting_free" | "inactive")
    device_traces[d][k]: action (alloc, free_requested, free_completed, segment_alloc, segment_free,
                 segment_map, segment_unmap, oom, snapshot), size, time_us (newer releases)

Definitions (PRODUCT.md): requested = bytes live tensors asked for; allocated = bytes of active blocks
(awaiting-free included); reserved = bytes of all segments; internal free = allocated - requested;
external free = reserved - allocated; fragmentation ratio = 1 - largest free block / external free;
reserved overhead = (reserved - allocated) / reserved. reserved == requested + internal + external.
"""

from __future__ import annotations

import gzip
import io
import pickle
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memfit.errors import UserError, not_a_file
from memfit.units import GIB, MIB

ACTIVE_STATES = ("active_allocated", "active_awaiting_free")
BLOCK_STATES = (*ACTIVE_STATES, "inactive")


class _PlainUnpickler(pickle.Unpickler):
    """Only dicts, lists, tuples, strings, numbers, booleans and None: any class or function is refused."""

    def find_class(self, module: str, name: str):
        raise UserError(
            f"snapshot refers to the Python object '{module}.{name}'; memfit only reads snapshots made of plain "
            "containers (torch.cuda.memory._dump_snapshot output) and never runs code from a file"
        )


def load_snapshot(path: str | Path) -> dict[str, Any]:
    """Load a snapshot pickle (or a gzip of one) through the restricted unpickler.

    Raises:
        UserError: missing file, not a pickle, a pickle that needs classes, or not a snapshot.
    """
    p = Path(path)
    if not str(path).strip():
        raise UserError("the snapshot path is empty; give the pickle torch.cuda.memory._dump_snapshot wrote")
    if p.is_dir():
        raise UserError(f"snapshot '{path}' is a directory; give the pickle torch.cuda.memory._dump_snapshot wrote")
    if not p.is_file():
        raise UserError(f"snapshot '{path}' {not_a_file(p)}; write one with torch.cuda.memory._dump_snapshot(path)")
    raw = p.read_bytes()
    try:
        if raw[:2] == b"\x1f\x8b":  # gzip, as snapshots are often kept and mailed
            raw = gzip.decompress(raw)
        data = _PlainUnpickler(io.BytesIO(raw)).load()
    except (pickle.UnpicklingError, EOFError, ValueError, IndexError, gzip.BadGzipFile, zlib.error) as e:
        raise UserError(f"snapshot '{path}' is not a readable pickle ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("segments"), list):
        raise UserError(f"snapshot '{path}' has no 'segments' list; is it a torch.cuda.memory._dump_snapshot file?")
    bad = schema_error(data)
    if bad:
        raise UserError(f"snapshot '{path}': {bad}; is it a torch.cuda.memory._dump_snapshot file?")
    return data


_INT = (int,)
_SEGMENT_FIELDS = {"address": _INT, "total_size": _INT, "blocks": (list,)}
_SEGMENT_OPTIONAL = {"device": _INT, "stream": _INT, "segment_type": (str,), "allocated_size": _INT}
_BLOCK_FIELDS = {"address": _INT, "size": _INT, "state": (str,)}
_BLOCK_OPTIONAL = {"requested_size": _INT}
_ADDRESSED = {"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map"}
_ADDRESSED |= {"segment_unmap"}
_TRACE_OPTIONAL = {"addr": _INT, "size": _INT, "stream": _INT, "time_us": _INT, "frames": (list,)}


def _negative(item: dict, where: str) -> str | None:
    """The first address or size of ``item`` below zero, said, or None."""
    for key in ("address", "addr", "total_size", "allocated_size", "size", "requested_size"):
        value = item.get(key)
        if isinstance(value, int) and value < 0:
            return f"{where}.{key} is {value}, not a byte count >= 0"
    return None


def _kind(value: Any) -> str:
    return "None" if value is None else type(value).__name__


def _fields(item: Any, where: str, required: dict, optional: dict) -> str | None:
    if not isinstance(item, dict):
        return f"{where} is {_kind(item)}, not a dict"
    for key, types in required.items():
        if key not in item:
            return f"{where} has no '{key}'"
    for key, types in (*required.items(), *optional.items()):
        value = item.get(key)
        if key in item and (isinstance(value, bool) or not isinstance(value, types)):
            if key in optional and value is None:
                continue
            shown = "" if value is None else f" {value!r:.40}"
            return f"{where}.{key} is {_kind(value)}{shown}, not {types[0].__name__}"
    return None


def schema_error(snapshot: dict[str, Any]) -> str | None:
    """The first path in ``snapshot`` that does not have the shape ``_dump_snapshot`` writes (``segments[3].blocks
    is None, not list``), or None. Only the fields memfit reads are checked; others are left as they are."""
    for i, seg in enumerate(snapshot["segments"]):
        bad = _fields(seg, f"segments[{i}]", _SEGMENT_FIELDS, _SEGMENT_OPTIONAL) or _negative(seg, f"segments[{i}]")
        for j, block in enumerate(seg["blocks"] if bad is None else ()):
            where = f"segments[{i}].blocks[{j}]"
            bad = bad or _fields(block, where, _BLOCK_FIELDS, _BLOCK_OPTIONAL) or _negative(block, where)
            if bad is None and block["state"] not in BLOCK_STATES:
                bad = f"{where}.state is {block['state']!r:.40}, not one of {', '.join(BLOCK_STATES)}"
        added = sum(b["size"] for b in seg["blocks"]) if bad is None else None
        if added is not None and added != seg["total_size"]:
            bad = f"segments[{i}]: its blocks add up to {added:,} bytes, its total_size is {seg['total_size']:,}"
        if bad:
            return bad
    traces = snapshot.get("device_traces")
    if traces is None:
        return None
    if not isinstance(traces, list):
        return f"device_traces is {_kind(traces)}, not list"
    for d, entries in enumerate(traces):
        if not isinstance(entries, list):
            return f"device_traces[{d}] is {_kind(entries)}, not list"
        for k, e in enumerate(entries):
            where = f"device_traces[{d}][{k}]"
            bad = _fields(e, where, {"action": (str,)}, _TRACE_OPTIONAL) or _negative(e, where)
            if bad is None and e["action"] in _ADDRESSED:
                missing = [key for key in ("addr", "size") if key not in e]
                bad = f"{where} ({e['action']}) has no '{missing[0]}'" if missing else None
            if bad:
                return bad
    return None


@dataclass(frozen=True)
class SegmentStats:
    address: int
    device: int
    stream: int
    segment_type: str
    total_bytes: int
    allocated_bytes: int
    requested_bytes: int
    largest_free_bytes: int
    blocks: tuple[tuple[int, int, str], ...]  # (offset in segment, size, state)


@dataclass(frozen=True)
class FragReport:
    """One device's numbers (bytes as int)."""

    device: int
    reserved_bytes: int
    allocated_bytes: int
    awaiting_free_bytes: int
    requested_bytes: int
    largest_free_bytes: int
    segments: tuple[SegmentStats, ...] = field(default_factory=tuple)

    @classmethod
    def of(cls, device: int, segs: tuple[SegmentStats, ...]) -> "FragReport":
        """The device's totals from its segments."""
        return cls(
            device=device,
            reserved_bytes=sum(s.total_bytes for s in segs),
            allocated_bytes=sum(s.allocated_bytes for s in segs),
            awaiting_free_bytes=sum(
                size for s in segs for _, size, state in s.blocks if state == "active_awaiting_free"
            ),
            requested_bytes=sum(s.requested_bytes for s in segs),
            largest_free_bytes=max((s.largest_free_bytes for s in segs), default=0),
            segments=segs,
        )

    @property
    def internal_free_bytes(self) -> int:
        return self.allocated_bytes - self.requested_bytes

    @property
    def external_free_bytes(self) -> int:
        return self.reserved_bytes - self.allocated_bytes

    @property
    def fragmentation_ratio(self) -> float:
        ext = self.external_free_bytes
        return 0.0 if ext == 0 else 1.0 - self.largest_free_bytes / ext

    @property
    def reserved_overhead(self) -> float:
        return 0.0 if self.reserved_bytes == 0 else (self.reserved_bytes - self.allocated_bytes) / self.reserved_bytes

    def as_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "reserved_bytes": self.reserved_bytes,
            "allocated_bytes": self.allocated_bytes,
            "awaiting_free_bytes": self.awaiting_free_bytes,
            "requested_bytes": self.requested_bytes,
            "internal_free_bytes": self.internal_free_bytes,
            "external_free_bytes": self.external_free_bytes,
            "largest_free_bytes": self.largest_free_bytes,
            "fragmentation_ratio": self.fragmentation_ratio,
            "reserved_overhead": self.reserved_overhead,
            "segments": len(self.segments),
        }


def quantities(report: FragReport) -> list[tuple[str, str, str]]:
    """(quantity, value with its unit, meaning) for one moment, as ``memfit frag`` and its HTML page show them."""
    return [
        ("reserved", f"{report.reserved_bytes / GIB:.3f} GiB", "held by the caching allocator (all segments)"),
        ("allocated", f"{report.allocated_bytes / GIB:.3f} GiB", "active blocks (awaiting-free included)"),
        ("  awaiting free", f"{report.awaiting_free_bytes / GIB:.3f} GiB", "freed, still in use by another stream"),
        ("requested", f"{report.requested_bytes / GIB:.3f} GiB", "what tensors asked for"),
        ("internal free", f"{report.internal_free_bytes / GIB:.3f} GiB", "allocated − requested (rounding)"),
        ("external free", f"{report.external_free_bytes / GIB:.3f} GiB", "reserved − allocated (inactive blocks)"),
        (
            "largest free block",
            f"{report.largest_free_bytes / MIB:.1f} MiB",
            "biggest single allocation that fits without a new segment",
        ),
        (
            "fragmentation ratio",
            f"{report.fragmentation_ratio:.3f}",
            "1 − largest free / external free (0 = one hole, 1 = dust)",
        ),
        ("reserved overhead", f"{report.reserved_overhead:.3f}", "(reserved − allocated) / reserved"),
        (
            "segments",
            str(len(report.segments)),
            f"{sum(s.segment_type == 'small' for s in report.segments)} small (2 MiB pool)",
        ),
    ]


def devices_in(snapshot: dict[str, Any]) -> list[int]:
    found = {s.get("device", 0) for s in snapshot["segments"]}
    return sorted(found) or [0]


def _segment_stats(seg: dict[str, Any], where: str) -> SegmentStats:
    try:
        base, blocks = seg["address"], seg["blocks"]
        total = int(seg["total_size"])
        rows, alloc, req, largest = [], 0, 0, 0
        for b in blocks:
            size, state = int(b["size"]), b["state"]
            rows.append((int(b["address"]) - base, size, state))
            if state in ACTIVE_STATES:
                alloc += size
                req += int(b.get("requested_size", size))
            else:
                largest = max(largest, size)
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{where}: malformed segment ({e!r} missing or wrong); not a PyTorch snapshot?") from None
    return SegmentStats(
        base,
        seg.get("device", 0),
        seg.get("stream", 0),
        seg.get("segment_type", "large"),
        total,
        alloc,
        req,
        largest,
        tuple(rows),
    )


def analyze(snapshot: dict[str, Any], device: int = 0, where: str = "snapshot") -> FragReport:
    """The fragmentation report of ``device``."""
    return FragReport.of(
        device, tuple(_segment_stats(s, where) for s in snapshot["segments"] if s.get("device", 0) == device)
    )
