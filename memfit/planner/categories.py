"""Memory categories and typed breakdowns (bytes as int; GiB only at display)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Category(str, Enum):
    PARAMS = "params"
    GRADS = "grads"
    OPTIMIZER = "optimizer"
    ACTIVATIONS = "activations"  # tensors autograd saved for backward
    TEMPORARIES = "temporaries"  # everything else alive at the moment (logits, workspaces, inputs)
    HOST = "host"  # host memory that comes and goes: offloaded activations, the host optimizer step's temporaries
    HOST_STATE = "host_state"  # with optimizer.offload: master weights, gradient copies and optimizer state on the host


HOST_CATEGORIES = (Category.HOST, Category.HOST_STATE)
"""The categories in host memory: not device bytes (not in ``Breakdown.total_bytes``)."""
DEVICE_CATEGORIES = tuple(c for c in Category if c not in HOST_CATEGORIES)
"""The categories that occupy device memory."""


PHASES = ("forward", "backward", "clip", "optimizer")


@dataclass(frozen=True)
class Breakdown:
    """Bytes per category at one moment; ``total_bytes`` is their sum."""

    bytes_by_category: dict[Category, int] = field(default_factory=dict)

    def __getitem__(self, c: Category) -> int:
        return self.bytes_by_category.get(c, 0)

    @property
    def total_bytes(self) -> int:
        """Device bytes: every category but the host ones."""
        return sum(v for c, v in self.bytes_by_category.items() if c not in HOST_CATEGORIES)

    @property
    def host_bytes(self) -> int:
        return self[Category.HOST] + self[Category.HOST_STATE]

    def as_dict(self) -> dict[str, int]:
        return {c.value: self[c] for c in Category}


@dataclass(frozen=True)
class StepMemory:
    """Peak of one training step: the breakdown at the overall peak and the peak of each phase."""

    peak: Breakdown
    phase_peaks: dict[str, Breakdown]
    peak_phase: str
    host_peak_bytes: int = 0  # the most host memory the step holds at any moment (offloaded tensors, host state)

    @property
    def peak_bytes(self) -> int:
        return self.peak.total_bytes
