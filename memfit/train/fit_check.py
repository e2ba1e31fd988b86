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
from memfit.planner.categories import StepMemory
from memfit.planner.hardware import cpu_device, device_preset
from memfit.planner.search import (
    CONTEXT_BYTES,
    Cluster,
    Workload,
    check_fits,
    check_host_fits,
    modelled_step_time_s,
    predict_run,
    step_allocations,
)
from memfit.planner.sharding import ShardingSpec
from memfit.strategies.allocator import conf_in_effect
from memfit.units import meminfo


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
            cfg.lora.enabled,
            offload=strategy.optimizer_offload and gpu,
            offload_params=offload_params and gpu,
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
