"""``train.restart_on``: when a run restarts itself in a fresh process (a clean allocator), as a typed value.

Spellings (one condition):
    fragmentation>0.5   the fragmentation ratio a step reports (GPU, ``train.frag_every``) is above 0.5
    retries>0           the caching allocator has released its cache and retried more than 0 times (GPU)
    every:2h            every 2 hours of this process's training (also ``30m``, ``90s``)
    every:500steps      every 500 optimizer steps of this process

The readings are a step's own record (``fragmentation_ratio``, ``alloc_retries``; with several ranks the worst
rank's): on a CPU they are absent, so only ``every:`` conditions ever hold there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from memfit.errors import UserError

_UNITS_S = {"s": 1.0, "m": 60.0, "h": 3600.0}
_READINGS = {"fragmentation": "fragmentation_ratio", "retries": "alloc_retries"}


@dataclass(frozen=True)
class RestartCondition:
    kind: str  # fragmentation | retries | seconds | steps
    threshold: float

    @classmethod
    def parse(cls, text: str, where: str = "train.restart_on") -> RestartCondition:
        """Raises: UserError naming ``where``, the text and the spellings."""
        t = text.strip().lower()
        reading = re.fullmatch(r"(fragmentation|retries)\s*>\s*([0-9.]+)", t)
        every = re.fullmatch(r"every:\s*([0-9.]+)\s*(s|m|h|steps)", t)
        try:
            if reading and reading.group(1) == "fragmentation" and float(reading.group(2)) >= 1:
                raise UserError(  # the ratio is 1 - largest free block / free bytes: it never reaches 1
                    f"{where} {text!r} never restarts: the fragmentation ratio is below 1; give a threshold in "
                    "[0, 1), e.g. fragmentation>0.5"
                )
            if reading:
                return cls(reading.group(1), float(reading.group(2)))
            if every and float(every.group(1)) > 0:
                n, unit = float(every.group(1)), every.group(2)
                return cls("steps", n) if unit == "steps" else cls("seconds", n * _UNITS_S[unit])
        except ValueError:
            pass
        raise UserError(f"{where} must be fragmentation>X, retries>N, every:<N>h|m|s or every:<N>steps (got {text!r})")

    def due(self, record: dict[str, Any], steps_here: int, seconds_here: float) -> str | None:
        """Why the run should restart after the step ``record`` describes (``steps_here`` steps and
        ``seconds_here`` seconds into this process's training), or None."""
        if self.kind in _READINGS:
            value = record.get(_READINGS[self.kind])
            if value is not None and value > self.threshold:
                return f"{self.kind} {value:g} > {self.threshold:g}"
            return None
        if self.kind == "steps" and steps_here >= self.threshold:
            return f"{steps_here} steps in this process (every:{self.threshold:g}steps)"
        if self.kind == "seconds" and seconds_here >= self.threshold:
            return f"{seconds_here / 60:.1f} min in this process (every {self.threshold / 60:g} min)"
        return None
