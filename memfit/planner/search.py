"""Search: every candidate configuration's per-rank peak, whether it fits, and how fast it should be.

Candidates are every combination of the ``Strategy`` levers (``memfit.config.strategy``): checkpointing
policy x precision x loss chunks x optimizer implementation x AdamW states (32-bit, or 8-/4-bit on one GPU,
stepped one parameter at a time) x optimizer step after or in backward (one GPU,
no accumulation, the preferred implementation) x micro-batch (with the gradient accumulation that keeps the
global batch) x ZeRO stage. Memory comes from the
``Predictor`` (traces of the trainer's own step) and ``sharding.per_rank``; on top of the predicted
allocated peak the allocator keeps cached blocks and the runtime its context, modelled in the
table as ``reserved = peak x (1 + ALLOCATOR_MARGIN) + CONTEXT_BYTES`` (a full-depth replay through
the caching-allocator model costs seconds per candidate; see benchmarks/RESULTS.md). A candidate fits
when that is at most the GPU's memory x (1 - headroom). One chosen configuration is replayed through the
allocator model (``step_allocations``): ``memfit plan --explain`` and ``memfit train`` on one GPU.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from memfit.config.schema import LoraConfig
from memfit.config.strategy import (
    ENGINE_OF_STAGE,
    OPTIMIZER_IMPLEMENTATIONS,
    OPTIMIZER_NAMES,
    PRECISION_PREFERENCE,
    QUANTIZED_BASES,
    ZERO_STAGES,
    Strategy,
    candidates,
    fallbacks,
    levers,
)
from memfit.errors import UserError
from memfit.planner import trace_cache
from memfit.planner.categories import DEVICE_CATEGORIES, Category, StepMemory
from memfit.planner.cost import (
    Shape,
    TrainedWhole,
    memory_traffic_bytes,
    memory_traffic_s,
    optimizer_offload_time_s,
    recomputed_share,
    step_flops,
    step_time_s,
)
from memfit.planner.floor import Relatives, family
from memfit.planner.hardware import Gpu
from memfit.planner.predict import Predictor, trace_workers
from memfit.planner.sharding import ShardingSpec, comm_bytes_per_step, validate
from memfit.planner.spec import StepSpec
from memfit.units import GIB, size_text

if TYPE_CHECKING:
    from memfit.models.planning import PlanningConfig

FALLBACKS_AT_ONCE = 4  # fallback candidates traced together (in parallel) before checking whether one fits
ALLOCATOR_MARGIN = 0.08  # cached-but-free blocks at the peak (typical reserved/allocated of a training step)
CPU_PRECISION_PREFERENCE = ("fp32", "bf16-mixed", "bf16-pure", "fp16-mixed")
CONTEXT_BYTES = 512 << 20  # CUDA/HIP context, cuBLAS/hipBLASLt workspaces: device memory outside the allocator


@dataclass(frozen=True)
class Workload:
    model_config: PlanningConfig
    model_name: str
    seq_len: int
    global_batch: int
    lora: LoraConfig | None = None


@dataclass(frozen=True)
class Cluster:
    """The GPUs planned for, and the host memory of each node (None: not checked)."""

    gpu: Gpu
    gpus_per_node: int = 1
    nodes: int = 1
    host_mem_bytes: int | None = None
    runtime_bytes: int = 0  # --device cpu: the runtime's resident memory (torch, transformers), beside the tensors

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass(frozen=True)
class Pins:
    """Levers the user fixed (``Strategy`` field name to value; the others are searched) and the
    sharding semantics of the engine they will run."""

    levers: dict[str, Any] = field(default_factory=dict)
    engine: str = "fsdp2"
    offload_params: bool = False  # DeepSpeed ZeRO-3's offload_param (from its JSON)

    def __hash__(self) -> int:
        return hash((tuple(sorted(self.levers.items(), key=lambda kv: kv[0])), self.engine, self.offload_params))


@dataclass(frozen=True)
class Candidate:
    strategy: Strategy
    memory: StepMemory  # per rank, allocated bytes
    reserved_bytes: int  # predicted device memory incl. allocator margin and context
    usable_bytes: int
    step_time_s: float
    comm_bytes: int
    host_node_bytes: int = 0  # host memory a node's ranks hold at their peak (offloaded activations and state)
    host_usable_bytes: int | None = None  # a node's host memory (None: not checked)
    on_cpu: bool = False  # planned for this machine's CPU (--device cpu)

    @property
    def fits_host(self) -> bool:
        return self.host_usable_bytes is None or self.host_node_bytes <= self.host_usable_bytes

    @property
    def fits(self) -> bool:
        return self.reserved_bytes <= self.usable_bytes and self.fits_host

    @property
    def headroom_bytes(self) -> int:
        return self.usable_bytes - self.reserved_bytes

    @property
    def shortfall_bytes(self) -> int:
        """By how much it misses: device bytes over the usable, plus host bytes over a node's host memory."""
        host_over = 0 if self.host_usable_bytes is None else max(0, self.host_node_bytes - self.host_usable_bytes)
        return max(0, -self.headroom_bytes) + host_over

    def why_not(self) -> str:
        if self.reserved_bytes <= self.usable_bytes and not self.fits_host:
            return (
                f"needs {self.host_node_bytes / GIB:.2f} GiB of host memory per node > "
                f"{size_text(self.host_usable_bytes)} (--host-mem); its {self.reserved_bytes / GIB:.2f} GiB of "
                "device memory would fit"
            )
        return (
            f"needs {self.reserved_bytes / GIB:.2f} GiB > {size_text(self.usable_bytes)} usable "
            f"(peak in {self.memory.peak_phase}: "
            + ", ".join(f"{c.value} {self.memory.peak[c] / GIB:.2f}" for c in DEVICE_CATEGORIES if self.memory.peak[c])
            + (f"; host {self.memory.host_peak_bytes / GIB:.2f}" if self.memory.host_peak_bytes else "")
            + ")"
        )


