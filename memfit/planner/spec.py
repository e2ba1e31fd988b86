"""What a trace is of (``StepSpec``) and how shallow traces extrapolate to full depth: without the tracing machinery
(transformers' modeling code, PEFT, the step runner), so a search whose traces are all cached never imports it."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from memfit.config.schema import LoraConfig
from memfit.config.strategy import OFFLOAD_PREFETCH as PREFETCH
from memfit.config.strategy import Strategy
from memfit.models.planning import layer_prefix

if TYPE_CHECKING:
    from memfit.models.planning import PlanningConfig


@dataclass(frozen=True)
class StepSpec:
    """Everything that decides the memory of one training step on one device (rank).

    The trace runs the step unsharded: ``strategy.zero_stage`` is applied afterwards, per moment, by
    ``sharding.per_rank_moments``.
    """

    model_config: PlanningConfig
    seq_len: int
    strategy: Strategy = Strategy()
    lora: LoraConfig | None = None
    round_to: int = 1  # 512 for a CUDA/HIP caching allocator's block rounding
    host_is_device: bool = False  # a CPU run: offloaded activations stay in the one memory there is
    part: str = "step"  # what runs: the whole "step", its "passes" (forward and backward) or its "update" (see _traced)

    def with_strategy(self, **changes) -> StepSpec:
        """This spec with some levers changed."""
        return replace(self, strategy=self.strategy.replace(**changes))


def extrapolate_regions(
    ra: dict[str, tuple[int, ...]],
    rb: dict[str, tuple[int, ...]],
    la: int,
    lb: int,
    depth: int,
    keep_mid: bool = False,
) -> dict[str, tuple[int, ...]]:
    """Moments at ``depth`` from depths ``la`` < ``lb``: each op outside the middle layers runs at
    every depth with bytes linear in depth, so each is extrapolated on its own and peaks are taken
    after. Middle-layer moments are left out: the bytes there are linear in the layer's position, so
    they peak at the first or last layer, whose moments are kept. ``keep_mid`` extrapolates the middle
    layers' peak too, for steps whose middle layers do what neither end does (with activations
    offloaded, a checkpointed layer's backward prefetches from the layer before it, which the first
    layer has not got).
    """
    k = (depth - la) / (lb - la)
    keys = [key for key in ra if key in rb and (keep_mid or not key.endswith(":mid"))]
    if not keys:
        return {}
    a = np.array([ra[key] for key in keys], dtype=np.int64)
    b = np.array([rb[key] for key in keys], dtype=np.int64)
    rows = np.rint(a + k * (b - a)).astype(np.int64).tolist()  # rounded half to even, as Python's round
    return dict(zip(keys, map(tuple, rows)))


def extrapolation_depths(spec: StepSpec) -> tuple[int, int]:
    """The two depths traced: (2, 3) layers, or (N, 2N) for every_k:N (whole groups of wrapped layers).

    With activations offloaded, deep enough that every region sees as many layers before it as at full depth:
    backward's prefetch of the copies back reaches up to ``PREFETCH`` entries back, which with full
    checkpointing (one entry per layer) is ``PREFETCH`` layers, so the traces start at ``PREFETCH + 2`` layers
    (rounded up to whole groups); shallower, the last layer's and the loss's op sequences change with depth.

    First layers unlike the rest (a mixture of experts' dense ones: ``layer_prefix``) are traced in both, as whole
    groups; layers of two kinds in turn cannot be extrapolated from a shallow stack: both depths are the model's
    own, so the model is traced whole.
    """
    depth = spec.model_config.num_hidden_layers
    prefix = layer_prefix(spec.model_config)
    if prefix is None:
        return depth, depth
    ac = spec.strategy.activation_checkpointing
    group = ac.every if ac.kind == "every_k" and ac.every > 1 else 1
    low = group if group > 1 else 2
    if spec.strategy.activation_offload:
        low = -(-(PREFETCH + 2) // group) * group
    low += -(-prefix // group) * group
    return low, low + group
