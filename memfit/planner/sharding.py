"""Per-rank memory under ZeRO stages 0-3, from a single-device trace of the same step.

The trace gives, per phase, bytes of parameters P, gradients G, optimizer state O, activations A and
temporaries T on one device. With N data-parallel ranks:

FSDP2 semantics (``fully_shard`` per decoder layer and on the root; memfit's default engine)
    stage 0  DDP: P, G, O, plus DDP's gradient buckets (G again; ``gradient_as_bucket_view=False``).
    stage 1  DDP + ZeroRedundancyOptimizer: P, G + buckets, O/N.
    stage 2  reshard_after_forward=False: in forward, sharded P/N plus every group's unsharded
             parameters kept for backward (P); in backward a layer reshards once its gradients are
             reduced, so at a moment when a fraction f of the layers' backward is done, P/N + root +
             (1 - f) of the layers' parameters; G/N (sharded, accumulated over micro-batches) plus,
             in backward only, the root group's gradients produced so far (unsharded until the root's
             post-backward: before the layers every gradient made, the head's) and one layer's in flight
             while the layers run; O/N.
    stage 3  reshard_after_forward=True on the layers: P/N plus the root group's unsharded parameters (kept
             from forward to backward) and, per moment (``zero3_gathered``), the decoder layers' that FSDP2 holds
             whole: in forward two to three (the running layer, its all-gather's output, kept past the next
             layer's copy-out), one after the layers, none in a loss outside the model; in backward none before the
             gradient of the model's output, one in the head's, two in the layers', none in the embeddings' after
             them; gradients as stage 2; O/N.
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
from memfit.planner.timeline import LAYER_REGIONS, Moments, region_of, segment_of

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
    # FSDP2's compute copies (``MixedPrecisionPolicy``, stored fp32 gathered as bf16): their share of the stored bytes
    compute_param_fraction: float = 1.0
    compute_grad_fraction: float = 1.0

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
    places: np.ndarray | None = None,
) -> np.ndarray:
    """Moments' bytes (int64 rows in ``Category`` order) on one rank. ``phases`` holds each moment's index in
    ``PHASES``; ``grads_done`` the fraction of the step's gradients this micro-batch's backward had produced by
    then (where FSDP2 has resharded); ``g_total`` the bytes of all gradients; ``accumulated`` whether earlier
    micro-batches of the step left (sharded) gradients behind; ``places`` where each moment is in its pass
    (``moment_places``): without them, the root group's gradients are taken as produced in step with the rest and
    ZeRO-3 holds two layers gathered at every moment. Integer arithmetic as in Python: products with a
    fraction truncated, quotients floored (every value is non-negative)."""
    n, layers = s.world_size, max(1, s.num_layers)
    backward, update = phases == _BACKWARD, (phases == _CLIP) | (phases == _OPTIMIZER)
    out = rows.copy()
    p, g, o = rows[:, _P], rows[:, _G], rows[:, _O]
    whole = _times(p, s.compute_param_fraction)  # what a rank gathers: the compute copies
    root_p = _times(whole, s.root_param_fraction)
    layer_p = (whole - root_p) // layers
    # unsharded gradients in flight during backward: the root group's gradients produced so far in this
    # micro-batch (reduce-scattered at the root's post-backward) and one layer's before its reduce-scatter; none in
    # forward (earlier micro-batches' gradients are sharded by then)
    root_in_flight, layer_in_flight, layers_done = _in_flight(s, backward, grads_done, g_total, places)
    # the root group's gradients wait in the compute dtype; a layer's reduce-scatter input is stored-size (fp32)
    in_flight = _times(root_in_flight, s.compute_grad_fraction) + layer_in_flight
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
        if s.stage == 2:  # every group gathered from forward on; in backward a layer reshards once it is done
            p2 = p // n + np.where(backward, root_p + _times(whole - root_p, 1 - layers_done), whole)
        else:
            layers_held, roots_held = zero3_gathered(phases, places) if places is not None else (2, 1)
            p2 = p // n + roots_held * root_p + layers_held * layer_p
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


def _in_flight(
    s: ShardingSpec, backward: np.ndarray, grads_done: np.ndarray, g_total: int, places: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per moment: the root group's gradient bytes in flight (unsharded), one layer's in flight, and the share of the
    decoder layers whose backward is done. With ``places``, read from where the gradients were made: before the
    layers every one is the root group's (an LM head's, whole, before any reduce-scatter), in the layers those stay
    and the layers' are added, after them the embeddings' join the root's. Without, the root group's share of all
    the gradients made so far, and the layers as far as the gradients are."""
    layers = max(1, s.num_layers)
    made = _times(np.full(len(grads_done), g_total, dtype=np.int64), grads_done)  # this micro-batch's, so far
    if places is None:
        flying = backward & (grads_done > 0)
        root_g = int(g_total * s.root_grad_fraction)
        return (
            np.where(flying, _times(np.full_like(made, root_g), grads_done), 0),
            np.where(flying, (g_total - root_g) // layers, 0),
            grads_done,
        )
    before = backward & ((places == _LOSS) | (places == _BEFORE))
    in_layers = backward & ((places == _LAYER) | (places == _LAYER_START))
    after = backward & (places == _AFTER)
    root_before = int(made[before].max(initial=0))
    # the gradients made when the layers' backward starts: the root group's, unless its gradient there is not yet
    # the one that becomes the parameter's (a tied head's, summed out of place with the embeddings': a temporary)
    start = int(made[np.flatnonzero(in_layers)[0]]) if in_layers.any() else root_before
    root_in_layers = min(start, root_before)
    layers_made = max(0, int(made[in_layers].max(initial=start)) - start)
    root = np.where(before, made, np.where(in_layers, root_in_layers, np.where(after, made - layers_made, 0)))
    # one layer's before its reduce-scatter, and after the layers the last reduce-scatter's input, which FSDP2 frees
    # at the next one (the root group's, in its post-backward)
    layer = np.where(in_layers | after, layers_made // layers, 0)
    done = np.where(in_layers, np.maximum(made - start, 0) / max(1, layers_made), np.where(after, 1.0, 0.0))
    return np.maximum(root, 0), layer, done


_PRE, _BEFORE, _LAYER, _LAYER_START, _AFTER, _LOSS, _UPDATE = range(7)


def moment_places(keys: tuple[str, ...]) -> np.ndarray:
    """Where each moment key (``Timeline.region_peaks``' ``phase:region#occurrence+offset``, in op order) is in its
    pass: before the model's forward (``forward`` alone), outside the layers before them, in a decoder layer (a
    layer's first moment in forward apart: ``_LAYER_START``, read at the last layer's, where the most activations are
    held), outside them after them, in a loss computed outside the model, or in the update."""
    out = np.full(len(keys), _UPDATE, dtype=np.int64)
    phase_before, segment_before, in_layers_yet = "", "", False
    for i, key in enumerate(keys):
        phase, segment, region = key.partition(":")[0], segment_of(key), region_of(key)
        if phase != phase_before:
            phase_before, in_layers_yet = phase, False
        layer = region in LAYER_REGIONS
        if layer:
            starts = phase == "forward" and region == "last" and segment != segment_before
            out[i] = _LAYER_START if starts else _LAYER
        elif region == "loss":
            out[i] = _LOSS
        elif region == "outer":
            out[i] = _AFTER if in_layers_yet else _BEFORE
        elif phase == "forward":
            out[i] = _PRE
        in_layers_yet |= layer
        segment_before = segment
    return out


_FORWARD = PHASES.index("forward")
# (layers, root groups) FSDP2 holds whole under ZeRO-3 at each place, in forward and in backward
_HELD = {
    _FORWARD: {_PRE: (0, 0), _BEFORE: (2, 2), _LAYER: (2, 1), _LAYER_START: (3, 1), _AFTER: (1, 1), _LOSS: (0, 1)},
    _BACKWARD: {_BEFORE: (1, 1), _LAYER: (2, 1), _LAYER_START: (2, 1), _AFTER: (0, 1), _LOSS: (0, 1)},
}


def zero3_gathered(phases: np.ndarray, places: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each moment (its ``PHASES`` index and ``moment_places``): how many decoder layers' parameters FSDP2 holds
    whole under ZeRO-3 (unsharded, or an all-gather's output), and how many copies of the root group's. Read from
    FSDP2's hooks in torch 2.13 (``benchmarks/fsdp2_gathered_layers.py``):

    - forward: a group's all-gather output outlives its copy-out, to overlap the next group's all-gather with it,
      and is freed only after that group's copy-out (``wait_for_unshard`` keeps it in a local variable): the running
      layer and its output, and at a layer's start the previous layer's output too (three; the first layer's start
      holds the root group's output and unsharded parameters beside its own two); after the layers, the last one's
      output until the root's post-forward; nothing in a loss computed outside the model.
    - backward: an output is freed at its copy-out; none before the gradient of the model's output, where the root's
      pre-backward prefetches the last layer (one), then the running layer and the prefetched one (two), none in
      the embeddings' backward after every layer's.
    """
    held = np.array([_HELD.get(int(ph), {}).get(int(pl), (0, 1)) for ph, pl in zip(phases, places)], dtype=np.int64)
    held = held.reshape(-1, 2)
    return held[:, 0], held[:, 1]


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
    places = moment_places(moments.keys)
    rows = _shard_rows(moments.rows, s, moments.phases, moments.grads_done, g_total, accumulated, places)
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
