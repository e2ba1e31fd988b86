"""Per-rank memory under ZeRO stages 0-3, from a single-device trace of the same step.

The trace gives, per phase, bytes of parameters P, gradients G, optimizer state O, activations A and
temporaries T on one device. With N data-parallel ranks:

FSDP2 semantics (``fully_shard`` per decoder layer and on the root; memfit's default engine)
    stage 0  DDP: P, G, O, plus DDP's gradient buckets (G again; ``gradient_as_bucket_view=False``).
    stage 1  DDP + ZeroRedundancyOptimizer: P, G + buckets, O/N.
    stage 2  reshard_after_forward=False: in forward, sharded P/N plus every group's unsharded
             parameters kept for backward (P); in backward a layer reshards once its gradients are
             reduced, so at a moment when a fraction f of the gradients exists, P/N + root +
             (1 - f) of the layers' parameters; G/N (sharded, accumulated over micro-batches) plus,
             in backward only, the root group's share of the gradients produced so far (unsharded
             until the root's post-backward) and one layer's in flight; O/N.
    stage 3  reshard_after_forward=True on the layers: P/N plus the root group's unsharded
             parameters (kept from forward to backward) and two layers' (current + prefetched);
             gradients as stage 2; O/N.
    In the clip and optimizer phases every group is resharded: P/N, G/N, O/N, and the optimizer's
    temporaries (foreach buffers) are those of this rank's shard: 1/N.
    The root group holds the embeddings, the final norm and an untied LM head: ``root_param_fraction``
    of the parameter bytes (``root_grad_fraction`` of the gradient bytes: with LoRA, what it trains whole there).
DeepSpeed semantics
    stage 1  P, G, O/N.    stage 2  P, G/N plus the reduce bucket, O/N.
    stage 3  P/N plus the prefetch bucket and the largest layer, G/N, O/N.
Offloaded (``offload``: FSDP2's ``CPUOffloadPolicy`` at stages 2 and 3, DeepSpeed's
``zero_optimization.offload_optimizer``; ``offload_params``: DeepSpeed's ``offload_param`` at stage 3)
    FSDP2    the sharded parameters, gradients and optimizer state (P/N, G/N, O/N) are host memory
             (``host_state``); the device holds what is gathered or in flight: unsharded parameters and
             the gradients before their reduce-scatter. The clipping and the step run on the host, their
             temporaries too (``host``).
    DeepSpeed O/N and the gradient partition G/N are host memory; at stage 2 the device keeps the reduce
             bucket, at stage 3 with ``offload_params`` the parameter partition P/N is host memory too.
    On a CPU run host and device are one memory: offloading moves nothing there, and is not applied.
Activations and temporaries are per rank and unchanged (data parallel: each rank runs its own
micro-batch). Model-state bytes are checked in tests against the ZeRO paper's formulas.

Known limitations: offloaded shards are counted at their bytes, not as PyTorch's pinned host allocator rounds
them (each pinned block up to a power of two: FSDP2 pins each parameter's shard, DeepSpeed its flat partitions),
so a GPU run's host memory can exceed the prediction by up to that rounding; communication buffers other than the
ones named are not modelled; DeepSpeed's
bucket sizes are its defaults (5e8 elements) unless given. Measured against torch.profiler on 2 CPU
ranks (gloo; benchmarks/RESULTS.md): the tiny preset within 0.5%; a SmolLM2-135M shape low by 2-7% with
and without accumulation, where the ranks themselves differ by up to ~6% from run to run (gloo's
collectives allocate on their own threads). DDP / ZeRO-1 and DeepSpeed per-rank peaks have not been
measured (their buffers are allocated before a step, out of the profiler's sight).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from memfit.config.schema import LoraConfig
from memfit.errors import UserError
from memfit.planner.categories import PHASES, Breakdown, Category, StepMemory
from memfit.planner.cost import Shape, TrainedWhole
from memfit.planner.timeline import Moments

ENGINES = ("fsdp2", "deepspeed")


@dataclass(frozen=True)
class ShardingSpec:
    stage: int
    world_size: int
    engine: str = "fsdp2"
    num_layers: int = 1
    bucket_bytes: int = 500_000_000 * 2  # DeepSpeed's default reduce/prefetch bucket: 5e8 bf16 elements
    root_param_fraction: float = 0.0
    root_grad_fraction: float = 0.0
    offload: bool = False  # the sharded optimizer state (FSDP2: and parameters, gradients) in host memory
    offload_params: bool = False  # DeepSpeed ZeRO-3's offload_param: the parameter partition in host memory

    @classmethod
    def for_model(
        cls,
        stage: int,
        world_size: int,
        engine: str,
        config,
        lora: LoraConfig | None,
        offload: bool = False,
        offload_params: bool = False,
        precision: str = "fp32",
    ) -> "ShardingSpec":
        """The spec for a Llama-family ``config`` (its depth and root-group share) and ``lora`` (None: a full
        fine-tune) in ``precision``: what LoRA trains whole in the root group (PEFT's trained copies of the
        embeddings or head, beside the frozen originals) is there in the parameters and the gradients."""
        root = grads = root_fraction(config)
        if lora is not None:
            trained = TrainedWhole.of_run(config, lora)
            # bf16-mixed LoRA keeps the frozen weights in bf16 and trains in fp32: a trained element weighs two
            root = root_fraction(config, trained, 2.0 if precision == "bf16-mixed" else 1.0)
            grads = trained.root_share(config.num_hidden_layers)
        return cls(
            stage,
            world_size,
            engine,
            config.num_hidden_layers,
            root_param_fraction=root,
            root_grad_fraction=grads,
            offload=offload,
            offload_params=offload_params,
        )


def root_fraction(config, trained: TrainedWhole = TrainedWhole(), trained_weight: float = 1.0) -> float:
    """Share of the weights' bytes outside the decoder layers (FSDP2's root group): embeddings, final norm, and the
    LM head when it is not tied to the embeddings; with LoRA, ``trained`` adds its trained copies and adapters there
    and in each layer, an element of them weighing ``trained_weight`` frozen ones."""

    s = Shape.of(config)
    root = s.vocab * s.hidden * (1 if getattr(config, "tie_word_embeddings", False) else 2) + s.hidden
    layer = s.attn_weights + s.mlp_weights + 2 * s.hidden
    root += trained_weight * trained.root
    layer += trained_weight * (trained.per_layer + trained.adapters_per_layer)
    return root / (root + s.layers * layer)


def validate(stage: int, world_size: int, engine: str) -> None:
    if stage not in (0, 1, 2, 3):
        raise UserError(f"--zero must be 0, 1, 2 or 3 (got {stage})")
    if stage > 0 and world_size < 2:
        raise UserError(
            f"ZeRO stage {stage} needs more than one GPU (world size {world_size}); use --zero 0 or more GPUs"
        )
    if engine not in ENGINES:
        raise UserError(f"sharding engine must be one of {', '.join(ENGINES)} (got '{engine}')")


_CATS = tuple(Category)
_P, _G, _O, _T, _H, _HS = (
    _CATS.index(c)
    for c in (
        Category.PARAMS,
        Category.GRADS,
        Category.OPTIMIZER,
        Category.TEMPORARIES,
        Category.HOST,
        Category.HOST_STATE,
    )
)
_BACKWARD, _CLIP, _OPTIMIZER = (PHASES.index(p) for p in ("backward", "clip", "optimizer"))


def _shard_rows(
    rows: np.ndarray,
    s: ShardingSpec,
    phases: np.ndarray,
    grads_done: np.ndarray,
    g_total: int,
    accumulated: bool = False,
    after_layers: np.ndarray | None = None,
) -> np.ndarray:
    """Moments' bytes (int64 rows in ``Category`` order) on one rank. ``phases`` holds each moment's index in
    ``PHASES``; ``grads_done`` the fraction of the step's gradients this micro-batch's backward had produced by
    then (where FSDP2 has resharded); ``g_total`` the bytes of all gradients; ``accumulated`` whether earlier
    micro-batches of the step left (sharded) gradients behind; ``after_layers`` which moments run after every decoder
    layer's backward (``after_the_layers``: the embeddings' backward, where ZeRO-3 holds no layer gathered).
    Integer arithmetic as in Python: products with a
    fraction truncated, quotients floored (every value is non-negative)."""
    n, layers = s.world_size, max(1, s.num_layers)
    backward, update = phases == _BACKWARD, (phases == _CLIP) | (phases == _OPTIMIZER)
    out = rows.copy()
    p, g, o = rows[:, _P], rows[:, _G], rows[:, _O]
    root_p = _times(p, s.root_param_fraction)
    layer_p = (p - root_p) // layers
    # unsharded gradients in flight during backward: the root group's share of the gradients produced
    # so far in this micro-batch (reduce-scattered at the root's post-backward) and one layer's before
    # its reduce-scatter; none in forward (earlier micro-batches' gradients are sharded by then)
    flying = backward & (grads_done > 0)
    root_g = int(g_total * s.root_grad_fraction)
    root_in_flight = np.where(flying, _times(np.full_like(p, root_g), grads_done), 0)
    in_flight = np.where(flying, root_in_flight + (g_total - root_g) // layers, 0)
    # sharded gradients: every gradient of earlier micro-batches, else this backward's layers so far
    sharded_g = g // n if accumulated else np.maximum(0, g - root_in_flight) // n
    if s.stage == 0:
        p2, g2, o2 = p, g + (g if n > 1 else 0), o
    elif s.engine == "deepspeed":
        if s.stage == 1:
            p2, g2, o2 = p, g, o // n
        elif s.stage == 2:
            p2, g2, o2 = p, g // n + np.minimum(g, s.bucket_bytes), o // n
        else:
            p2, g2, o2 = p // n + np.minimum(p, s.bucket_bytes) + layer_p, g // n, o // n
    elif s.stage == 1:
        p2, g2, o2 = p, 2 * g, o // n
    else:  # FSDP2 stages 2 and 3; after backward every group is resharded
        if s.stage == 2:
            gathered = np.where(backward, root_p + _times(p - root_p, 1 - grads_done), p)
            p2 = p // n + gathered
        else:  # the running layer and the prefetched one, none once every layer's backward is done
            p2 = p // n + root_p + (2 * layer_p if after_layers is None else np.where(after_layers, 0, 2 * layer_p))
        p2 = np.where(update, p // n, p2)
        g2 = np.where(update, g // n, sharded_g + in_flight)
        o2 = o // n
    out[:, _P], out[:, _G], out[:, _O] = p2, np.where(g != 0, g2, 0), o2
    if s.stage >= 1:
        stepping = phases == _OPTIMIZER
        out[stepping, _T] = rows[stepping, _T] // n  # each rank steps only its shard
    if s.offload or s.offload_params:
        _offloaded(out, s, phases, p // n, np.where(update | accumulated, g // n, sharded_g))
    return out


def after_the_layers(keys: tuple[str, ...]) -> np.ndarray:
    """For each moment key (``Timeline.region_peaks``' ``phase:region#occurrence+offset``, in order), whether it is
    a backward op outside the decoder layers after some layer's backward: the embeddings' backward, which runs
    after every layer's."""
    seen, after = False, []
    for key in keys:
        phase, _, region = key.partition(":")
        outer = region.split("#", 1)[0] == "outer"
        after.append(phase == "backward" and outer and seen)
        seen |= phase == "backward" and not outer
    return np.array(after, dtype=bool)


def _times(values: np.ndarray, fraction) -> np.ndarray:
    """``int(v * fraction)`` of each value (``fraction`` a float or one per value), as Python computes it."""
    return (values.astype(np.float64) * fraction).astype(np.int64)


def _offloaded(out: np.ndarray, s: ShardingSpec, phases: np.ndarray, p_shard: np.ndarray, g_shard: np.ndarray) -> None:
    """Move what ``s`` offloads of one rank's moments (``out``, sharded) to host memory, in place."""
    o_shard, host = out[:, _O].copy(), np.zeros_like(p_shard)
    if s.engine == "fsdp2":  # CPUOffloadPolicy: every sharded state lives on the host, the step runs there
        out[:, _P] -= p_shard
        out[:, _G] -= np.minimum(out[:, _G], g_shard)
        host = p_shard + g_shard + o_shard
        _step_on_host(out, (phases == _CLIP) | (phases == _OPTIMIZER))
    else:  # DeepSpeed: optimizer state and the fp32 gradient partition; with offload_param the parameters
        if s.offload:
            g = out[:, _G]
            out[:, _G] = np.minimum(g, s.bucket_bytes) if s.stage == 2 else g - np.minimum(g, g_shard)
            host = host + g_shard + o_shard
            _step_on_host(out, phases == _OPTIMIZER)
        else:
            o_shard = np.zeros_like(o_shard)
        if s.offload_params and s.stage == 3:
            out[:, _P] -= p_shard
            host = host + p_shard
    out[:, _O] -= o_shard
    out[:, _HS] += host


def _step_on_host(out: np.ndarray, where: np.ndarray) -> None:
    """The optimizer step's temporaries of the moments ``where`` are host memory: it runs there."""
    out[where, _H] += out[where, _T]
    out[where, _T] = 0


def _shard_phase(b: Breakdown, s: ShardingSpec, phase: str, grads_done: float, g_total: int) -> Breakdown:
    row = np.array([[b[c] for c in _CATS]], dtype=np.int64)
    code = np.array([PHASES.index(phase)])
    sharded = _shard_rows(row, s, code, np.array([grads_done]), g_total)[0]
    return Breakdown(dict(zip(_CATS, map(int, sharded))))


def per_rank(step: StepMemory, s: ShardingSpec) -> StepMemory:
    """The step's phase peaks as seen by one of ``world_size`` ranks under ZeRO ``stage``.

    Coarser than ``per_rank_moments`` (the moment of each phase's peak is the single device's); for
    callers that only have phase peaks.
    """
    g_total = max(b[Category.GRADS] for b in step.phase_peaks.values())
    done = {ph: (b[Category.GRADS] / g_total if g_total else 0.0) for ph, b in step.phase_peaks.items()}
    phases = {ph: _shard_phase(b, s, ph, done[ph], g_total) for ph, b in step.phase_peaks.items()}
    peak_phase = max(phases, key=lambda ph: phases[ph].total_bytes)
    return StepMemory(peak=phases[peak_phase], phase_peaks=phases, peak_phase=peak_phase)


def per_rank_moments(moments: Moments, s: ShardingSpec, accumulated: bool = False) -> StepMemory:
    """Every traced moment as one rank sees it, and then the peaks: the moment of a rank's peak can differ from
    the single device's (e.g. ZeRO-2 frees each layer's gathered weights during backward)."""
    g_total = int(moments.rows[:, _G].max())
    after = after_the_layers(moments.keys)
    rows = _shard_rows(moments.rows, s, moments.phases, moments.grads_done, g_total, accumulated, after)
    return moments.with_rows(rows).collapse()


def comm_bytes_per_step(param_bytes: int, trainable_bytes: int, stage: int, world_size: int, grad_accum: int) -> int:
    """Bytes each rank moves per optimizer step with ring collectives ((N-1)/N of the buffer for a
    reduce-scatter or an all-gather; an all-reduce is both). ``param_bytes`` are all weights in the
    compute dtype (what ZeRO-3 gathers), ``trainable_bytes`` the ones with gradients.

    stage 0/1: one gradient all-reduce per step (DDP skips sync inside accumulation): 2 grad.
    stage 2:   a gradient reduce-scatter per micro-batch and one parameter all-gather per step.
    stage 3:   per micro-batch, parameter all-gathers in forward and backward and a gradient reduce-scatter.
    """
    if world_size < 2:
        return 0
    f = (world_size - 1) / world_size
    if stage in (0, 1):
        return int(2 * f * trainable_bytes)
    if stage == 2:
        return int(f * (grad_accum * trainable_bytes + param_bytes))
    return int(f * grad_accum * (2 * param_bytes + trainable_bytes))
