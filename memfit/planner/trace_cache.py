"""A cache of traced timelines, so that a repeated or overlapping ``memfit plan`` reuses its traces.

Each entry is one ``Timeline`` (the bytes per category after every op of one traced step), or the allocations and
releases of a configuration's first full-depth steps (the allocator model's input: ``memfit plan --explain``, the
trainer's replay on a GPU), as gzipped JSON, under
``$MEMFIT_TRACE_CACHE`` (default ``<memfit cache>/traces``; ``MEMFIT_TRACE_CACHE=off`` turns the cache off). Its
name is the SHA-256 of everything that changes a trace: the model config, the sequence length, the strategy, the
LoRA config, the rounding, whether host and device are one memory, the depth, the part of the step traced, the
versions of torch, transformers, peft and torchao, and the bytes of memfit's own source files (so a changed planner
never reads an old trace, even at the same version number).

Writers write a temporary file in the same directory and rename it into place (atomic on POSIX), so concurrent
planners never see half an entry and the last writer wins with identical content. An entry that cannot be read
(truncated, not JSON, not a timeline) is said in one line on stderr, removed and traced again; a cache directory
that cannot be written is skipped silently (the plan is the same, only slower). The plumbing is ``memfit.cache``.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import numpy as np

from memfit.cache import cache_root as _root
from memfit.cache import code_and_versions, digest, read_entry, write_entry
from memfit.models.planning import config_key
from memfit.planner.categories import Category
from memfit.planner.timeline import Timeline

FORMAT = 1  # bump when the entry layout changes


def cache_root() -> Path | None:
    """The directory entries live in, or None when the cache is off."""
    return _root("MEMFIT_TRACE_CACHE", "traces")


def _described(spec, layers: int) -> dict:
    """Everything that changes a trace of ``spec`` (a ``trace.StepSpec``) at ``layers`` decoder layers."""
    return {
        "format": FORMAT,
        "model": config_key(spec.model_config),
        "seq_len": spec.seq_len,
        "strategy": spec.strategy.as_dict(),
        "lora": asdict(spec.lora) if spec.lora is not None else None,
        "round_to": spec.round_to,
        "host_is_device": spec.host_is_device,
        "layers": layers,
        "part": spec.part,
        "code": code_and_versions(),
    }


def trace_key(spec, layers: int) -> str:
    """The cache name of ``spec`` traced at ``layers`` decoder layers (a ``trace.StepSpec``)."""
    return digest(_described(spec, layers))


def allocations_key(spec, steps: int) -> str:
    """The cache name of ``spec``'s first ``steps`` steps at full depth as allocations and releases
    (``trace.trace_allocations``: the allocator model's input)."""
    return digest({**_described(spec, spec.model_config.num_hidden_layers), "allocations": steps})


def load(key: str) -> Timeline | None:
    """The cached timeline of ``key``, or None (not cached, cache off, or a damaged entry, removed)."""
    return read_entry(cache_root(), key, "trace", _timeline)


def _timeline(data: dict) -> Timeline:
    phases, rows = data["phases"], data["rows"]
    values = np.asarray(rows) if isinstance(rows, list) else None  # ragged rows raise ValueError
    if not (
        isinstance(phases, list)
        and values is not None
        and values.dtype == np.int64
        and values.shape == (len(phases), len(Category))
        and all(isinstance(p, str) for p in phases)
    ):
        raise ValueError("not a timeline")
    return Timeline(phases, values)


def store(key: str, timeline: Timeline) -> None:
    """Write ``timeline`` as ``key``'s entry (atomically; skipped where the cache cannot be written)."""
    write_entry(cache_root(), key, {"phases": timeline.phases, "rows": timeline.rows})


def load_allocations(key: str) -> list[tuple[int, int]] | None:
    """The cached allocations and releases of ``key`` as (storage serial, +bytes or -bytes) pairs, in order, or None
    (not cached, cache off, or a damaged entry, removed)."""
    return read_entry(cache_root(), key, "trace", _allocations)


def _allocations(data: dict) -> list[tuple[int, int]]:
    events = data["allocations"]
    if not isinstance(events, list) or not all(
        isinstance(e, list) and len(e) == 2 and all(type(x) is int for x in e) for e in events
    ):
        raise ValueError("not a list of (storage, bytes) pairs")
    return [(serial, delta) for serial, delta in events]


def store_allocations(key: str, events: list[tuple[int, int]]) -> None:
    """Write ``events`` as ``key``'s entry (atomically; skipped where the cache cannot be written)."""
    write_entry(cache_root(), key, {"allocations": events})
