"""A lower bound of a candidate's peak from predicted relatives, so that the search can leave it untraced.

Some levers change only a few memory categories of the forward pass (``Lever.forward_changes``: an NF4 base its
weights and their dequantization's temporaries, low-bit states the optimizer state, the optimizer implementation
nothing). Two candidates that differ only in such levers hold every other category alike at their forward peak: one's
prediction, less what those levers change, is a floor under the other's peak. ``Relatives`` keeps the predicted
candidates by family (the same values of every other lever) and answers the highest floor any of them sets.
``tests/planner/test_search_floor.py`` holds every pair of relatives of narrowed searches to it.
"""

from __future__ import annotations

import functools
import itertools

from memfit.config.strategy import Strategy, levers
from memfit.planner.categories import DEVICE_CATEGORIES, StepMemory

FLOOR_SLACK = 1e-4
"""``forward_floor_bytes`` gives this share away: the predictor draws two relatives' forward passes from different
traces (one at the micro-batch itself, or a line through two), which agree to a 512-byte block (measured over every
candidate of five searches on Llama-2-7B)."""


@functools.cache
def declared() -> dict[str, frozenset[str]]:
    """The levers that declare their forward changes, each with them (on one rank)."""
    return {n: frozenset(lever.forward_changes) for n, lever in levers().items() if lever.forward_changes is not None}


def family(s: Strategy) -> Strategy:
    """``s`` with every lever that declares its forward changes at its first searched value: relatives share it."""
    return s.replace(**_first_values())


@functools.cache
def _first_values() -> dict[str, object]:
    table = levers()
    return {n: table[n].searched[0] for n in declared()}


def forward_changes(a: Strategy, b: Strategy, sharded: bool = False) -> frozenset[str]:
    """The categories in which two relatives' forward passes may differ (``sharded``: on several ranks)."""
    table = levers()
    changed = [n for n in declared() if getattr(a, n) != getattr(b, n)]
    own = (table[n].forward_changes + (table[n].sharded_changes if sharded else ()) for n in changed)
    return frozenset(itertools.chain.from_iterable(own))


def forward_floor_bytes(relative: StepMemory, changes: frozenset[str]) -> int:
    """A lower bound of the peak of a candidate whose forward pass differs from ``relative``'s only in ``changes``:
    every other category ``relative`` holds at its forward peak, the candidate holds at the same moment of its own
    forward pass (the same tensors; a lever adds or shrinks only what it changes)."""
    forward = relative.phase_peaks.get("forward")
    if forward is None:
        return 0
    held = sum(forward[k] for k in DEVICE_CATEGORIES if k.value not in changes)
    return int(held * (1 - FLOOR_SLACK))


class Relatives:
    """Predicted candidates by family, for the floor they set under their relatives' peaks."""

    def __init__(self, sharded: bool) -> None:
        self.sharded = sharded
        self._known: dict[Strategy, list[tuple[Strategy, StepMemory]]] = {}

    def add(self, s: Strategy, memory: StepMemory) -> None:
        self._known.setdefault(family(s), []).append((s, memory))

    def floor_bytes(self, s: Strategy) -> int:
        """The highest floor a predicted relative of ``s`` sets under its peak (0: none predicted)."""
        known = self._known.get(family(s), ())
        floors = (forward_floor_bytes(m, forward_changes(s, r, self.sharded)) for r, m in known if r != s)
        return max(floors, default=0)