@dataclass
class PlanResult:
    workload: Workload
    cluster: Cluster
    headroom: float
    fitting: list[Candidate] = field(default_factory=list)
    pruned: list[Candidate] = field(default_factory=list)
    traces: int = 0
    cached_traces: int = 0  # of ``traces``, read from the trace cache
    untried: int = 0  # with a fallback lever, left untraced by the search's rules (``Lever.fallback``, ``last_resort``)
    pins: Pins = field(default_factory=Pins)
    predictor: Predictor | None = field(default=None, repr=False, compare=False)  # its traces, for further questions

    @property
    def best(self) -> Candidate | None:
        return self.fitting[0] if self.fitting else None

    @property
    def usable_bytes(self) -> int:
        return int(self.cluster.gpu.memory_bytes * (1 - self.headroom))


@dataclass(frozen=True)
class Row:
    """Fitting candidates the plan cannot tell apart: equal predicted memory (every category, host included) and
    step time, differing in one lever only (e.g. the AdamW implementation). The first is the preferred one."""

    candidates: tuple[Candidate, ...]

    @property
    def first(self) -> Candidate:
        return self.candidates[0]


def _prediction(c: Candidate) -> tuple:
    return (c.reserved_bytes, c.host_node_bytes, tuple(c.memory.peak.as_dict().values()), time_bucket(c.step_time_s))


def table_rows(fitting: list[Candidate]) -> list[Row]:
    """``fitting`` (ranked) as the table shows it: candidates alike in prediction that differ in one lever share
    the row of the best ranked of them; rows keep the ranking's order."""
    names = list(levers())
    members: list[list[Candidate]] = []
    merged_on: list[str | None] = []
    index: dict[tuple, int] = {}
    for c in fitting:
        values = c.strategy.as_dict()
        keys = {n: (_prediction(c), n, tuple((k, str(v)) for k, v in values.items() if k != n)) for n in names}
        hit = next(((index[k], n) for n, k in keys.items() if k in index and merged_on[index[k]] in (None, n)), None)
        if hit is None:
            members.append([c])
            merged_on.append(None)
            for k in keys.values():
                index.setdefault(k, len(members) - 1)
        else:
            members[hit[0]].append(c)
            merged_on[hit[0]] = hit[1]
    return [Row(tuple(m)) for m in members]


