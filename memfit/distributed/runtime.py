"""The process group a run belongs to: who this rank is, and the few collectives the trainer needs.

A run started by ``torchrun`` (or ``memfit train --nproc-per-node N``) finds RANK, WORLD_SIZE and
LOCAL_RANK in its environment and joins the default process group; a plain ``memfit train`` is a
world of one, and every collective here is then a no-op, so the trainer has one code path.

Backend: ``nccl`` on CUDA and ROCm (PyTorch's ROCm build serves RCCL under the nccl name), ``gloo``
on CPU, unless ``distributed.backend`` says otherwise. ``distributed.timeout_s`` bounds how long a
rank waits in a collective for a peer that has gone silent.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from memfit.errors import ReportedByRankZero, UserError

T = TypeVar("T")


def launched_ranks() -> int:
    """WORLD_SIZE from a launcher's environment (1 when not launched by torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass(frozen=True)
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over ranks in place (returned for chaining)."""
        if self.distributed:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def gather_numbers(self, values: list[float]) -> list[list[float]]:
        """Every rank's ``values`` (same length everywhere), indexed by rank."""
        if not self.distributed:
            return [list(values)]
        local = torch.tensor(values, dtype=torch.float64, device=self._collective_device())
        out = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(out, local)
        return [t.tolist() for t in out]

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (picklable Python objects; only between our own ranks)."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, device=self._collective_device())
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def _collective_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")


def pick_backend(name: str, device_type: str) -> str:
    """``distributed.backend`` made concrete for the device type ('cuda' or 'cpu').

    Raises:
        UserError: nccl asked for on a CPU run.
    """
    if name == "auto":
        return "nccl" if device_type == "cuda" else "gloo"
    if name == "nccl" and device_type != "cuda":
        raise UserError("distributed.backend nccl needs GPUs; use gloo (or auto) for a CPU run")
    return name


def init_distributed(backend_name: str, device_type: str, timeout_s: int) -> DistContext:
    """Join the process group torchrun set up in the environment, or return a world of one.

    On a GPU each rank takes ``cuda:LOCAL_RANK``, so ``train.device`` ``cuda`` / ``auto`` means
    "my GPU" under torchrun.
    """
    world = launched_ranks()
    if world == 1:
        return DistContext()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    backend = pick_backend(backend_name, device_type)
    if device_type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise UserError(
                f"local rank {local_rank} has no GPU: this node sees {torch.cuda.device_count()}; "
                "lower --nproc-per-node to the number of GPUs"
            )
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    return DistContext(rank, world, local_rank, backend)


def shutdown(ctx: DistContext) -> None:
    if ctx.distributed and dist.is_initialized():
        dist.destroy_process_group()


def on_main(ctx: DistContext, fn: Callable[[], T]) -> T:
    """Run ``fn`` on rank 0 only and hand its result to every rank; a ``UserError`` it raises is
    raised on every rank (printed once, by rank 0), so no rank waits for a peer that gave up."""
    if not ctx.distributed:
        return fn()
    result, local_error = None, None
    if ctx.is_main:
        try:
            result = fn()
        except UserError as e:
            local_error = e
    result, message = ctx.broadcast((result, str(local_error) if local_error else None))
    if local_error is not None:
        raise local_error
    if message is not None:
        raise ReportedByRankZero(message)
    return result


def on_every_rank(ctx: DistContext, fn: Callable[[], T]) -> T:
    """Run ``fn`` on every rank, for what each reads from the same inputs (the config, the data): a ``UserError``
    any rank raises ends every rank, printed once, by rank 0 (with the rank's number where rank 0's own ``fn``
    did not raise it: another node's files can differ). ``fn`` returns on every rank, so all reach the gather."""
    if not ctx.distributed:
        return fn()
    result, error = None, None
    try:
        result = fn()
    except UserError as e:
        error = e
    messages: list[str | None] = [None] * ctx.world_size
    dist.all_gather_object(messages, None if error is None else str(error))
    failed = [(rank, m) for rank, m in enumerate(messages) if m is not None]
    if not failed:
        return result
    if not ctx.is_main:
        raise ReportedByRankZero(failed[0][1])
    if error is not None:
        raise error
    rank, message = failed[0]
    raise UserError(f"rank {rank}: {message}")
