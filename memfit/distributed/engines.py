"""Data-parallel engines: how the model and its training state are replicated or sharded over ranks.

    single   one process, the model as built (the plain trainer).
    ddp      ZeRO-0: DistributedDataParallel; gradients all-reduced once per optimizer step.
    zero1    ZeRO-1: DDP + ``ZeroRedundancyOptimizer`` (each rank steps and holds 1/N of AdamW state).
    fsdp2    ZeRO-2 / ZeRO-3: ``fully_shard`` on every decoder layer and on the root, with
             ``reshard_after_forward`` False (gradients and optimizer state sharded, parameters kept
             whole from forward to backward) or True on the layers (parameters sharded too; the
             root group stays gathered between forward and backward, as FSDP2 does by default). Mixed precision goes
             through ``MixedPrecisionPolicy`` (bf16/fp16 compute copies, fp32 gradient reduction). With
             ``optimizer.offload``, ``CPUOffloadPolicy``: the sharded parameters, their gradients and the AdamW
             state live in host memory (pinned on GPUs) and AdamW steps there (fused CPU kernel under ``auto``).
DeepSpeed lives in ``deepspeed_engine.py``; it drives its own backward and step.

Gradients: every rank's loss is scaled so that the engines' mean over ranks equals the
single-process loss of the same global batch (see ``StepRunner.step``).
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, replace

import torch
from torch.distributed.tensor import DTensor

from memfit.config.schema import OptimizerConfig
from memfit.errors import UserError
from memfit.models.load import decoder_layers
from memfit.strategies.optimizer import (
    adamw_groups,
    adamw_kwargs,
    build_optimizer,
    engine_host_config,
    resolve_implementation,
)
from memfit.strategies.precision import Precision


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm over ``params`` to ``max_norm`` and return the norm before clipping.

    With FSDP2 the gradients are sharded DTensors: their norm is reduced over ranks (``full_tensor``)
    before the clip coefficient is applied, so every rank clips by the same global norm.
    """
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, 2.0)
    if isinstance(total, DTensor):
        local = total.to_local()
        if local.device.type == "cpu" and torch.distributed.get_backend() == "nccl":
            # CPU-offloaded shards on GPUs: NCCL reduces device tensors only, so the squares go over and back
            squares = local.float().pow(2).to(torch.device("cuda", torch.cuda.current_device()))
            torch.distributed.all_reduce(squares)
            total = squares.sqrt().to(local.device)
        else:
            total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


@dataclass
class Parallel:
    """The model as the engine wraps it, the optimizer over this rank's share, and the engine's rules.

    ``model`` runs forward/backward; ``module`` is the plain (or FSDP2-sharded) model underneath a
    DDP wrapper, used for evaluation, checkpoint names and export.
    """

    kind: str
    model: torch.nn.Module
    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    params: list[torch.nn.Parameter]
    precision: Precision

    def grad_sync(self, is_last: bool):
        """Context for one micro-batch's backward: DDP skips the all-reduce until the last one."""
        if self.kind in ("ddp", "zero1") and not is_last:
            return self.model.no_sync()
        return contextlib.nullcontext()

    def local_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer holding this rank's state (ZeroRedundancyOptimizer's inner AdamW for zero1)."""
        return self.optimizer.optim if self.kind == "zero1" else self.optimizer


def parallelize(
    model: torch.nn.Module, kind: str, stage: int, precision: Precision, device: torch.device, opt: OptimizerConfig
) -> Parallel:
    """Wrap ``model`` (already on ``device``, LoRA and checkpoint wrappers applied) for ``kind``."""
    if kind == "single":
        params = [p for p in model.parameters() if p.requires_grad]
        return Parallel(kind, model, model, build_optimizer(params, opt, device), params, precision)
    if kind in ("ddp", "zero1"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        # buffers are the same on every rank (rotary frequencies): synced once at init, never in each forward
        # (torch >= 2.13 names that forward_sync_buffers and deprecates broadcast_buffers with a warning per rank)
        named = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters else None
        no_sync = {named or "broadcast_buffers": False}
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, **no_sync)
        params = [p for p in model.parameters() if p.requires_grad]
        if kind == "ddp":
            optimizer = build_optimizer(params, opt, device)
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            impl = resolve_implementation(opt.implementation, device)
            groups = adamw_groups(params, opt)
            optimizer = ZeroRedundancyOptimizer(
                groups[0]["params"],
                optimizer_class=torch.optim.AdamW,
                **adamw_kwargs(opt, impl),
                weight_decay=groups[0]["weight_decay"],
            )
            for group in groups[1:]:
                optimizer.add_param_group(group)
        return Parallel(kind, ddp, model, optimizer, params, precision)
    if kind == "fsdp2":
        return _fully_shard(model, stage, precision, device, opt)
    raise UserError(f"unknown engine '{kind}'")  # deepspeed is built by memfit.distributed.deepspeed_engine


def _fully_shard(model, stage: int, precision: Precision, device: torch.device, opt: OptimizerConfig) -> Parallel:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    if precision.autocast_dtype is not None:
        # FSDP2 casts the gathered parameters to the compute dtype and reduces gradients in fp32;
        # autocast is then off (the policy does its work), the loss is still taken from fp32 logits.
        mp = MixedPrecisionPolicy(param_dtype=precision.autocast_dtype, reduce_dtype=torch.float32)
        precision = replace(precision, autocast_dtype=None)
    else:
        mp = MixedPrecisionPolicy()
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if opt.offload else OffloadPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, reshard_after_forward=stage == 3, mp_policy=mp, offload_policy=offload)
    # the root group (embeddings, final norm, head) stays gathered from forward to backward at both
    # stages, FSDP2's own heuristic for the root: backward would all-gather it again at once
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp, offload_policy=offload)
    params = [p for p in model.parameters() if p.requires_grad]
    if opt.offload:  # the shards are host tensors already: a plain AdamW over them steps on the host
        opt, device = engine_host_config(opt), torch.device("cpu")
    return Parallel("fsdp2", model, model, build_optimizer(params, opt, device), params, precision)
