"""The longest sequence and the biggest micro-batch a candidate fits: ``memfit plan --max-seq-len / --max-micro-batch``.

Both are searched over traced predictions, not computed from a formula: a candidate's other levers fixed (its
precision, checkpointing, ZeRO stage, offloading; the accumulation as it has it), one value at a time is
predicted exactly as the search predicts a candidate (``search.evaluate``: device bytes, host bytes, the same
fit test): doubling until it stops fitting, then closing the gap (``largest_fitting``) until a value fits and
the next one up does not. Fitting is taken to be monotone in either value (more tokens never need less memory).

- Micro-batch: integers from the candidate's own up to ``MAX_MICRO_BATCH``; no new traces where the step is
  linear in the batch (``predict._traced_as_is``), otherwise two per probe.
- Sequence length: multiples of ``SEQ_STEP`` tokens up to the model's ``max_position_embeddings``; every probe is
  a new shape, traced at the planner's shallow depths (several candidates' probes at one length share one
  ``Predictor``, traced together in parallel and kept in the trace cache). A candidate that does not fit at the
  requested length is searched downwards: the longest length at which it would.

All candidates' searches run in lockstep (each round, every open search names its next probe; the probes are
evaluated together), so parallel tracing serves them all.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, replace

from memfit.planner.predict import Predictor
from memfit.planner.search import Candidate, PlanResult, evaluate

SEQ_STEP = 128  # tokens: the granularity of the longest sequence found (kernels tile by 64-128 tokens)
MAX_MICRO_BATCH = 1024  # the micro-batch search stops here (shown as "1024+")

Search = Generator[int, bool, int]


@dataclass(frozen=True)
class Limit:
    """The largest value at which a candidate fits (0: none), and whether the search stopped at its ceiling
    (the model's ``max_position_embeddings``, ``MAX_MICRO_BATCH``) rather than at the memory."""

    value: int
    at_ceiling: bool

    def label(self) -> str:
        if self.value == 0:
            return "none"
        return f"{self.value}+" if self.at_ceiling else str(self.value)


def largest_fitting(good: int, bad: int | None, ceiling: int, step: int) -> Search:
    """Search the largest value that fits, as a generator: it yields a value to try, is sent (fits, slack bytes:
    usable less needed, negative when over) for that value, and returns the answer.

    Doubles from ``good`` until a value does not fit; then guesses where the slack crosses zero on the line
    through the closest values either side (memory is nearly linear in tokens, so the guess lands within a step
    or two) and confirms the edge by trying the next step up; where a guess misses, its value narrows the
    bracket, and a halving takes over when guesses stop closing it.

    Args:
        good: a value known to fit (0: none known).
        bad: a value known not to fit (None: none known; the search doubles from ``good`` until one fails).
        ceiling: the largest value allowed; returned when it fits.
        step: probes are multiples of it (``good`` and ``ceiling`` themselves need not be).
    """
    slack: dict[int, int] = {}
    while bad is None:
        probe = min(ceiling, max(2 * good // step * step, step))  # > good: 2 x good - step >= good
        fits, slack[probe] = yield probe
        if fits:
            good = probe
            if probe == ceiling:
                return good
        else:
            bad = probe
    guessing = True
    while True:
        lo, hi = good // step * step + step, (bad - 1) // step * step  # the multiples of step strictly inside
        if lo > hi:
            return good
        mid = (lo + hi) // 2 // step * step
        if guessing and good in slack and bad in slack and slack[good] > slack[bad]:
            cross = good + (bad - good) * slack[good] / (slack[good] - slack[bad])
            mid = min(hi, max(lo, int(cross) // step * step))
        fits, slack[mid] = yield mid
        if fits:
            good = mid
            if mid + step <= hi:  # the edge, if the guess was right
                fits, slack[mid + step] = yield mid + step
                if fits:
                    good = mid + step
                else:
                    bad = mid + step
        else:
            bad = mid
            guessing = not guessing  # a missed guess: halve once before guessing again


def run_lockstep(
    searches: Sequence[Search], evaluate: Callable[[list[tuple[int, int]]], list[tuple[bool, int]]]
) -> list[int]:
    """Drive several ``largest_fitting`` searches together: each round, ``evaluate`` gets every open search's
    (index, probe) at once and answers (fits, slack bytes) for each."""
    answers: list[int | None] = [None] * len(searches)
    probes: dict[int, int] = {}
    for i, s in enumerate(searches):
        try:
            probes[i] = next(s)
        except StopIteration as done:
            answers[i] = done.value
    while probes:
        asked = sorted(probes.items())
        probes = {}
        for (i, _), answer in zip(asked, evaluate(asked)):
            try:
                probes[i] = searches[i].send(answer)
            except StopIteration as done:
                answers[i] = done.value
    return [a if a is not None else 0 for a in answers]


def _verdict(c: Candidate) -> tuple[bool, int]:
    """Whether a probe fits, and its device slack (host memory only decides, it is not interpolated)."""
    return c.fits, c.headroom_bytes


def max_micro_batches(result: PlanResult, chosen: Sequence[Candidate]) -> list[Limit]:
    """For each chosen (fitting) candidate, the largest micro-batch with which it still fits, its accumulation
    unchanged."""
    predictor = result.predictor
    assert predictor is not None, "a PlanResult from search() carries its predictor"

    def fits(asked: list[tuple[int, int]]) -> list[tuple[bool, int]]:
        strategies = [chosen[i].strategy.replace(micro_batch_size=b) for i, b in asked]
        predictor.prefetch(strategies)
        return [_verdict(evaluate(s, result, predictor)) for s in strategies]

    before = predictor.traces, predictor.cached
    searches = [largest_fitting(c.strategy.micro_batch_size, None, MAX_MICRO_BATCH, 1) for c in chosen]
    values = run_lockstep(searches, fits)
    result.traces += predictor.traces - before[0]
    result.cached_traces += predictor.cached - before[1]
    return [Limit(v, v >= MAX_MICRO_BATCH) for v in values]


def max_seq_lens(result: PlanResult, chosen: Sequence[Candidate]) -> list[Limit]:
    """For each chosen candidate, the longest sequence (a multiple of ``SEQ_STEP``, or the requested or the model's
    longest) at which it fits; searched downwards from the requested length for one that does not fit there."""
    base = result.predictor.base if result.predictor else None
    assert base is not None, "a PlanResult from search() carries its predictor"
    w = result.workload
    ceiling = w.model_config.max_position_embeddings
    predictors: dict[int, Predictor] = {w.seq_len: result.predictor}

    def fits(asked: list[tuple[int, int]]) -> list[tuple[bool, int]]:
        by_len: dict[int, list[int]] = {}
        for i, seq in asked:
            by_len.setdefault(seq, []).append(i)
        out: dict[int, tuple[bool, int]] = {}
        for seq, ids in by_len.items():
            if seq not in predictors:
                predictors[seq] = Predictor(replace(base, seq_len=seq))
            predictor = predictors[seq]
            predictor.prefetch([chosen[i].strategy for i in ids])
            shaped = replace(result, workload=replace(w, seq_len=seq))
            for i in ids:
                out[i] = _verdict(evaluate(chosen[i].strategy, shaped, predictor))
        return [out[i] for i, _ in asked]

    searches = [
        largest_fitting(w.seq_len, None, ceiling, SEQ_STEP)
        if c.fits
        else largest_fitting(0, w.seq_len, ceiling, SEQ_STEP)
        for c in chosen
    ]
    values = run_lockstep(searches, fits)
    result.traces += sum(p.traces for s, p in predictors.items() if s != w.seq_len)
    result.cached_traces += sum(p.cached for s, p in predictors.items() if s != w.seq_len)
    return [Limit(v, v >= ceiling) for v in values]
