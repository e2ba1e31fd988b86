"""The levers a run trains with, resolved for its device, world size and engine and checked together: the one place
the trainer decides them, and the torchrun launcher checks them before it starts ranks (so that a mix that cannot run
is said once, not by every rank)."""

from __future__ import annotations

import torch

from memfit.config.schema import RunConfig, grad_accum_steps, run_strategy
from memfit.config.strategy import ENGINE_OF_STAGE, Strategy
from memfit.device import resolve_device
from memfit.distributed.deepspeed_engine import offloaded, read_ds, reconcile, resolve_ds_path
from memfit.errors import UserError
from memfit.strategies.optimizer import resolve_implementation
from memfit.strategies.precision import Precision, resolve_precision


def engine_kind(cfg: RunConfig, world_size: int) -> str:
    """The engine a run of ``world_size`` ranks uses: 'single' on one process, else by ``distributed.engine`` and
    the ZeRO stage."""
    d = cfg.distributed
    if world_size <= 1:
        return "single"
    return "deepspeed" if d.engine == "deepspeed" else ENGINE_OF_STAGE[d.zero_stage]


def run_levers(cfg: RunConfig, device: torch.device, world_size: int) -> tuple[Precision, Strategy, bool]:
    """(precision, strategy, offload_params) of a run on ``device`` with ``world_size`` ranks; ``offload_params``:
    DeepSpeed ZeRO-3's ``offload_param``, from its JSON, which offloads the optimizer as it says too
    (``optimizer.offload=true`` fills it in).

    Raises:
        UserError: an unreadable DeepSpeed JSON, or levers that only fail together (``Strategy.conflict``).
    """
    o, kind = cfg.optimizer, engine_kind(cfg, world_size)
    precision = resolve_precision(cfg.strategy.precision, device)
    implementation = resolve_implementation(o.implementation, device, o.name, o.offload)
    strategy = run_strategy(cfg, precision.name, implementation, world_size)
    offload_params = False
    if cfg.distributed.deepspeed_config is not None:  # a missing file is one line wherever it would be read
        ds_path = resolve_ds_path(cfg.distributed.deepspeed_config)
        if kind == "deepspeed":
            optimizer_off, offload_params = offloaded(read_ds(ds_path), str(ds_path))
            strategy = strategy.replace(optimizer_offload=optimizer_off or o.offload)
    conflict = strategy.conflict(o.grad_clip, world_size, kind)
    if conflict:
        raise UserError(conflict)
    return precision, strategy, offload_params


def check_before_launch(cfg: RunConfig, world_size: int) -> None:
    """What every rank would refuse alike (no GPU, levers that do not combine on this many ranks, a DeepSpeed JSON
    that is unreadable or disagrees with memfit's config), refused by the launcher once, before any rank starts.

    Raises:
        UserError: as ``run_levers`` (for the device ``train.device`` names on this node).
    """
    precision, _, _ = run_levers(cfg, resolve_device(cfg.train.device), world_size)
    if engine_kind(cfg, world_size) == "deepspeed":  # the JSON against memfit's config, as each rank reconciles it
        ds_path = resolve_ds_path(cfg.distributed.deepspeed_config)
        reconcile(ds_path, cfg, precision, world_size, grad_accum_steps(cfg, world_size))
