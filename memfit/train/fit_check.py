"""The trainer's fit check: the planner's prediction for the run it is about to start, and on one GPU the
planned first two steps replayed through the caching-allocator model, before anything is allocated."""

from __future__ import annotations

import os

import torch

from memfit.allocator.whatif import (
    Replay,
    as_trace,
    compare,
    recorded_advice,
    replay,
    restart_advice,
    settings_from_conf,
)
from memfit.config.schema import RunConfig
from memfit.config.strategy import Strategy
from memfit.device import device_name, supports_bf16
from memfit.distributed.runtime import DistContext
from memfit.errors import UserError
from memfit.planner.categories import StepMemory
from memfit.planner.hardware import cpu_device, device_preset
from memfit.planner.search import (
    CONTEXT_BYTES,
    Cluster,
    Workload,
    modelled_step_time_s,
    predict_run,
    reserved_estimate,
    step_allocations,
)
from memfit.planner.sharding import ShardingSpec
from memfit.strategies.allocator import conf_in_effect
from memfit.units import GIB, meminfo


def planned_step(
    cfg: RunConfig,
    strategy: Strategy,
    mconf,
    device: torch.device,
    ctx: DistContext,
    engine: str,
    offload_params: bool = False,
) -> tuple[StepMemory, Replay | None, float]:
    """This rank's predicted steady-state step peak (``memfit plan``'s engine), on one GPU the allocator model's
    replay of the planned steps (``None`` elsewhere), and the cost model's step time for this device (``memfit
    plan``'s, for the preset the device's name carries; on a CPU the ranking-only CPU rates). Offloading moves
    nothing on a CPU (host and device are one memory there): the ranks' sharding is then predicted as without it.

    Raises:
        UserError: on a GPU, when the prediction or the replay does not fit its memory (or memory_fraction).
    """
    gpu = device.type == "cuda"
    lora = cfg.lora if cfg.lora.enabled else None
    sharding = None
    if ctx.distributed:
        sharding = ShardingSpec.for_model(
            cfg.distributed.zero_stage,
            ctx.world_size,
            "deepspeed" if engine == "deepspeed" else "fsdp2",
            mconf,
            lora,
            offload=strategy.optimizer_offload and gpu,
            offload_params=offload_params and gpu,
            precision=strategy.precision,
        )
    step = predict_run(mconf, cfg.data.seq_len, strategy, lora, on_gpu=gpu, sharding=sharding)
    replayed = None
    total = torch.cuda.get_device_properties(device).total_memory if gpu else 0
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world_size))
    here = device_preset(device_name(device), total, supports_bf16(device)) if gpu else cpu_device(0)
    cluster = Cluster(here, per_node, max(1, ctx.world_size // per_node))
    step_time_s, _ = modelled_step_time_s(strategy, Workload(mconf, "", cfg.data.seq_len, 0, lora), cluster, step)
    if gpu:
        capacity = int(total * (cfg.allocator.memory_fraction or 1.0))
        if cfg.train.allocator_model and not ctx.distributed:
            replayed = replay_planned_steps(cfg, strategy, mconf, total)
        check_fits(step, capacity, device_name(device), replayed)
        if step.host_peak_bytes:  # offloading: this node's ranks together, against the memory it has now
            check_host_fits(step, per_node, meminfo().get("MemAvailable"))
    return step, replayed, step_time_s


def replay_planned_steps(cfg: RunConfig, strategy: Strategy, mconf, total_bytes: int) -> Replay:
    """The planned first two steps replayed through the caching-allocator model under the settings this
    process runs with, in the device's memory less the runtime context (and the memory fraction, which
    the model applies): its peak reserved memory, and whether it runs out."""
    return replay(_planned_trace(cfg, strategy, mconf), _settings_now(cfg), total_bytes - CONTEXT_BYTES)


def _settings_now(cfg: RunConfig):
    """The allocator settings this process runs with, as the allocator model knows them."""
    return settings_from_conf(conf_in_effect(), cfg.allocator.memory_fraction, torch.version.hip, torch.__version__)


def _planned_trace(cfg: RunConfig, strategy: Strategy, mconf) -> list[dict]:
    """The planned first two steps' allocations and releases, as an allocator trace."""
    return as_trace(step_allocations(mconf, cfg.data.seq_len, strategy, cfg.lora if cfg.lora.enabled else None))


def restart_allocator(
    cfg: RunConfig, strategy: Strategy, mconf, device: torch.device, ctx: DistContext, recorded: dict | None = None
) -> dict:
    """For a ``restart`` or ``oom`` record on one GPU: the allocator settings the what-if replay advises the fresh
    process to run with, as ``{"allocator": restart_advice(...)}`` where they differ from the settings in effect
    (``{}`` elsewhere: a CPU, several ranks, ``train.allocator_model`` off, or nothing to change). The replay is of
    this run's own allocator trace where it was recorded (``recorded``: ``AllocatorWatch.recorded``), else of the
    planned first two steps; the advice says which (``replayed``). The supervisor appends its ``overrides``."""
    if device.type != "cuda" or ctx.distributed or not cfg.train.allocator_model:
        return {}
    hip, version, now = torch.version.hip, torch.__version__, _settings_now(cfg)
    capacity = torch.cuda.get_device_properties(device).total_memory - CONTEXT_BYTES
    events = 0
    if recorded is not None:
        advice, events = recorded_advice(recorded, device.index or 0, capacity, now, hip, version)
    if events:
        replayed = f"this run's recorded allocator trace ({events} events)"
    else:
        results, _ = compare(_planned_trace(cfg, strategy, mconf), capacity, hip, torch_version=version)
        advice, replayed = restart_advice(results, now, hip, version), "the planned first two steps"
    return {"allocator": {**advice, "replayed": replayed}} if advice else {}


def check_host_fits(step: StepMemory, ranks_on_node: int, available_bytes: int | None) -> None:
    """Refuse a run whose ranks on this node are predicted to hold more host memory (offloaded activations and
    optimizer state) than the node has available now (``MemAvailable``; None: not known, not checked).

    Raises:
        UserError: naming both sizes and the way out.
    """
    need = step.host_peak_bytes * ranks_on_node
    if available_bytes is not None and need > available_bytes:
        raise UserError(
            f"predicted to hold {need / GIB:.2f} GiB of host memory ({ranks_on_node} rank(s) x "
            f"{step.host_peak_bytes / GIB:.2f} GiB offloaded) but this node has {available_bytes / GIB:.2f} GiB "
            "available; offload less (optimizer.offload, strategy.activation_offload), free host memory, or set "
            "train.plan_check=false to try anyway"
        )


def check_fits(step: StepMemory, capacity_bytes: int, device_label: str, replayed=None) -> None:
    """Refuse a single-device run predicted not to fit ``capacity_bytes``, or one whose replay through
    the allocator model (``replayed``, a ``whatif.Replay``) runs out of memory.

    Raises:
        UserError: naming the predicted need, the capacity and the two ways out.
    """
    need = reserved_estimate(step.peak_bytes)
    ways_out = (
        f"run `memfit plan --config <this config> --gpu-mem {capacity_bytes / GIB:.0f}GiB` for one that fits, "
        "or set train.plan_check=false to try anyway"
    )
    if need > capacity_bytes:
        raise UserError(
            f"predicted to need {need / GIB:.2f} GiB (peak {step.peak_bytes / GIB:.2f} GiB in {step.peak_phase}) but "
            f"{device_label} offers {capacity_bytes / GIB:.2f} GiB; {ways_out}"
        )
    if replayed is not None and replayed.oom:
        raise UserError(
            f"the caching-allocator model runs out of memory replaying this run's first two steps under "
            f"{replayed.settings.label()} settings on {device_label} (peak reserved "
            f"{replayed.peak_reserved_bytes / GIB:.2f} "
            f"GiB, {replayed.alloc_retries} cache releases and retries); {ways_out}, or try other allocator settings "
            "(`memfit plan --explain 1 --simulate`)"
        )
