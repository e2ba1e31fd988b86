"""One optimizer step, as the trainer drives it: ``StepRunner`` (one process, DDP, ZeRO-1, FSDP2) and
``DeepSpeedRunner`` (DeepSpeed drives its own backward and step). The planner traces ``StepRunner``
under FakeTensorMode, so what it predicts is what this code allocates.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from memfit.config.schema import OptimizerConfig
from memfit.config.strategy import Strategy
from memfit.distributed.engines import clip_grad_norm
from memfit.distributed.runtime import DistContext
from memfit.step.loss import ChunkedLoss, batch_loss_sum, global_token_count
from memfit.strategies.offload import ActivationOffload, activation_offload
from memfit.strategies.optimizer import OptimizerInBackward, build_optimizer
from memfit.strategies.precision import Precision, precision_policy

Batch = tuple[torch.Tensor, ...]  # (tokens, labels) or, packed rows, (tokens, labels, positions), each (B, T+1)


def sample_batch(tokens: torch.Tensor, packed: bool, records: int = 4) -> Batch:
    """A batch of (B, T+1) ``tokens`` as the planner traces and measures it: tokens as their own labels and, for
    ``packed`` rows (``strategy.packing``), position ids of ``records`` records of equal length per row."""
    if not packed:
        return tokens, tokens
    length = -(-tokens.shape[1] // records)
    positions = (torch.arange(tokens.shape[1], device=tokens.device) % length).expand_as(tokens).contiguous()
    return tokens, tokens, positions


class StepEngine(Protocol):
    """What the trainer drives once per optimizer step: ``StepRunner`` or ``DeepSpeedRunner``."""

    def step(self, batches: list[Batch]) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward/backward over the micro-batches and the optimizer step: (mean token loss, grad norm)."""
        ...

    def zero_grad(self) -> None: ...


def _no_sync_needed(is_last: bool):
    return contextlib.nullcontext()


