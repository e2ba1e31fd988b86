"""Caching-allocator policy for CUDA and ROCm: settings string, memory cap, pre-warm, cache release.

PyTorch reads its allocator settings from ``PYTORCH_CUDA_ALLOC_CONF`` (``PYTORCH_HIP_ALLOC_CONF`` on
ROCm builds, ``PYTORCH_ALLOC_CONF`` on recent releases) when the allocator starts, i.e. at the first
GPU allocation. ``apply_allocator_env`` must therefore run before anything touches the GPU; if the
allocator is already up, the settings go through ``torch.cuda.memory._set_allocator_settings``.
On CPU none of this applies and the trainer says so once.
"""

from __future__ import annotations

import os

import torch

from memfit.allocator.conf import parse, split_pairs, unsafe_combination
from memfit.config.schema import AllocatorConfig
from memfit.device import is_rocm
from memfit.errors import UserError
from memfit.units import GIB


def alloc_conf_items(cfg: AllocatorConfig) -> dict[str, str]:
    """The ``key:value`` pairs this config sets (empty when it leaves the allocator alone)."""
    items: dict[str, str] = {}
    if cfg.expandable_segments is not None:
        items["expandable_segments"] = "True" if cfg.expandable_segments else "False"
    if cfg.max_split_size_mb is not None:
        items["max_split_size_mb"] = str(cfg.max_split_size_mb)
    if cfg.garbage_collection_threshold is not None:
        items["garbage_collection_threshold"] = str(cfg.garbage_collection_threshold)
    return items


def env_var_name() -> str:
    return "PYTORCH_HIP_ALLOC_CONF" if is_rocm() else "PYTORCH_CUDA_ALLOC_CONF"


def conf_var() -> str:
    """The variable the allocator will read: ``PYTORCH_ALLOC_CONF`` when it is set (PyTorch reads it
    first, ``c10/core/AllocatorConfig.cpp``; the build's own name is its fallback), else the build's own."""
    return "PYTORCH_ALLOC_CONF" if os.environ.get("PYTORCH_ALLOC_CONF") else env_var_name()


def conf_in_effect() -> str:
    """The allocator settings string this process runs with ("" for the defaults)."""
    return os.environ.get(conf_var(), "")


def merge_conf(existing: str, items: dict[str, str]) -> str:
    """Merge our items into an existing ``k:v,k:v`` string; ours win, the user's other keys stay."""
    merged: dict[str, str] = {}
    for part in split_pairs(existing):
        key, _, value = part.partition(":")
        merged[key.strip()] = value.strip()
    merged.update(items)
    return ",".join(f"{k}:{v}" for k, v in merged.items())


def refuse_unsafe(cfg: AllocatorConfig, hip: str | None) -> None:
    """Refuse allocator settings known to misbehave on this build (``conf.unsafe_combination``: the config's
    own merged with the environment's), unless ``allocator.allow_unsafe``.

    Raises:
        UserError: naming the settings, what went wrong where, and the override.
    """
    merged = parse(merge_conf(conf_in_effect(), alloc_conf_items(cfg))).settings
    unsafe = unsafe_combination(merged, hip)
    if unsafe and not cfg.allow_unsafe:
        raise UserError(f"allocator: {unsafe}, or set allocator.allow_unsafe=true to run it anyway")


def apply_allocator_env(cfg: AllocatorConfig) -> str | None:
    """Put the settings where the allocator will read them. Returns the string applied, if any."""
    items = alloc_conf_items(cfg)
    if not items:
        return None
    name = conf_var()  # a user's PYTORCH_ALLOC_CONF would hide settings written to the build's own name
    conf = merge_conf(os.environ.get(name, ""), items)
    os.environ[name] = conf
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.memory._set_allocator_settings(conf)
    return conf


def apply_device_limits(cfg: AllocatorConfig, device: torch.device) -> list[str]:
    """Memory-fraction cap and pre-warm reservation on a GPU. Returns notes for the run log."""
    notes: list[str] = []
    if device.type != "cuda":
        if alloc_conf_items(cfg) or cfg.memory_fraction or cfg.prewarm_gib or cfg.empty_cache_every:
            notes.append("allocator settings apply to CUDA/ROCm devices only; ignored on CPU")
        return notes
    if cfg.garbage_collection_threshold is not None and cfg.memory_fraction is None:
        notes.append("allocator.garbage_collection_threshold only acts with allocator.memory_fraction set")
    if cfg.memory_fraction is not None:
        torch.cuda.set_per_process_memory_fraction(cfg.memory_fraction, device)
    if cfg.prewarm_gib > 0:
        block = torch.empty(int(cfg.prewarm_gib * GIB), dtype=torch.uint8, device=device)
        del block  # the segment stays reserved in the cache for later allocations
        notes.append(
            f"pre-warmed {cfg.prewarm_gib:g} GiB (reserved {torch.cuda.memory_reserved(device) / GIB:.2f} GiB)"
        )
    return notes


def maybe_release_cache(cfg: AllocatorConfig, device: torch.device, step: int) -> bool:
    """``empty_cache()`` every ``empty_cache_every`` optimizer steps on a GPU. Returns whether it ran."""
    if device.type == "cuda" and cfg.empty_cache_every and step % cfg.empty_cache_every == 0:
        torch.cuda.empty_cache()
        return True
    return False