def precisions_for(gpu: Gpu) -> tuple[str, ...]:
    if gpu.is_cpu:
        return ("fp32", "bf16-mixed", "bf16-pure")
    return ("bf16-mixed", "bf16-pure") if gpu.bf16 else ("fp16-mixed",)


def micro_batches(global_batch: int, world: int) -> list[int]:
    """Micro-batch sizes that divide the per-rank batch exactly."""
    if global_batch % world:
        raise UserError(
            f"--global-batch {global_batch} is not divisible by the {world} GPUs; use a multiple of {world}"
        )
    per_rank_batch = global_batch // world
    return [
        b for b in range(1, per_rank_batch + 1) if per_rank_batch % b == 0 and (b & (b - 1) == 0 or b == per_rank_batch)
    ]


def _check_pins(pins: Pins, w: Workload, c: Cluster) -> None:
    precision, zero, micro_batch = (pins.levers.get(k) for k in ("precision", "zero_stage", "micro_batch_size"))
    if precision and precision.startswith("bf16") and not c.gpu.bf16:
        raise UserError(f"--precision {precision}: {c.gpu.name} has no bf16; use fp16-mixed")
    if precision and precision not in precisions_for(c.gpu) and c.gpu.is_cpu:
        raise UserError(f"--precision {precision}: a CPU run has no fp16 loss scaling; use bf16-mixed or fp32")
    if zero is not None:
        validate(zero, c.world_size, pins.engine)
    if pins.levers.get("optimizer_in_backward") and c.world_size > 1:
        raise UserError(
            f"--optimizer-in-backward steps each parameter before its gradient is reduced: one GPU only "
            f"(got {c.world_size}); drop it or plan --gpus-per-node 1"
        )
    chunks = pins.levers.get("loss_chunks", 0)
    if chunks > w.seq_len:
        raise UserError(f"--loss-chunks {chunks} is more than --seq-len {w.seq_len} positions; use at most {w.seq_len}")
    base = pins.levers.get("quantize_base", "none")
    if base != "none" and w.lora is None:
        raise UserError(f"--quantize-base {base} quantizes the frozen base of a LoRA run: add --lora")
    # with the ZeRO stage left to the search, a stage that combines may exist: the search skips the others
    pinned_engine = _engine(c, pins, Strategy(zero_stage=zero or 0)) if zero is not None or c.world_size == 1 else None
    if base != "none" and pinned_engine:
        conflict = Strategy(quantize_base=base, zero_stage=zero or 0).conflict(engine=pinned_engine)
        if conflict:
            raise UserError(conflict)
    name = pins.levers.get("optimizer_name", "adamw")
    if name != "adamw" and pinned_engine:
        conflict = Strategy(
            optimizer_name=name, optimizer=pins.levers.get("optimizer", "for-loop"), zero_stage=zero or 0
        ).conflict(engine=pinned_engine)
        if conflict:
            raise UserError(conflict)
    if micro_batch is not None:
        per_rank_batch = w.global_batch // c.world_size
        if micro_batch <= 0 or per_rank_batch % micro_batch:
            raise UserError(
                f"--micro-batch {micro_batch} does not divide the per-GPU batch {per_rank_batch} "
                f"(global {w.global_batch} / {c.world_size} GPUs)"
            )


def time_bucket(step_time_s: float) -> int:
    """Step times in 0.5% wide buckets: candidates in one bucket count as equally fast."""
    return round(math.log(max(step_time_s, 1e-12)) / math.log(1.005))


