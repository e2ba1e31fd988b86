"""Fast per-configuration predictions from a handful of shallow traces.

Forward and backward depend on (checkpointing, precision, LoRA). At a fixed depth, the step at
micro-batch B runs the same ops as at B = 2 and 3 with every tensor's batch dimension scaled, so the
bytes after each op are linear in B (but see ``_traced_as_is``): the timelines at B = 2 and 3 (one trace, at a prime
micro-batch, resized to each: ``trace.steady_timelines``) are combined op by op, and only then is the peak taken
(the moment of the peak may move with B). Each
phase's peak is then linear in depth (identical decoder layers): two depths extrapolate to any depth. The
optimizer and clipping phases depend on (precision, optimizer implementation and states, LoRA) only: they are
traced apart (``StepSpec.part``: forward and backward without an optimizer; the update alone, on gradients made
for it, at one and two layers). Traces are cached, so a search over hundreds of candidates costs a few dozen
traces of one to four layers, and the moments are combined once per set of levers that share them.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any

import numpy as np

from memfit.config.strategy import CheckpointPolicy, Strategy
from memfit.errors import UserError
from memfit.models.planning import layer_prefix
from memfit.planner import trace_cache
from memfit.planner.categories import Category, StepMemory
from memfit.planner.cost import TrainedWhole
from memfit.planner.sharding import ShardingSpec, per_rank_moments, root_fraction
from memfit.planner.spec import StepSpec, extrapolate_regions, extrapolation_depths
from memfit.planner.timeline import LAYER_REGIONS, Moments, Timeline, region_of, segment_of

LOSS_DELTA_DEPTH = 2  # decoder layers of the traces that measure what a chunked loss changes
LINE_BATCHES = (2, 3)  # the micro-batches a step's bytes are drawn through, op by op (``Predictor._at_batch``)


class Predictor:
    """Predict one device's (or rank's) steady-state step memory for any ``Strategy``.

    Args:
        base: a StepSpec carrying the model config, sequence length, LoRA and rounding; its
            strategy is replaced per query.
    """

    def __init__(self, base: StepSpec):
        self.base = base
        self.depth = base.model_config.num_hidden_layers
        self._cache: dict[tuple, Timeline] = {}
        self._moments: dict[tuple, dict[str, tuple[int, ...]]] = {}
        self._opt: dict[tuple, Moments] = {}
        self._full: dict[tuple, Moments] = {}  # _passes
        self._steady: dict[tuple, Moments] = {}  # predict: the moments of the step, made steady
        self._loss_segments: dict[tuple, tuple] = {}  # _with_chunked_loss: by the two traces' moment keys
        self.traces = 0  # timelines this predictor read: traced, or ``cached`` of them from the trace cache
        self.cached = 0

    @staticmethod
    def _key(spec: StepSpec, layers: int) -> tuple:
        return (spec.strategy, spec.part, layers)

    def _trace(self, spec: StepSpec, layers: int) -> Timeline:
        return self._timelines((spec,), layers)[0]

    def _line(self, spec: StepSpec, layers: int) -> list[Timeline]:
        """The timelines at micro-batches 2 and 3 that ``_at_batch`` draws its line through."""
        return self._timelines(_line_specs(spec), layers)

    def _timelines(self, specs: tuple[StepSpec, ...], layers: int) -> list[Timeline]:
        """Each of ``specs`` (one, or ``_line``'s) from this predictor, else the trace cache, else traced: the
        missing ones of a line in one trace (``trace.steady_timelines``)."""
        missing = self._read(specs, layers)
        if missing:
            from memfit.planner.trace import steady_timelines  # the tracing machinery, only when a trace is missing

            self._keep(missing, layers, steady_timelines(list(missing), min(layers, self.depth)))
        return [self._cache[self._key(s, layers)] for s in specs]

    def _read(self, specs: Iterable[StepSpec], layers: int) -> tuple[StepSpec, ...]:
        """Take what the trace cache holds of ``specs`` into this predictor; the ones neither holds."""
        missing = []
        for spec in specs:
            key = self._key(spec, layers)
            if key in self._cache:
                continue
            timeline = trace_cache.load(trace_cache.trace_key(spec, min(layers, self.depth)))
            if timeline is None:
                missing.append(spec)
                continue
            self._cache[key] = timeline
            self.traces += 1
            self.cached += 1
        return tuple(missing)

    def _keep(self, specs: tuple[StepSpec, ...], layers: int, timelines: list[Timeline]) -> None:
        for spec, timeline in zip(specs, timelines):
            trace_cache.store(trace_cache.trace_key(spec, min(layers, self.depth)), timeline)
            self._cache[self._key(spec, layers)] = timeline
            self.traces += 1

    def _step_spec(self, strategy: Strategy) -> StepSpec:
        """Forward and backward do not depend on the optimizer, the accumulation or the ZeRO stage (applied
        afterwards), nor on the micro-batch (extrapolated): one spec per remaining levers traces them all.
        With the optimizer step in backward, backward holds the steps: its optimizer is kept."""
        if strategy.optimizer_in_backward:
            optimizer, part = {}, "step"
        else:
            optimizer, part = {"optimizer": "for-loop", "optimizer_name": "adamw", "optimizer_offload": False}, "passes"
        return replace(
            self.base,
            strategy=strategy.replace(**optimizer, micro_batch_size=1, grad_accum_steps=1, zero_stage=0),
            part=part,
        )

    def _optimizer_spec(self, spec: StepSpec, strategy: Strategy) -> StepSpec:
        """Clipping and the optimizer step depend on the precision, the frozen weights' storage and the optimizer
        only."""
        return replace(
            spec,
            strategy=Strategy(
                precision=spec.strategy.precision,
                quantize_base=spec.strategy.quantize_base,
                optimizer=strategy.optimizer,
                optimizer_name=strategy.optimizer_name,
                optimizer_offload=strategy.optimizer_offload,
                micro_batch_size=2,
            ),
            part="update",
        )

    def _optimizer_depths(self) -> tuple[int, ...]:
        """Depths traced for clipping and the optimizer step: at any depth they hold every parameter, gradient and
        state, and the largest step's temporaries (of one parameter, or of all in a foreach or fused step), so their
        peaks are linear in depth from one layer on (``test_update_moments_extrapolate_from_one_and_two_layers``),
        or from the first layer like the rest (``layer_prefix``); layers of two kinds in turn: the model whole."""
        prefix = layer_prefix(self.base.model_config)
        if prefix is None or self.depth <= prefix + 2:
            return (self.depth,)
        return prefix + 1, prefix + 2

    def _step_depths(self, spec: StepSpec) -> tuple[int, ...]:
        """Depths traced for forward and backward: the model whole when shallow, else two to extrapolate."""
        la, lb = extrapolation_depths(spec)
        return (self.depth,) if self.depth <= lb else (la, lb)

    def _requests(self, strategy: Strategy) -> list[tuple[tuple[StepSpec, ...], int]]:
        """The timelines ``predict(strategy)`` reads, for any micro-batch, accumulation and ZeRO stage: (specs, layers)
        of one trace each (a line's two micro-batches are one)."""
        spec = self._step_spec(strategy)
        out = self._pass_requests(spec, strategy)
        if strategy.zero_stage >= 2 and strategy.precision in _FSDP2_COMPUTE and not strategy.optimizer_in_backward:
            # FSDP2's ranks compute in bf16 copies (``_fsdp2_mixed``): their passes too
            out += self._pass_requests(spec.with_strategy(precision=_FSDP2_COMPUTE[strategy.precision]), strategy)
        if strategy.optimizer_in_backward:  # no optimizer phase: the steps are traced inside backward
            return out
        return out + [((self._optimizer_spec(spec, strategy),), n) for n in self._optimizer_depths()]

    def _pass_requests(self, spec: StepSpec, strategy: Strategy) -> list[tuple[tuple[StepSpec, ...], int]]:
        """The forward and backward traces of ``spec`` (a ``_step_spec``) that ``_passes`` reads."""
        depths = self._step_depths(spec)
        if _traced_as_is(strategy):
            out = [((spec.with_strategy(micro_batch_size=strategy.micro_batch_size),), n) for n in depths]
        else:
            layers = spec if len(depths) == 1 else spec.with_strategy(loss_chunks=0)
            out = [(_line_specs(layers), n) for n in depths]
            if len(depths) == 2 and strategy.loss_chunks:
                out += [(_line_specs(s), LOSS_DELTA_DEPTH) for s in self._loss_delta_specs(spec)]
        return out

    def _loss_delta_specs(self, spec: StepSpec) -> tuple[StepSpec, StepSpec]:
        """(chunked, plain) specs of the shallow traces ``_with_chunked_loss`` reads."""
        chunked = spec.with_strategy(activation_checkpointing=CheckpointPolicy())
        return chunked, chunked.with_strategy(loss_chunks=0)

    def _with_chunked_loss(
        self, regions: dict[str, tuple[int, ...]], spec: StepSpec, micro_batch: int
    ) -> dict[str, tuple[int, ...]]:
        """The unchunked moments at full depth (``regions``) with the loss's moments replaced by chunked ones.

        The output projection and the loss run after the decoder layers in forward and before them in
        backward, in segments of their own ("forward:outer#1", "forward:loss#0", "backward:loss#0",
        "backward:outer#0"), which keep their place in the step. Inside such a segment,
        what depth and checkpointing change (the layers' parameters, gradients and saved activations) is
        the same at every moment, and what chunking changes does not depend on them. So the chunked
        segments are traced once per precision and chunk count, at ``LOSS_DELTA_DEPTH`` layers without
        checkpointing, and shifted by what the full-depth unchunked segment holds beyond the shallow one
        at its first moment. ``test_predicted_chunked_loss_equals_direct_traces_per_category`` holds it
        to direct traces.
        """
        chunked_spec, plain_spec = self._loss_delta_specs(spec)
        c = self._at_batch(chunked_spec, LOSS_DELTA_DEPTH, micro_batch)
        p = self._at_batch(plain_spec, LOSS_DELTA_DEPTH, micro_batch)
        key = (tuple(c), tuple(p))  # the same at every micro-batch: one op sequence
        if key not in self._loss_segments:
            self._loss_segments[key] = _segments(c), _segments(p)
        cs, ps = self._loss_segments[key]
        # segments whose ops chunking changes, and those outside the layers whose bytes it changes (the embeddings'
        # backward of tied weights, where a chunked head's gradient is summed in place)
        changed = {
            n
            for n in cs.keys() | ps.keys()
            if cs.get(n) != ps.get(n) or (region_of(n) not in LAYER_REGIONS and any(c[k] != p[k] for k in cs[n]))
        }
        out: dict[str, tuple[int, ...]] = {}
        for k, v in regions.items():  # in op order: a rank's rules read where a moment is in the step
            name = segment_of(k)
            if name not in changed:
                out[k] = v
            elif name in cs and cs[name][0] not in out:
                first = ps[name][0]  # the segment's first moment, unchunked
                shift = tuple(a - b for a, b in zip(regions[first], p[first]))
                out.update((key, tuple(x + d for x, d in zip(c[key], shift))) for key in cs[name])
        return out

    def prefetch(self, strategies: Iterable[Strategy], workers: int | None = None) -> None:
        """Trace, in parallel worker processes, everything ``predict`` will read for these strategies.
        Traces are pure Python-bound work on fake tensors,
        so N processes take about 1/N of the time; the results are identical to tracing on demand.

        Args:
            workers: processes (default ``MEMFIT_PLAN_WORKERS`` or this machine's cores, at most 8);
                1, or a platform without ``fork``, traces on demand in this process.
        """
        jobs: dict[tuple, tuple[tuple[StepSpec, ...], int]] = {}  # one trace each, by the keys it fills
        for strategy in strategies:
            for specs, layers in self._requests(strategy):
                missing = self._read(specs, layers)
                keys = tuple(self._key(s, layers) for s in missing)
                if missing and not any(k in job for job in jobs for k in keys):
                    jobs[keys] = (missing, layers)
        workers = min(workers or plan_workers(), len(jobs))
        if workers < 2:
            return
        # the longest first (deeper, and forward and backward before the update alone), so no worker is left with one
        items = sorted(((specs, n, min(n, self.depth)) for specs, n in jobs.values()), key=_trace_cost, reverse=True)
        with _pool(workers) as pool:
            for (specs, layers), timelines in pool.imap_unordered(_trace_job, items):
                self._keep(specs, layers, timelines)

    def _at_batch(self, spec: StepSpec, layers: int, micro_batch: int) -> dict[str, tuple[int, ...]]:
        """Moments of the first step at ``micro_batch``, from the op-by-op line through B = 2 and 3.

        B = 1 lies on that line too, but for a couple of ops (size-1 dimensions turn copies into
        views): measured over presets tiny..llama2-7b the peak differs by <= 0.003%.
        """
        key = (spec.strategy, layers, micro_batch)
        if key not in self._moments and _traced_as_is(spec.strategy):
            self._moments[key] = self._trace(spec.with_strategy(micro_batch_size=micro_batch), layers).region_peaks()
        if key not in self._moments:
            two, three = self._line(spec, layers)
            if two.phases == three.phases:
                self._moments[key] = two.combine(three, micro_batch - 2).region_peaks()
            else:  # not expected; trace the batch size itself
                self._moments[key] = self._trace(
                    spec.with_strategy(micro_batch_size=micro_batch), layers
                ).region_peaks()
        return self._moments[key]

    def _optimizer_moments(self, spec: StepSpec) -> Moments:
        """Clipping and optimizer-step peaks: independent of micro-batch and checkpointing."""
        key = (
            spec.strategy.precision,
            spec.strategy.quantize_base,
            spec.strategy.optimizer,
            spec.strategy.optimizer_name,
            spec.strategy.optimizer_offload,
        )
        if key not in self._opt:
            depths = self._optimizer_depths()
            if len(depths) == 2:
                oa, ob = (self._trace(spec, n).region_peaks() for n in depths)
                regions = extrapolate_regions(oa, ob, *depths, self.depth)
            else:
                regions = self._trace(spec, self.depth).region_peaks()
            self._opt[key] = Moments.of({k: v for k, v in regions.items() if k in ("clip", "optimizer")})
        return self._opt[key]

    def _passes(self, spec: StepSpec, micro_batch: int) -> Moments:
        """Forward and backward moments of ``spec`` (a ``_step_spec``) at full depth and ``micro_batch``: one per
        search for every accumulation, ZeRO stage and optimizer that share them."""
        key = (spec.strategy, micro_batch)
        if key in self._full:
            return self._full[key]
        strategy = spec.strategy
        depths = self._step_depths(spec)
        if len(depths) == 1:  # shallow model: traced whole
            regions = dict(self._at_batch(spec, self.depth, micro_batch))
        elif _traced_as_is(strategy):
            la, lb = depths
            ra, rb = self._at_batch(spec, la, micro_batch), self._at_batch(spec, lb, micro_batch)
            regions = extrapolate_regions(ra, rb, la, lb, self.depth, strategy.activation_offload)
        else:
            la, lb = depths
            plain = spec.with_strategy(loss_chunks=0)
            ra, rb = self._at_batch(plain, la, micro_batch), self._at_batch(plain, lb, micro_batch)
            regions = extrapolate_regions(ra, rb, la, lb, self.depth)
            if strategy.loss_chunks:
                regions = self._with_chunked_loss(regions, spec, micro_batch)
        self._full[key] = Moments.of({k: v for k, v in regions.items() if k.startswith(("forward", "backward"))})
        return self._full[key]

    def _with_compute_copies(
        self, sharding: ShardingSpec, passes: StepSpec, update: StepSpec, micro_batch: int
    ) -> ShardingSpec:
        """``sharding`` with the share of the stored parameters' and gradients' bytes that FSDP2's compute copies
        (``passes``, traced in the compute dtype) take: what a rank gathers and holds unsharded in backward."""
        traced = self._passes(passes, micro_batch).rows
        p, g = _stored(self._optimizer_moments(update))
        config, lora = self.base.model_config, self.base.lora
        trained = TrainedWhole.of_run(config, lora) if lora else TrainedWhole()
        return replace(
            sharding,
            # the root group's share of the compute copies: a trained element weighs as much as a frozen one there
            root_param_fraction=root_fraction(config, trained),
            compute_param_fraction=int(traced[:, _P].max(initial=0)) / p if p else 1.0,
            compute_grad_fraction=int(traced[:, _G].max(initial=0)) / g if g else 1.0,
        )

    def predict(self, strategy: Strategy, sharding: ShardingSpec | None = None) -> StepMemory:
        """The steady-state step of ``strategy`` on one device, or on one rank of ``sharding`` (which
        carries the ZeRO stage's rules for this model and world size).

        Every moment of the step is made steady (optimizer state whole; with accumulation, forward and
        backward run with all gradients alive) and, for a rank, sharded, before the peaks are taken.
        """
        micro_batch, accumulated = strategy.micro_batch_size, strategy.grad_accum_steps > 1
        spec = self._step_spec(strategy)
        update = None
        if not strategy.optimizer_in_backward:
            # with several ranks the engine offloads its shards (``ShardingSpec.offload``): the step is traced as
            # the plain AdamW it runs on them
            stepped = strategy if sharding is None else strategy.replace(optimizer_offload=False)
            update = self._optimizer_spec(spec, stepped)
        passes = spec
        if update is not None and _fsdp2_mixed(strategy, sharding):
            passes = spec.with_strategy(precision=_FSDP2_COMPUTE[strategy.precision])
            sharding = self._with_compute_copies(sharding, passes, update, micro_batch)
        key = (passes.strategy, micro_batch, update and update.strategy, accumulated)
        if key not in self._steady:
            moments = self._passes(passes, micro_batch)
            if passes is not spec:
                moments = _as_stored(moments, self._optimizer_moments(update))
            if update is not None:
                moments = moments.joined(self._optimizer_moments(update))
            # the optimizer state is created lazily in step 1 and whole afterwards: traced with forward and
            # backward only when the step runs inside backward (else those traces ran no optimizer: _step_spec)
            self._steady[key] = moments.steady(accumulated)
        moments = self._steady[key]
        if sharding is not None:
            return per_rank_moments(moments, sharding, accumulated=accumulated)
        return moments.collapse()


def _traced_as_is(strategy: Strategy) -> bool:
    """Whether ``strategy``'s forward and backward are traced at its own micro-batch and loss chunks (at two
    depths) instead of from the B = 2, 3 line and the chunked loss's shift: with a fallback lever on.

    Activation offloading decides per tensor by its size (``MIN_OFFLOAD_BYTES``, the prefetch budget), so the
    step is not linear in B, and its copies run through the chunked loss's segments; the step in backward
    puts the optimizer into those segments. Both are tried only where their twin does not fit (a few
    candidates of a search), and a fake trace costs the same at any batch size.
    """
    return strategy.optimizer_in_backward or strategy.activation_offload


_FSDP2_COMPUTE = {"bf16-mixed": "bf16-pure"}
"""The precision FSDP2's ``MixedPrecisionPolicy`` computes in, for a mixed precision it runs without autocast."""
_P, _G = (tuple(Category).index(c) for c in (Category.PARAMS, Category.GRADS))


def _fsdp2_mixed(strategy: Strategy, sharding: ShardingSpec | None) -> bool:
    """Whether ``strategy`` on ``sharding``'s ranks runs as FSDP2 runs a mixed precision: parameters stored in fp32
    and sharded, gathered as compute copies (bf16), gradients made in bf16 and reduced in fp32, no autocast (so no
    per-use weight casts, which a single device's autocast trace holds)."""
    return (
        sharding is not None
        and sharding.engine == "fsdp2"
        and sharding.stage >= 2
        and strategy.precision in _FSDP2_COMPUTE
        and not strategy.optimizer_in_backward
    )


def _stored(update: Moments) -> tuple[int, int]:
    """The parameters' and the gradients' bytes as stored: the most the update's moments hold."""
    return int(update.rows[:, _P].max(initial=0)), int(update.rows[:, _G].max(initial=0))


def _as_stored(moments: Moments, update: Moments) -> Moments:
    """Passes traced in the compute dtype, with the parameters and gradients as stored (``update``'s: the trained
    weights in fp32): parameters whole at every moment, the gradients made so far in the same share of all."""
    rows = moments.rows.copy()
    p, g = _stored(update)
    g_traced = int(rows[:, _G].max(initial=0))
    rows[:, _P] = p
    if g_traced:
        rows[:, _G] = (rows[:, _G].astype(np.float64) * (g / g_traced)).astype(np.int64)
    return moments.with_rows(rows)


def _segments(regions: dict[str, tuple[int, ...]]) -> dict[str, list[str]]:
    """Moment keys by segment, in op order."""
    out: dict[str, list[str]] = {}
    for key in regions:
        out.setdefault(segment_of(key), []).append(key)
    for keys in out.values():
        keys.sort(key=lambda k: int(k.rsplit("+", 1)[1]) if "+" in k else -1)
    return out


def plan_workers() -> int:
    """Processes for parallel traces: ``MEMFIT_PLAN_WORKERS``, else the cores this process may use
    (at most 8); 1 where ``fork`` is unavailable or unsafe (only Linux is trusted with it here)."""
    if sys.platform != "linux" or "fork" not in multiprocessing.get_all_start_methods():
        return 1
    env = os.environ.get("MEMFIT_PLAN_WORKERS", "").strip()
    if env:
        if not env.isdigit():
            raise UserError(f"MEMFIT_PLAN_WORKERS must be a whole number of processes (got {env!r})")
        return max(1, int(env))
    return min(8, len(os.sched_getaffinity(0)))


_SHARED: dict[str, Any] = {"depth": 0, "pool": None, "fork_unsafe": False}
"""``trace_workers``' pool: how many blocks are open, the pool their prefetches share (made at the first), and
whether this process's forked children were found unable to run autograd (``_new_pool``)."""


@contextlib.contextmanager
def trace_workers() -> Iterator[None]:
    """Every ``prefetch`` inside the block traces in one pool of worker processes, made at the first that needs
    one and closed when the block ends (a block inside another shares the outer one's).

    A worker keeps what it learned between traces: the fake-tensor dispatch cache and the NF4 layouts of
    ``strategies.lora`` (a first NF4 trace in a fresh worker costs about 1 s more than the next). A pool per
    ``prefetch`` paid that in each of the ten or so ``search`` makes for its fallbacks; a cold 70B QLoRA search
    on 2 cores took longer with two workers than with one.
    """
    _SHARED["depth"] += 1
    try:
        yield
    finally:
        _SHARED["depth"] -= 1
        if not _SHARED["depth"] and _SHARED["pool"] is not None:
            pool, _SHARED["pool"] = _SHARED["pool"], None
            pool.terminate()  # idle: every prefetch has taken its results
            pool.join()


@contextlib.contextmanager
def _pool(workers: int) -> Iterator[Any]:
    """``trace_workers``' pool (made with ``workers`` processes if none is yet), else one for this prefetch alone."""
    shared = _SHARED["depth"] > 0
    if shared and _SHARED["pool"] is not None:
        yield _SHARED["pool"]
        return
    if shared:  # later prefetches may have more to trace than this one: as many as the cores, if asked for
        workers = min(plan_workers(), max(workers, len(os.sched_getaffinity(0))))
    pool = _new_pool(workers)
    if shared:
        _SHARED["pool"] = pool
        yield pool
        return
    with pool:
        yield pool


def _new_pool(workers: int) -> Any:
    """``workers`` processes forked from this one, or from a fresh server process where a forked child cannot run
    autograd.

    Forked, the children inherit the imported torch/transformers and the tracing machinery (a fresh interpreter, or
    each child importing it, costs seconds). But PyTorch refuses a backward in a forked child once the parent's
    autograd engine has started its device threads, which a build with CUDA or ROCm does at its first backward, with
    a device or not (the CPU build starts none): a plan made after training in the same process (``train.on_oom``,
    ``memfit bench``'s cells, a test) failed in every worker. So a new forked pool first runs a one-element backward
    in a worker; where that is refused, this process's pools are forked from then on from a server process that
    imported the tracing machinery and never ran autograd (``forkserver``, a few seconds once)."""
    import memfit.planner.trace  # noqa: F401

    if not _SHARED["fork_unsafe"]:
        pool = multiprocessing.get_context("fork").Pool(workers, initializer=torch_single_thread)
        if pool.apply(_backward_runs):
            return pool
        pool.terminate()
        pool.join()
        _SHARED["fork_unsafe"] = True
    server = multiprocessing.get_context("forkserver")
    server.set_forkserver_preload(["memfit.planner.trace"])
    return server.Pool(workers, initializer=torch_single_thread)


def _trace_cost(item: tuple[tuple[StepSpec, ...], int, int]) -> tuple[bool, int]:
    specs, _, depth = item
    return specs[0].part != "update", depth


def _backward_runs() -> bool:
    """Whether autograd runs in this (forked) process."""
    import torch

    try:
        torch.ones(1, requires_grad=True).sum().backward()
    except RuntimeError:  # "Unable to handle autograd's threading in combination with fork-based multiprocessing"
        return False
    return True


def torch_single_thread() -> None:
    import torch

    torch.set_num_threads(1)  # the workers already fill the cores


def _line_specs(spec: StepSpec) -> tuple[StepSpec, ...]:
    return tuple(spec.with_strategy(micro_batch_size=b) for b in LINE_BATCHES)


def _trace_job(item: tuple[tuple[StepSpec, ...], int, int]) -> tuple[tuple[tuple[StepSpec, ...], int], list[Timeline]]:
    """(specs, layers asked, layers traced) -> ((specs, layers asked), their timelines): one trace, in a worker."""
    from memfit.planner.trace import steady_timelines

    specs, layers, depth = item
    try:
        return (specs, layers), steady_timelines(list(specs), depth)
    except UserError:
        raise
    except Exception as e:  # one the parent can unpickle (torch's hold C++ objects: MaybeEncodingError), with the
        # cause's traceback in the text the pool sends along
        raise RuntimeError(f"the planner's trace failed: {type(e).__name__}: {e}") from e
