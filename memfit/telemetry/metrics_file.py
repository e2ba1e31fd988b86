"""``metrics.jsonl``: one JSON record per line (``kind`` step, eval, oom or summary), written by the trainer's
rank 0 and read by ``memfit bench`` and the tests."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from memfit.config.loader import json_value


class MetricsLog:
    """Append-only JSONL of records; on resume, records after the checkpoint's step are dropped."""

    def __init__(self, path: Path, keep_through_step: int | None):
        self.path = path
        kept: list[str] = []
        if keep_through_step is not None and path.is_file():
            for line in path.read_text().splitlines():
                try:
                    rec = json_value(line)
                except json.JSONDecodeError:
                    break  # a torn last line from a killed run
                if rec.get("step", 0) <= keep_through_step and rec.get("kind") != "summary":
                    kept.append(line)
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)
        self._fh = path.open("a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        self._fh.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._fh.close()


class NullLog:
    """The metrics log of ranks other than 0 (rank 0 writes the run's one metrics file)."""

    def write(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json_value(line) for line in Path(path).read_text().splitlines() if line.strip()]


def append_record(path: Path, record: dict[str, Any]) -> None:
    """Append one record to ``path`` from any rank, beside rank 0's open log: one short ``O_APPEND`` write
    (used for the ``oom`` record, written by whichever rank ran out of memory)."""
    with Path(path).open("a") as fh:
        fh.write(json.dumps(record) + "\n")