@dataclass
class StepRunner:
    """One optimizer step of the trainer; the planner traces this same object under FakeTensorMode.

    With several ranks (``ctx``), each rank's loss is normalised by the supervised tokens of the
    whole *global* step and multiplied by the world size, so the engines' mean over ranks gives the
    gradient one process would get from the same global batch. ``grad_sync(is_last)`` wraps each
    micro-batch (DDP skips its all-reduce until the last one).
    """

    model: torch.nn.Module
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    precision: Precision
    device: torch.device
    grad_clip: float
    scaler: torch.amp.GradScaler | None = None
    ctx: DistContext = field(default_factory=DistContext)
    grad_sync: Callable[[bool], Any] = _no_sync_needed
    chunked: ChunkedLoss | None = None  # strategy.loss_chunks: the loss computed chunk by chunk
    offload: ActivationOffload | None = None  # strategy.activation_offload: around each forward

    @classmethod
    def for_strategy(
        cls, model: torch.nn.Module, strategy: Strategy, device: torch.device, copies_back: bool | None = None
    ) -> StepRunner:
        """The step of ``strategy`` for one process, as the planner traces and measures it: AdamW over the
        trainable parameters (clipping at 1.0 unless the step runs in backward), the loss chunked as set,
        activations offloaded as set (``copies_back``: see ``ActivationOffload``)."""
        params = [p for p in model.parameters() if p.requires_grad]
        opt_cfg = OptimizerConfig(
            name=strategy.optimizer_name,
            implementation=strategy.optimizer,
            in_backward=strategy.optimizer_in_backward,
            offload=strategy.optimizer_offload,
        )
        optimizer = build_optimizer(params, opt_cfg, device)
        clip = 0.0 if strategy.optimizer_in_backward else 1.0
        chunked = ChunkedLoss.attach(model, strategy.loss_chunks)
        offload = activation_offload(strategy.activation_offload, device, copies_back)
        return cls(
            model,
            params,
            optimizer,
            precision_policy(strategy.precision),
            device,
            clip,
            chunked=chunked,
            offload=offload,
        )

    def _loss(self, batch: Batch) -> torch.Tensor:
        """One micro-batch's summed token loss (the forward), its saved tensors offloaded where set."""
        with self.offload if self.offload is not None else contextlib.nullcontext():
            return batch_loss_sum(self.model, batch, self.precision, self.device, self.chunked)

    def step(self, batches: list[Batch]) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward/backward over ``batches`` (gradient accumulation), clip, optimizer step, free grads.

        The loss is normalised by the supervised tokens of the whole step, so accumulation over k
        micro-batches gives the same update as one batch k times larger. With ``OptimizerInBackward``
        the parameters are stepped during backward (one micro-batch, no clipping).

        Returns:
            (loss, grad_norm) as 0-d tensors; loss is the mean token loss of the (global) step.
        """
        if isinstance(self.optimizer, OptimizerInBackward):
            return self._step_in_backward(batches)
        loss_sum = self.accumulate(batches)
        return self.ctx.all_reduce_sum(loss_sum), self.update()

    def accumulate(self, batches: list[Batch]) -> torch.Tensor:
        """Forward and backward over ``batches``, gradients summed: this rank's share of the step's mean token loss.
        The first half of ``step``; the planner traces it alone for the moments of forward and backward."""
        n_tokens = global_token_count(batches, self.ctx, self.device)
        world = self.ctx.world_size
        loss_sum = torch.zeros((), device=self.device)
        for i, batch in enumerate(batches):
            with self.grad_sync(i == len(batches) - 1):
                loss = self._loss(batch) / n_tokens
                scaled = loss * world if world > 1 else loss
                (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            loss_sum += loss.detach()
        return loss_sum

    def update(self) -> torch.Tensor:
        """Unscale, clip and step on the gradients ``accumulate`` left: the gradient norm. The second half of
        ``step``; the planner traces it alone, on gradients of the parameters' shapes, for the clipping and
        optimizer moments."""
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        grad_norm = clip_grad_norm(self.params, self.grad_clip or float("inf"))
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        return grad_norm

    def _step_in_backward(self, batches: list[Batch]) -> tuple[torch.Tensor, torch.Tensor]:
        (batch,) = batches  # Strategy.conflict: one micro-batch, one process, no scaler
        n_tokens = global_token_count(batches, self.ctx, self.device)
        self.optimizer.begin_step()
        loss = self._loss(batch) / n_tokens
        loss.backward()  # every parameter is stepped, and its gradient freed, in here
        self.optimizer.step()  # nothing left to step; ends the step for the LR scheduler
        return loss.detach(), self.optimizer.grad_norm(self.device)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


class DeepSpeedRunner:
    """One optimizer step through a DeepSpeed engine: ``backward`` and ``step`` per micro-batch
    (DeepSpeed applies the optimizer at its accumulation boundary, clipping as configured)."""

    def __init__(self, engine, ctx: DistContext, device: torch.device, chunked: ChunkedLoss | None = None):
        self.engine, self.ctx, self.device, self.chunked = engine, ctx, device, chunked

    def step(self, batches: list[Batch]) -> tuple[torch.Tensor, torch.Tensor]:
        n_tokens = global_token_count(batches, self.ctx, self.device)
        world = self.ctx.world_size
        loss_sum = torch.zeros((), device=self.device)
        no_autocast = Precision(
            "deepspeed", torch.float32, None, False, torch.float32
        )  # DeepSpeed casts the module itself
        for batch in batches:
            loss = batch_loss_sum(self.engine, batch, no_autocast, self.device, self.chunked) / n_tokens
            # the loss is already normalised over the whole step: no division by accumulation steps
            self.engine.backward(loss * world, scale_wrt_gas=False)
            self.engine.step()
            loss_sum += loss.detach()
        norm = self.engine.get_global_grad_norm()
        norm = torch.as_tensor(0.0 if norm is None else float(norm))
        return self.ctx.all_reduce_sum(loss_sum), norm

    def zero_grad(self) -> None:
        pass  # DeepSpeed zeroes gradients at its accumulation boundary
