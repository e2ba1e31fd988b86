"""``train.profile_step``: one training step's tensor peak on every rank, measured, beside the planner's per-rank
prediction."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from memfit.errors import UserError
from memfit.strategies.host_optimizer import host_tensors
from memfit.strategies.tensors import state_tensors
from memfit.telemetry.profiler import collectives_release_on_caller, profiled_peak_bytes
from memfit.telemetry.readings import local_tensor


def profiled_train_step(
    step: Callable[[], tuple[float, float]], batches, kind: str, device: torch.device, ctx, par, predicted
) -> tuple[tuple[float, float], dict[str, Any]]:
    """Run ``step`` (the trainer's ``train_step`` on ``batches``) and measure this rank's tensor peak during it,
    gathered from every rank: on CPU from torch.profiler (tensors alive before the step counted by storage, plus
    the running sum of the step's allocation events), on CUDA/ROCm from the caching allocator.

    Returns:
        the step's (loss, grad norm), and the record fields (``profiled_peak_bytes``, per rank, how, and the
        ``predicted`` StepMemory's peak where there is one).

    Raises:
        UserError: for an engine whose buffers live outside the profiled region (DDP's gradient
            buckets, DeepSpeed's flat buffers are allocated at start-up and not visible to it).
    """
    if kind not in ("single", "fsdp2"):
        raise UserError(
            f"train.profile_step: engine {kind} keeps buffers the profiler cannot see "
            "(allocated before the step); use it with one process or distributed.zero_stage 2/3"
        )
    box: list[tuple[float, float]] = []
    if device.type == "cuda":
        # torch.profiler drops the releases made on the autograd engine's device thread (3,083 of
        # 7,242 in a 7B LoRA step on an H200: its peak read 38.7 GB against 33.6 GB allocated);
        # the caching allocator's own counters see every thread.
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        box.append(step())
        torch.cuda.synchronize(device)
        peak, how = torch.cuda.max_memory_allocated(device), "caching allocator"
    else:
        opt = par.local_optimizer()
        live = [local_tensor(x) for x in (*par.module.parameters(), *par.module.buffers())]
        live += state_tensors(opt) + host_tensors(opt)
        live += [x for b in batches for x in b]
        held = collectives_release_on_caller() if ctx.distributed else contextlib.nullcontext()
        # gloo's own copies and flat buffers (inside c10d's ops and on its worker threads), freed where it is blind
        private = ("c10d::", "gloo:") if ctx.distributed else ()
        with held:  # every release of the program's tensors where the profiler sees it
            peak = profiled_peak_bytes(lambda: box.append(step()), live, "CPU", private)
        how = "torch.profiler" + (" (the collective backend's private copies left out)" if private else "")
    per_rank = [int(r[0]) for r in ctx.gather_numbers([float(peak)])]
    out: dict[str, Any] = {
        "profiled_peak_bytes": max(per_rank),
        "rank_profiled_peak_bytes": per_rank,
        "profiled_with": how,
    }
    if predicted is not None:
        out["predicted_peak_bytes"] = predicted.peak_bytes
    return box[0], out
