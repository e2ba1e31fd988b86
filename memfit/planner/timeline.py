"""What a traced step leaves: a ``Timeline`` (bytes per category after every op) and its ``Moments`` (the peaks a
search does arithmetic on). Plain numpy, without torch, so a search whose traces are all cached never imports it."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from memfit.planner.categories import PHASES, Breakdown, Category, StepMemory


@dataclass
class Timeline:
    """Bytes per category after every traced op, with the op's phase: the raw record of one step.

    Two timelines of the same step at different micro-batch sizes run the same ops in the same order,
    so they can be combined moment by moment (``combine``) before taking peaks.
    """

    phases: list[str]  # "phase:region" per op (region only for forward and backward)
    rows: list[tuple[int, ...]] | np.ndarray  # one per op, in Category order (an int64 array when combined)
    _peaks: dict[str, tuple[int, ...]] | None = field(default=None, repr=False, compare=False)
    _keys: tuple[list[str], np.ndarray] | None = field(default=None, repr=False, compare=False)  # _moment_keys

    def _array(self) -> np.ndarray:
        return self.rows if isinstance(self.rows, np.ndarray) else _array(self.rows)

    def combine(self, other: "Timeline", k: float) -> "Timeline":
        """``self + k * (other - self)`` at every op (linear extrapolation in batch size), each value rounded to the
        nearest integer (half to even, as Python's ``round``)."""
        if self.phases != other.phases:
            raise ValueError("timelines of different op sequences cannot be combined")
        a, b = self._array(), other._array()
        rows = np.rint(a + k * (b - a)).astype(np.int64)
        return Timeline(self.phases, rows, _keys=self._keys)

    def steady(self) -> "Timeline":
        """Every later step's moments from this first step's: the optimizer state (and, offloaded, its host
        state), created lazily during step 1 (in the optimizer step, or parameter by parameter in backward with
        ``optimizer.in_backward``) and constant in size afterwards, is whole at every moment. Made steady before
        any peak is taken, so a phase's peak is the moment that is highest with the state whole."""
        return Timeline(self.phases, steady_rows(self.rows))

    def _moment_keys(self) -> tuple[list[str], np.ndarray]:
        """``region_peaks``' keys in order of first appearance, and each op's index into them (once per op
        sequence: a combined timeline shares its source's)."""
        if self._keys is None:
            names: dict[str, int] = {}
            index: list[int] = []
            occurrences: dict[str, int] = {}
            for label, run in itertools.groupby(self.phases):  # runs of one label: an op's key is its place in its run
                n = sum(1 for _ in run)
                occurrences[label] = occurrence = occurrences.get(label, -1) + 1
                if label.endswith(":mid") or ":" not in label:
                    index += [names.setdefault(label, len(names))] * n
                else:  # a new run's keys are new
                    first = len(names)
                    names.update((f"{label}#{occurrence}+{offset}", first + offset) for offset in range(n))
                    index += range(first, first + n)
            self._keys = (list(names), np.array(index, dtype=np.int64))
        return self._keys

    def region_peaks(self) -> dict[str, tuple[int, ...]]:
        """Bytes per category (rows in Category order) at every moment that exists at any depth,
        keyed so that the same op has the same key at every depth: ``phase:region#occurrence+offset``
        for forward/backward ops outside the middle layers, and the phase's peak for ``clip`` and
        ``optimizer``. Middle-layer moments are reduced to their peak (``phase:mid``): they repeat per
        layer and are not aligned. Per key the first op with the most device bytes, and on a tie the one with
        more host bytes (the host peak is kept). Computed once per timeline."""
        if self._peaks is not None:
            return self._peaks
        names, index = self._moment_keys()
        rows = self._array()
        device, host = _device_and_host(rows)
        order = np.lexsort((np.arange(len(index)), -host, -device, index))
        grouped = index[order]
        first = order[np.r_[True, grouped[1:] != grouped[:-1]]] if len(order) else order
        self._peaks = {names[i]: tuple(r) for i, r in zip(index[first].tolist(), rows[first].tolist())}
        return self._peaks

    def step_memory(self) -> StepMemory:
        return collapse_regions(self.region_peaks())


def collapse_regions(region_peaks: dict[str, tuple[int, ...]]) -> StepMemory:
    """Per-phase peaks (max over each phase's moments) and the overall peak."""
    return Moments.of(region_peaks).collapse()


CATEGORIES = tuple(Category)
_HOST = CATEGORIES.index(Category.HOST)
_HOST_STATE = CATEGORIES.index(Category.HOST_STATE)
STATE_CATEGORIES = (Category.OPTIMIZER, Category.HOST_STATE)
"""What exists whole from the end of step 1 on: the optimizer state, on the device or on the host."""
_STATE = tuple(CATEGORIES.index(c) for c in STATE_CATEGORIES)


def steady_rows(rows: list[tuple[int, ...]], own: list[tuple[int, ...]] | None = None) -> list[tuple[int, ...]]:
    """``rows`` with each ``STATE_CATEGORIES`` column at its highest over ``own`` (default ``rows``): the state
    as it is at every moment once step 1 has created it."""
    array = _array(rows)
    _whole_state(array, array if own is None else _array(own))
    return [tuple(r) for r in array.tolist()]


def _array(rows: list[tuple[int, ...]]) -> np.ndarray:
    return np.array(rows, dtype=np.int64).reshape(len(rows), len(CATEGORIES))


def _device_and_host(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each moment's device bytes (every category but the host ones) and host bytes (offloaded activations, the
    host optimizer's state and temporaries)."""
    host = rows[:, _HOST] + rows[:, _HOST_STATE]
    return rows.sum(axis=1) - host, host


def _whole_state(rows: np.ndarray, own: np.ndarray) -> None:
    """``steady_rows`` in place on an int64 array."""
    for i in _STATE:
        rows[:, i] = own[:, i].max(initial=0)


_PHASE = {p: i for i, p in enumerate(PHASES)}
_G = CATEGORIES.index(Category.GRADS)
LAYER_REGIONS = ("first", "mid", "last")
"""The regions of a moment inside a decoder layer (``StepTracker._region``); ``outer`` and ``loss`` are outside."""


def segment_of(key: str) -> str:
    """``backward:outer#0+12`` -> ``backward:outer#0``: the run of moments a moment belongs to."""
    return key.rsplit("+", 1)[0]


def region_of(key: str) -> str:
    """``backward:last#0+3`` (or its segment) -> ``last``; ``""`` for a moment without one (``forward``, ``clip``)."""
    return key.partition(":")[2].split("#", 1)[0]


@dataclass(frozen=True)
class Moments:
    """A step's moments as arrays, for a search's per-candidate arithmetic: each moment's key, phase (its index in
    ``PHASES``), bytes (int64, ``Category`` order) and the share of the step's gradients it holds."""

    keys: tuple[str, ...]
    phases: np.ndarray
    rows: np.ndarray
    grads_done: np.ndarray

    @classmethod
    def of(cls, regions: dict[str, tuple[int, ...]]) -> Moments:
        """``regions`` (``Timeline.region_peaks``-style keys and rows) as arrays."""
        keys = tuple(regions)
        phases = np.array([_PHASE[k.split(":", 1)[0].split("#", 1)[0]] for k in keys], dtype=np.int64)
        return cls._made(keys, phases, _array(list(regions.values())))

    @classmethod
    def _made(cls, keys: tuple[str, ...], phases: np.ndarray, rows: np.ndarray) -> Moments:
        g_total = rows[:, _G].max(initial=0)
        grads_done = rows[:, _G] / g_total if g_total else np.zeros(len(keys))
        return cls(keys, phases, rows, grads_done)

    def joined(self, other: Moments) -> Moments:
        """These moments followed by ``other``'s (keys apart), the gradients' shares taken over both."""
        rows = np.concatenate((self.rows, other.rows))
        return Moments._made(self.keys + other.keys, np.concatenate((self.phases, other.phases)), rows)

    def steady(self, accumulated: bool) -> Moments:
        """Every moment with the optimizer state whole (at its highest over the clip and optimizer moments, or over
        all where there are none: the step ran inside backward), and with ``accumulated`` micro-batches every
        forward and backward moment holding all gradients (later micro-batches run with them alive)."""
        rows = self.rows.copy()
        own = (self.phases == _PHASE["clip"]) | (self.phases == _PHASE["optimizer"])
        _whole_state(rows, rows[own] if own.any() else rows)
        if accumulated:
            rows[~own, _G] = rows[:, _G].max(initial=0)
        return self.with_rows(rows)

    def with_rows(self, rows: np.ndarray) -> Moments:
        return Moments(self.keys, self.phases, rows, self.grads_done)

    def collapse(self) -> StepMemory:
        """``collapse_regions`` of these moments: per phase the first moment with the most device bytes."""
        device, host = _device_and_host(self.rows)
        firsts = sorted((int(np.flatnonzero(self.phases == code)[0]), int(code)) for code in np.unique(self.phases))
        phase_peaks = {}
        for _, code in firsts:
            at = np.flatnonzero(self.phases == code)
            row = self.rows[at[np.argmax(device[at])]].tolist()
            phase_peaks[PHASES[code]] = Breakdown(dict(zip(CATEGORIES, row)))
        peak_phase = max(phase_peaks, key=lambda p: phase_peaks[p].total_bytes)
        host_peak = int(host.max(initial=0))
        return StepMemory(phase_peaks[peak_phase], phase_peaks, peak_phase, host_peak)
