"""Fast per-configuration predictions from a handful of shallow traces.

Forward and backward depend on (checkpointing, precision, LoRA). At a fixed depth, the step at
micro-batch B >= 2 runs the same ops as at B = 2 and 3 with every tensor's batch dimension scaled, so
the bytes after each op are linear in B: the timelines at B = 2 and 3 are combined op by op, and only
then is the peak taken (the moment of the peak may move with B). Each phase's peak is then linear in
depth (identical decoder layers): two depths extrapolate to any depth. The optimizer and clipping
phases depend on (precision, optimizer implementation, LoRA) only. Traces are cached, so a search
over hundreds of candidates costs a few dozen traces of two to four layers.
"""

from __future__ import annotations

from dataclasses import replace

from memfit.memory.categories import Breakdown, Category, StepMemory
from memfit.memory.trace import StepSpec, extrapolate_regions, extrapolation_depths, steady_state, trace_timeline
from memfit.memory.tracker import Timeline, collapse_regions


class Predictor:
    """Predict one device's steady-state step memory for any (AC, precision, optimizer, B, accum).

    Args:
        base: a StepSpec carrying the model config, sequence length, LoRA and rounding; its
            strategy fields are replaced per query.
    """

    def __init__(self, base: StepSpec):
        self.base = base
        self.depth = base.model_config.num_hidden_layers
        self._cache: dict[tuple, Timeline] = {}
        self.traces = 0

    def _trace(self, spec: StepSpec, layers: int) -> Timeline:
        key = (spec.precision, spec.activation_checkpointing, spec.optimizer_implementation, spec.micro_batch_size, layers)
        if key not in self._cache:
            self._cache[key] = trace_timeline(spec, min(layers, self.depth))
            self.traces += 1
        return self._cache[key]

    def _at_batch(self, spec: StepSpec, layers: int, micro_batch: int) -> dict[str, Breakdown]:
        """Region peaks of the first step at ``micro_batch``: B <= 2 traced as is; larger B from the
        op-by-op line through B = 2 and 3 (B = 1 is not on that line: size-1 dimensions let some
        copies become views, so its op list differs)."""
        if micro_batch <= 2:
            return self._trace(replace(spec, micro_batch_size=micro_batch), layers).region_peaks()
        two = self._trace(replace(spec, micro_batch_size=2), layers)
        three = self._trace(replace(spec, micro_batch_size=3), layers)
        if two.phases != three.phases:  # not expected; fall back to tracing the batch size itself
            return self._trace(replace(spec, micro_batch_size=micro_batch), layers).region_peaks()
        return two.combine(three, micro_batch - 2).region_peaks()

    def predict(self, ac: str, precision: str, optimizer: str, micro_batch: int, grad_accum: int = 1) -> StepMemory:
        spec = replace(self.base, activation_checkpointing=ac, precision=precision, optimizer_implementation="for-loop",
                       micro_batch_size=1, grad_accum_steps=1)
        la, lb = extrapolation_depths(spec)
        if self.depth <= lb:  # shallow model: trace it whole
            regions = dict(self._at_batch(spec, self.depth, micro_batch))
        else:
            ra, rb = self._at_batch(spec, la, micro_batch), self._at_batch(spec, lb, micro_batch)
            regions = extrapolate_regions(ra, rb, la, lb, self.depth)
        regions = {k: v for k, v in regions.items() if k.startswith(("forward", "backward"))}
        opt_spec = replace(spec, activation_checkpointing="none", optimizer_implementation=optimizer)
        if self.depth > 3:
            oa, ob = self._at_batch(opt_spec, 2, 1), self._at_batch(opt_spec, 3, 1)
            opt_regions = extrapolate_regions(oa, ob, 2, 3, self.depth)
        else:
            opt_regions = self._at_batch(opt_spec, self.depth, 1)
        regions.update({k: v for k, v in opt_regions.items() if k in ("clip", "optimizer")})
        step = steady_state(collapse_regions(regions))
        if grad_accum == 1:
            return step
        phases = dict(step.phase_peaks)  # later micro-batches run forward and backward with all grads alive
        for phase in ("forward", "backward"):
            b = dict(phases[phase].bytes_by_category)
            b[Category.GRADS] = phases["optimizer"][Category.GRADS]
            phases[phase] = Breakdown(b)
        peak_phase = max(phases, key=lambda p: phases[p].total_bytes)
        return StepMemory(peak=phases[peak_phase], phase_peaks=phases, peak_phase=peak_phase)