def _rank_key(c: Candidate) -> tuple:
    """Fastest first; the cost model cannot tell apart candidates with equal FLOPs and traffic, so
    ties (within 0.5%) go to fp32 master weights, then to an unquantized base, then to full-precision AdamW
    states, then to the optimizer
    step after backward (it can clip
    the gradient norm), then the larger micro-batch (better kernel efficiency, not modelled), then the
    fused optimizer, then the smaller footprint. On a CPU, fp32 first (bf16 is no faster there without bf16
    matrix units, and autocast costs casts)."""
    s = c.strategy
    return (
        time_bucket(c.step_time_s),
        (CPU_PRECISION_PREFERENCE if c.on_cpu else PRECISION_PREFERENCE).index(s.precision),
        QUANTIZED_BASES.index(s.quantize_base),
        OPTIMIZER_NAMES.index(s.optimizer_name),
        s.optimizer_in_backward,
        -s.micro_batch_size,
        OPTIMIZER_IMPLEMENTATIONS.index(s.optimizer),
        c.reserved_bytes,
    )


def search_space(w: Workload, c: Cluster, pins: Pins) -> list[Strategy]:
    """Every candidate strategy: pinned levers fixed, the others over their searched values, narrowed
    by the hardware (precisions by bf16 support, ZeRO stages by world size) and the batch (micro-batches
    that divide it; the accumulation follows from the global batch)."""
    per_rank_batch = w.global_batch // c.world_size
    choices = _choices(w, c)
    # stepped in backward, parameters are stepped one at a time, where implementations differ by one
    # parameter's temporaries at most: the preferred one stands for them (a quarter of the traces)
    in_backward_optimizer = host_optimizer = pins.levers.get("optimizer", OPTIMIZER_IMPLEMENTATIONS[0])
    out = []
    for chosen in candidates(pins.levers, choices):
        s = Strategy(**chosen, grad_accum_steps=per_rank_batch // chosen["micro_batch_size"])
        if s.conflict(0.0, c.world_size, _engine(c, pins, s)):
            continue  # levers that do not combine (the step in backward cannot accumulate, low-bit states need
            # one implementation, offloads need an engine that can, ...); a plan does not clip
        if s.optimizer_in_backward and s.optimizer != in_backward_optimizer:
            continue  # one implementation stands for all
        # on the host the implementation changes host temporaries only: the preferred one stands for all; low-bit
        # states on the host (two fallbacks at once) only where the user pins them
        host_step = s.optimizer == host_optimizer if s.optimizer_name == "adamw" else "optimizer_name" in pins.levers
        if s.optimizer_offload and not host_step:
            continue
        out.append(s)
    return out


def why_no_candidate(w: Workload, c: Cluster, pins: Pins) -> str:
    """Why ``search_space`` found nothing to plan: a conflict among the pinned levers' combinations, the largest
    micro-batch's first (where accumulation is not what conflicts, the other levers' conflict shows)."""
    per_rank_batch = w.global_batch // c.world_size
    chosen = sorted(candidates(pins.levers, _choices(w, c)), key=lambda x: -x["micro_batch_size"])
    for s in (Strategy(**x, grad_accum_steps=per_rank_batch // x["micro_batch_size"]) for x in chosen):
        why = s.conflict(0.0, c.world_size, _engine(c, pins, s))
        if why:
            gpus = "1 GPU" if c.world_size == 1 else f"{c.world_size} GPUs"
            return f"{why} ({gpus}, ZeRO-{s.zero_stage}, micro-batch {s.micro_batch_size}); change the pins"
    return "the pins leave no combination of levers"


def _engine(c: Cluster, pins: Pins, s: Strategy) -> str:
    """The engine a candidate runs on: one process, DeepSpeed where pinned, else the ZeRO stage's own."""
    if c.world_size == 1:
        return "single"
    return "deepspeed" if pins.engine == "deepspeed" else ENGINE_OF_STAGE[s.zero_stage]


def _choices(w: Workload, c: Cluster) -> dict[str, tuple]:
    """Each searched lever's values, narrowed by the hardware and the batch."""
    choices = {
        "precision": precisions_for(c.gpu),
        "micro_batch_size": micro_batches(w.global_batch, c.world_size),
        "zero_stage": ZERO_STAGES if c.world_size > 1 else (0,),
        "optimizer_in_backward": (False, True) if c.world_size == 1 else (False,),
        "optimizer_name": OPTIMIZER_NAMES if c.world_size == 1 else ("adamw",),
        "quantize_base": QUANTIZED_BASES if c.world_size == 1 and w.lora is not None else ("none",),
        "optimizer_offload": (False, True),
        # a chunk holds one position at least (train refuses more chunks than positions)
        "loss_chunks": tuple(n for n in levers()["loss_chunks"].searched if n <= w.seq_len),
    }
    if c.gpu.is_cpu:  # host and device are one memory: offloading moves nothing
        choices.update(activation_offload=(False,), optimizer_offload=(False,))
    return choices


@trace_workers()  # one pool of trace workers for the first candidates and every round of fallbacks
def search(
    w: Workload, c: Cluster, pins: Pins = Pins(), headroom: float = 0.05, predictor: Predictor | None = None
) -> PlanResult:
    """Predict every candidate; fitting ones sorted fastest first, the others with their reasons."""
    if w.seq_len > w.model_config.max_position_embeddings:
        raise UserError(
            f"--seq-len {w.seq_len} exceeds the model's max_position_embeddings "
            f"{w.model_config.max_position_embeddings}"
        )
    micro_batches(w.global_batch, c.world_size)  # the batch must split over the GPUs
    _check_pins(pins, w, c)
    strategies = search_space(w, c, pins)
    if not strategies:
        raise UserError(f"nothing to plan: {why_no_candidate(w, c, pins)}")
    cpu = c.gpu.is_cpu  # a CPU run's tensors: exact bytes, offloaded copies in the one memory
    predictor = predictor or Predictor(
        StepSpec(w.model_config, w.seq_len, lora=w.lora, round_to=1 if cpu else 512, host_is_device=cpu)
    )
    result = PlanResult(w, c, headroom, pins=pins, predictor=predictor)
    usable = result.usable_bytes
    first = [s for s in strategies if not fallbacks(s, pins.levers)]
    predictor.prefetch(first)
    done = {s: _candidate(s, w, c, pins, predictor, usable) for s in first}
    relatives = Relatives(sharded=c.world_size > 1)
    for s, cand in done.items():
        relatives.add(s, cand.memory)

    def bounded_out(s: Strategy) -> bool:
        """Whether a predicted relative (``floor.Relatives``) alone shows ``s`` cannot fit: left untraced."""
        return reserved_estimate(relatives.floor_bytes(s), c) > usable

    # a fallback lever (offloading, the step in backward) is as fast as its twin at best: tried where the twin
    # does not fit and would be at least as fast as the fastest candidate that fits, and no faster fallback fits
    fastest = min((time_bucket(c.step_time_s) for c in done.values() if c.fits), default=None)

    anything_fits = fastest is not None
    last_resorts = [n for n, lever in levers().items() if lever.last_resort and n not in pins.levers]

    def twin_of(s: Strategy) -> Candidate:
        return done[s.replace(**fallbacks(s, pins.levers))]

    def worth_trying(s: Strategy) -> bool:
        if anything_fits and any(getattr(s, n) for n in last_resorts):
            return False
        twin = twin_of(s)
        could_fit = not bounded_out(s)  # by what the twin holds in forward, less what the fallbacks change
        return not twin.fits and could_fit and (fastest is None or time_bucket(twin.step_time_s) <= fastest)

    def twin_bucket(s: Strategy) -> int:
        return time_bucket(twin_of(s).step_time_s)

    # by their twins' speed, fastest first, a bucket at a time, until a fitting candidate is at least as fast as
    # the next twins (a fallback is never faster than its twin)
    needed = sorted((s for s in strategies if s not in done and worth_trying(s)), key=twin_bucket)
    # last resorts (offloading) only when no other fallback (the step in backward, low-bit states, an NF4 base) fits
    tiers = (
        [s for s in needed if not any(getattr(s, n) for n in last_resorts)],
        [s for s in needed if any(getattr(s, n) for n in last_resorts)],
    )
    for tier in tiers:
        if tier is tiers[1] and fastest is not None:
            break
        for bucket, group in itertools.groupby(tier, key=twin_bucket):
            if fastest is not None and fastest <= bucket:
                break
            # within a bucket the twins tie: fewer fallbacks first (each trades time or accuracy), then in the
            # ranking's order of preference, a few at a time, until one fits; each round's predictions may bound
            # the rest out
            group = sorted(group, key=lambda s: (len(fallbacks(s, pins.levers)), _rank_key(twin_of(s))[1:]))
            while group:
                chunk, group = _next_round([s for s in group if not bounded_out(s)])
                if not chunk:
                    break
                predictor.prefetch(chunk)
                tried = {s: _candidate(s, w, c, pins, predictor, usable) for s in chunk}
                done.update(tried)
                for s, cand in tried.items():
                    relatives.add(s, cand.memory)
                fits = [time_bucket(cand.step_time_s) for cand in tried.values() if cand.fits]
                if fits:
                    fastest = min(fits) if fastest is None else min(fastest, *fits)
                    break
    for cand in done.values():
        (result.fitting if cand.fits else result.pruned).append(cand)
    result.untried = len(strategies) - len(done)
    result.fitting.sort(key=_rank_key)
    result.pruned.sort(key=lambda k: (k.shortfall_bytes, k.reserved_bytes))
    result.traces, result.cached_traces = predictor.traces, predictor.cached
    return result


def _next_round(group: list[Strategy]) -> tuple[list[Strategy], list[Strategy]]:
    """The next ``FALLBACKS_AT_ONCE`` of ``group`` to trace, one per family (``floor.family``: a predicted candidate
    may bound its relatives out), and the rest, in their order."""
    chunk: list[Strategy] = []
    families = set()
    for s in group:
        if len(chunk) < FALLBACKS_AT_ONCE and family(s) not in families:
            chunk.append(s)
            families.add(family(s))
    return chunk, [s for s in group if s not in chunk]


def evaluate(strategy: Strategy, result: PlanResult, predictor: Predictor) -> Candidate:
    """One more strategy judged as ``result``'s search judged its candidates (``predictor`` traces ``result``'s
    workload, or one reshaped, e.g. a longer sequence)."""
    return _candidate(strategy, result.workload, result.cluster, result.pins, predictor, result.usable_bytes)


def _candidate(strategy: Strategy, w: Workload, c: Cluster, pins: Pins, predictor: Predictor, usable: int) -> Candidate:
    """One strategy's per-rank memory, whether it fits ``usable`` bytes, and its modelled step time."""
    sharding = None
    if c.world_size > 1:
        sharding = ShardingSpec.for_model(
            strategy.zero_stage,
            c.world_size,
            pins.engine,
            w.model_config,
            w.lora,
            offload=strategy.optimizer_offload,
            offload_params=pins.offload_params,
            precision=strategy.precision,
        )
    mem = predictor.predict(strategy, sharding)
    seconds, comm = modelled_step_time_s(strategy, w, c, mem)
    return Candidate(
        strategy,
        mem,
        reserved_estimate(mem.peak_bytes, c),
        usable,
        seconds,
        comm,
        mem.host_peak_bytes * c.gpus_per_node,
        c.host_mem_bytes,
        c.gpu.is_cpu,
    )


def modelled_step_time_s(strategy: Strategy, w: Workload, c: Cluster, mem: StepMemory) -> tuple[float, int]:
    """The cost model's seconds for one optimizer step of ``strategy`` on one rank of ``c`` (``mem``: its predicted
    memory), and the bytes its collectives move (see ``memfit.planner.cost``)."""
    shape = Shape.of(w.model_config)
    width = 4 if strategy.precision == "fp32" else 2
    lowp_param_bytes = shape.matmul_weights * width
    tokens = strategy.micro_batch_size * strategy.grad_accum_steps * w.seq_len
    lora_experts = w.lora is not None and bool(w.lora.target_parameters)
    trained = TrainedWhole.of_run(w.model_config, w.lora)
    flops = step_flops(shape, tokens, w.seq_len, w.lora is not None, strategy, lora_experts, trained)
    # LoRA: what it trains whole (its adapters' gradients are negligible)
    trained_bytes = lowp_param_bytes if w.lora is None else int(trained.elements(shape.layers)) * width
    comm = comm_bytes_per_step(
        lowp_param_bytes, trained_bytes, strategy.zero_stage, c.world_size, strategy.grad_accum_steps
    )
    host_state = mem.peak[Category.HOST_STATE]  # whole at every moment
    activations_out = mem.host_peak_bytes - host_state if strategy.activation_offload else 0
    seconds = step_time_s(
        flops,
        c.gpu.peak_tflops,
        strategy.precision,
        comm,
        c.gpu.link_GBps,
        c.nodes,
        activations_out * strategy.grad_accum_steps,  # each micro-batch offloads its own
        c.gpu.host_GBps,
        w.lora is not None,
        c.gpu.fp32_slowdown,
    )
    # the trained weights' gradients, whole at the optimizer step (with the step in backward, only those alive at once)
    grads = max(b[Category.GRADS] for b in mem.phase_peaks.values())
    if strategy.optimizer_offload:
        # every gradient to the host and every updated weight back: the device's gradient bytes each way
        seconds += optimizer_offload_time_s(grads, host_state, c.gpu.host_GBps)
    traffic = memory_traffic_bytes(grads, mem.peak[Category.OPTIMIZER], strategy, recomputed_share(shape, strategy))
    return seconds + memory_traffic_s(traffic, c.gpu.memory_GBps), comm


def predict_run(
    model_config: PlanningConfig,
    seq_len: int,
    strategy: Strategy,
    lora: LoraConfig | None,
    on_gpu: bool,
    sharding: ShardingSpec | None = None,
) -> StepMemory:
    """The planner's prediction for exactly one training configuration on one device (or one rank)."""
    predictor = Predictor(
        StepSpec(model_config, seq_len, lora=lora, round_to=512 if on_gpu else 1, host_is_device=not on_gpu)
    )
    return predictor.predict(strategy, sharding)


def reserved_estimate(peak_bytes: int, cluster: Cluster | None = None) -> int:
    """Device memory a step with this allocated peak needs: allocator margin plus runtime context; on a CPU
    (``--device cpu``), the tensors plus the runtime's resident memory."""
    if cluster is not None and cluster.gpu.is_cpu:
        return peak_bytes + cluster.runtime_bytes
    return int(peak_bytes * (1 + ALLOCATOR_MARGIN)) + CONTEXT_BYTES


def step_allocations(
    model_config: PlanningConfig, seq_len: int, strategy: Strategy, lora: LoraConfig | None
) -> list[tuple[int, int]]:
    """The first two full-depth steps of one configuration on one device as allocations and releases
    of 512-byte-rounded blocks, for the allocator model (ZeRO not applied; two micro-batches stand for
    any longer accumulation: later ones repeat the second's). The second step is the steady state.
    Against the peak reserved memory an H200 reported for five 7B cells, the replay of two traced
    steps came within -0.35% to -0.84% for four and -4.7% for the fifth (one traced step: -0.4% to
    -5.6%; benchmarks/RESULTS.md)."""

    two = strategy.replace(grad_accum_steps=min(strategy.grad_accum_steps, 2), zero_stage=0)
    spec = StepSpec(model_config, seq_len, two, lora, 512)
    key = trace_cache.allocations_key(spec, steps=2)
    events = trace_cache.load_allocations(key)
    if events is None:
        from memfit.planner.trace import trace_allocations  # the tracing machinery, only when not cached

        events = trace_allocations(spec, steps=2)
        trace_cache.store_allocations(key, events)
    return events
