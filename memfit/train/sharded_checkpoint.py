"""Sharded checkpoints for multi-rank runs, written atomically by all ranks together.

Layout of ``checkpoints/step_NNNNNNN/`` (the directory must be on storage every rank can reach):
    .metadata, __R_0.distcp  ``torch.distributed.checkpoint`` (DCP) files: trainable weights (each
                             rank writes its FSDP2 shard; replicated DDP weights are written once)
                             and, for FSDP2 / DDP, the optimizer state the same way
    optim_rankR.pt           ZeRO-1: rank R's ZeroRedundancyOptimizer partition (loaded weights_only)
    deepspeed/               engine deepspeed: DeepSpeed's own checkpoint (``save_checkpoint``)
    rng_rankR.pt             rank R's RNG states
    scheduler.pt             LR-scheduler state (rank 0)
    trainer_state.json       step, data position, world size and engine (rank 0, written last)
Every rank writes into ``.tmp-step_NNNNNNN``; after a barrier rank 0 fsyncs and renames it, so a rank
dying mid-save leaves no directory that looks complete (the leftover is removed on the next start).
Resume needs the same world size and engine; the checkpoint says which it was written with.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from memfit.distributed.engines import Parallel
from memfit.distributed.runtime import DistContext, on_every_rank
from memfit.errors import UserError
from memfit.safe_files import DS_CHECKPOINT_GLOBALS, load_dcp, read_torch, vet_checkpoint
from memfit.train.checkpoint import (
    TrainerState,
    begin_atomic,
    checkpoint_dir,
    commit_atomic,
    rng_state,
    rotate,
    set_rng_state,
    temp_dir_for,
)

_TRAINABLE = StateDictOptions(ignore_frozen_params=True)


def save_distributed(
    ctx: DistContext, root: Path, state: TrainerState, scheduler, keep: int, write_shards: Callable[[Path], None]
) -> Path:
    """Write one checkpoint from every rank (``write_shards(tmp)`` is the engine's collective save)."""
    target = checkpoint_dir(root, state.step)
    tmp = temp_dir_for(target)
    if ctx.is_main:
        root.mkdir(parents=True, exist_ok=True)
        begin_atomic(target)
    ctx.barrier()
    write_shards(tmp)
    torch.save(rng_state(), tmp / f"rng_rank{ctx.rank}.pt")
    ctx.barrier()
    if ctx.is_main:
        torch.save({"scheduler": scheduler.state_dict()}, tmp / "scheduler.pt")
        state.write(tmp)
        commit_atomic(tmp, target, manifest=True)
        rotate(root, keep)
    ctx.barrier()
    return target


def check_compatible(path: Path, world_size: int, engine: str) -> TrainerState:
    """The checkpoint's trainer state, after checking it was written by this world size and engine.

    Raises:
        UserError: naming the world size / engine it was written with and how to resume it.
    """
    state = TrainerState.read(path)
    if state.world_size != world_size:
        raise UserError(
            f"checkpoint {path} was written by {state.world_size} rank(s) but this run has {world_size}; "
            f"resume with the same world size (--nproc-per-node x --nnodes = {state.world_size})"
        )
    if state.engine != engine:
        raise UserError(
            f"checkpoint {path} was written by engine '{state.engine}' but this run uses '{engine}'; "
            "resume with the same distributed.engine and distributed.zero_stage"
        )
    return state


def load_distributed(ctx: DistContext, path: Path, scheduler, read_shards: Callable[[Path], None]) -> None:
    """Restore what ``save_distributed`` wrote (``read_shards(path)`` is the engine's collective load), once every
    rank has found nothing in its files that would run code (``safe_files.vet_checkpoint``)."""
    on_every_rank(ctx, lambda: vet_checkpoint(path, DS_CHECKPOINT_GLOBALS if (path / "deepspeed").is_dir() else ()))
    read_shards(path)
    scheduler.load_state_dict(read_torch(path / "scheduler.pt")["scheduler"])
    # ZeroRedundancyOptimizer keeps its own param_groups (the local optimizer's were loaded): put the
    # schedule's current LR back into whatever groups the optimizer steps with
    for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr
    set_rng_state(read_torch(path / f"rng_rank{ctx.rank}.pt"))


def dcp_writer(ctx: DistContext, par: Parallel) -> Callable[[Path], None]:
    """The collective save of a DDP / ZeRO-1 / FSDP2 run's weights and optimizer state."""

    def write(tmp: Path) -> None:
        if par.kind == "zero1":
            dcp.save({"model": get_model_state_dict(par.model, options=_TRAINABLE)}, checkpoint_id=tmp)
            torch.save(par.local_optimizer().state_dict(), tmp / f"optim_rank{ctx.rank}.pt")
            return
        model_sd, optim_sd = get_state_dict(par.model, par.optimizer, options=_TRAINABLE)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)

    return write


def dcp_reader(ctx: DistContext, par: Parallel) -> Callable[[Path], None]:
    def read(path: Path) -> None:
        if par.kind == "zero1":
            sd = {"model": get_model_state_dict(par.model, options=_TRAINABLE)}
            load_dcp(sd, path)
            set_model_state_dict(par.model, sd["model"], options=_TRAINABLE)
            par.local_optimizer().load_state_dict(read_torch(path / f"optim_rank{ctx.rank}.pt", map_location="cpu"))
            return
        model_sd, optim_sd = get_state_dict(par.model, par.optimizer, options=_TRAINABLE)
        sd = {"model": model_sd, "optim": optim_sd}
        load_dcp(sd, path)
        set_state_dict(
            par.model, par.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"], options=_TRAINABLE
        )

    return read


def full_state_dict(par: Parallel) -> dict[str, torch.Tensor]:
    """Every weight, unsharded, on rank 0's CPU (empty on other ranks); collective for FSDP2."""
    return get_model_state_dict(par.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
