"""A cache of traced timelines, so that a repeated or overlapping ``memfit plan`` reuses its traces.

Each entry is one ``Timeline`` (the bytes per category after every op of one traced step) as gzipped JSON, under
``$MEMFIT_TRACE_CACHE`` (default ``<memfit cache>/traces``; ``MEMFIT_TRACE_CACHE=off`` turns the cache off). Its
name is the SHA-256 of everything that changes a trace: the model config, the sequence length, the strategy, the
LoRA config, the rounding, whether host and device are one memory, the depth, the versions of torch,
transformers, peft and torchao, and the bytes of memfit's own source files (so a changed planner never reads an
old trace, even at the same version number).

Writers write a temporary file in the same directory and rename it into place (atomic on POSIX), so concurrent
planners never see half an entry and the last writer wins with identical content. An entry that cannot be read
(truncated, not JSON, not a timeline) is said in one line on stderr, removed and traced again; a cache directory
that cannot be written is skipped silently (the plan is the same, only slower).
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import os
import sys
import tempfile
from dataclasses import asdict
from importlib import metadata
from pathlib import Path

from memfit.planner.tracker import Timeline

FORMAT = 1  # bump when the entry layout changes


def cache_root() -> Path | None:
    """The directory entries live in, or None when the cache is off."""
    setting = os.environ.get("MEMFIT_TRACE_CACHE")
    if setting is not None and setting.strip().lower() in ("off", "0", "false", "no", ""):
        return None
    if setting:
        return Path(setting)
    from memfit.models.load import cache_dir

    return cache_dir() / "traces"


@functools.cache
def _code_and_versions() -> str:
    """What else decides a trace: memfit's source bytes and the versions of the libraries it traces through."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parents[1]
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    for dist in ("torch", "transformers", "peft", "torchao"):
        try:
            h.update(f"{dist}={metadata.version(dist)}".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{dist}=-".encode())
    return h.hexdigest()


def trace_key(spec, layers: int) -> str:
    """The cache name of ``spec`` traced at ``layers`` decoder layers (a ``trace.StepSpec``)."""
    described = {
        "format": FORMAT,
        "model": spec.model_config.to_json_string(use_diff=False),
        "seq_len": spec.seq_len,
        "strategy": spec.strategy.as_dict(),
        "lora": asdict(spec.lora) if spec.lora is not None else None,
        "round_to": spec.round_to,
        "host_is_device": spec.host_is_device,
        "layers": layers,
        "code": _code_and_versions(),
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()


def load(key: str) -> Timeline | None:
    """The cached timeline of ``key``, or None (not cached, cache off, or a damaged entry, removed)."""
    root = cache_root()
    if root is None:
        return None
    path = root / f"{key}.json.gz"
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    try:
        data = json.loads(gzip.decompress(raw))
        phases, rows = data["phases"], data["rows"]
        if not (
            isinstance(phases, list)
            and isinstance(rows, list)
            and len(phases) == len(rows)
            and all(isinstance(p, str) for p in phases)
            and all(isinstance(r, list) and all(isinstance(x, int) for x in r) for r in rows)
        ):
            raise ValueError("not a timeline")
        return Timeline(phases, [tuple(r) for r in rows])
    except (OSError, EOFError, ValueError, KeyError, TypeError) as e:
        print(f"memfit: trace cache entry {path} is damaged ({type(e).__name__}); tracing it again", file=sys.stderr)
        try:
            path.unlink()
        except OSError:
            pass
        return None


def store(key: str, timeline: Timeline) -> None:
    """Write ``timeline`` as ``key``'s entry (atomically; skipped where the cache cannot be written)."""
    root = cache_root()
    if root is None:
        return
    data = gzip.compress(json.dumps({"phases": timeline.phases, "rows": timeline.rows}).encode(), compresslevel=3)
    tmp = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=".tmp-", suffix=".json.gz", delete=False) as fh:
            tmp = fh.name
            fh.write(data)
        os.replace(tmp, root / f"{key}.json.gz")
    except OSError:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
