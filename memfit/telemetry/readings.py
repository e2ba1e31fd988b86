"""Memory readings the trainer records: device allocator statistics on GPU, process RSS on CPU,
and the exact bytes held by parameters, gradients and optimizer state.

Words follow PRODUCT.md: *allocated* is the allocator's active blocks, *reserved* what it holds from
the device; ``reserved - allocated`` is the external free space the cache keeps.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import resource
from dataclasses import dataclass

import torch

from memfit.strategies.host_optimizer import host_tensors
from memfit.strategies.tensors import held_bytes, plain_tensors, state_tensors
from memfit.units import process_rss_bytes


def peak_rss_bytes() -> int:
    """High-water mark of this process's RSS since start or the last ``reset_peaks`` (Linux VmHWM).

    Falls back to ``ru_maxrss`` (peak since start, never reset) where /proc is unavailable.
    """
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peaks(device: torch.device) -> None:
    """Start a new peak window: the allocator's peak stats on GPU, the RSS high-water mark on CPU."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # Linux >= 4.0: reset VmHWM to the current RSS
    except OSError:
        pass  # no /proc (not Linux): peak_rss_bytes then reports the peak since start


def memory_record(device: torch.device) -> dict[str, int]:
    """Memory fields for one step record: peaks since the last ``reset_peaks`` and current values."""
    if device.type != "cuda":
        return {"rss_bytes": process_rss_bytes(), "peak_rss_bytes": peak_rss_bytes()}
    s = torch.cuda.memory_stats(device)
    return {
        "peak_allocated_bytes": s.get("allocated_bytes.all.peak", 0),
        "peak_reserved_bytes": s.get("reserved_bytes.all.peak", 0),
        "peak_active_bytes": s.get("active_bytes.all.peak", 0),
        "allocated_bytes": s.get("allocated_bytes.all.current", 0),
        "reserved_bytes": s.get("reserved_bytes.all.current", 0),
        "reserved_minus_allocated_bytes": s.get("reserved_bytes.all.current", 0)
        - s.get("allocated_bytes.all.current", 0),
        "alloc_retries": s.get("num_alloc_retries", 0),
        "ooms": s.get("num_ooms", 0),
        **device_utilization(device),
    }


@functools.cache
def _driver_errors() -> tuple[type[BaseException], ...]:
    """What ``torch.cuda.utilization`` raises where a reading is not to be had: no driver package, an error of
    NVML or amdsmi (not supported on this device, a MIG instance), a device it cannot map."""
    errors: list[type[BaseException]] = [ImportError, RuntimeError, ValueError]
    for module, name in (("pynvml", "NVMLError"), ("amdsmi", "AmdSmiException")):
        if importlib.util.find_spec(module) is not None:
            errors.append(getattr(importlib.import_module(module), name))
    return tuple(errors)


def device_utilization(device: torch.device) -> dict[str, float]:
    """The GPU's compute and memory-bandwidth utilisation over the driver's last sample period, as fractions
    (``torch.cuda.utilization`` / ``memory_usage``: NVML, or amdsmi on ROCm); a value the driver or its Python
    package does not give is left out, never zero."""
    out = {}
    reads = (
        ("gpu_compute_utilization", torch.cuda.utilization),
        ("gpu_memory_bandwidth_utilization", torch.cuda.memory_usage),
    )
    for key, read in reads:
        try:
            percent = float(read(device))
        except _driver_errors():
            continue
        if 0 <= percent <= 100:
            out[key] = percent / 100
    return out


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2 parameters, gradients, optimizer state) or of a DeepSpeed
    ZeRO-3 parameter (``ds_tensor``; the parameter itself is empty between forward passes), else ``t``."""
    if hasattr(t, "to_local"):
        return t.to_local()
    return getattr(t, "ds_tensor", t)


def _tensor_bytes(t: torch.Tensor) -> int:
    return held_bytes(local_tensor(t))


@dataclass(frozen=True)
class StateBytes:
    """Bytes held by the model states (each storage counted once, tied weights included)."""

    params_bytes: int
    trainable_params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    params: int
    trainable_params: int
    host_bytes: int = 0  # a GPU run's model states in host memory (offloaded), the offloaded optimizer's copies too
    host_counted_bytes: int = 0  # the part of the three byte counts above that is host memory

    @property
    def total_bytes(self) -> int:
        """The model states' device bytes (all their bytes on a CPU run)."""
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes - self.host_counted_bytes


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, on_gpu: bool = False) -> StateBytes:
    """Bytes of the parameters, gradients and optimizer state as this rank holds them. ``on_gpu``: those in host
    memory (``optimizer.offload``: the offloaded optimizer's state, masters and gradient copies, or FSDP2's
    CPU-offloaded shards) are ``host_bytes``; on a CPU run the offloaded optimizer's copies count as optimizer
    state, as the planner counts them there."""
    on_host = 0

    def held(t: torch.Tensor) -> int:
        nonlocal on_host
        n = _tensor_bytes(t)
        on_host += n if on_gpu and local_tensor(t).device.type == "cpu" else 0
        return n

    seen: set[int] = set()
    params_b = trainable_b = grads_b = n = n_train = 0
    for p in model.parameters():
        key = plain_tensors(local_tensor(p))[0].data_ptr()  # an NF4 weight's codes stand for it
        if key in seen:
            continue
        seen.add(key)
        params_b += held(p)
        numel = getattr(p, "ds_numel", p.numel())  # the model's count (global); bytes are what this rank holds
        n += numel
        if p.requires_grad:
            trainable_b += _tensor_bytes(p)
            n_train += numel
        if p.grad is not None:
            grads_b += held(p.grad)
    opt_b = copies = 0
    if optimizer is not None:
        opt_b = sum(held(t) for t in state_tensors(optimizer))
        host = host_tensors(optimizer)  # an offloaded optimizer's: its state, masters and gradient buffers
        copies = sum(_tensor_bytes(t) for t in host) - opt_b if host else 0
    if not on_gpu:
        return StateBytes(params_b, trainable_b, grads_b, opt_b + copies, n, n_train)
    return StateBytes(params_b, trainable_b, grads_b, opt_b, n, n_train, on_host + copies, on_host)
