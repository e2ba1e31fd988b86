"""Which device a run uses and what it can do (CUDA and ROCm builds both use the ``cuda`` device name)."""

from __future__ import annotations

import torch

from memfit.errors import UserError


def resolve_device(name: str) -> torch.device:
    """Turn ``train.device`` into a ``torch.device``.

    Raises:
        UserError: when a GPU is asked for and none is present.
    """
    if name == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"train.device is '{name}' but this torch build sees no GPU; use train.device=cpu")
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise UserError(
                f"train.device is '{name}' but only {torch.cuda.device_count()} GPU(s) are visible; "
                f"use cuda:0..cuda:{torch.cuda.device_count() - 1}"
            )
        return torch.device("cuda", index)
    return device


def is_rocm() -> bool:
    """True on a ROCm (HIP) build of PyTorch."""
    return torch.version.hip is not None


def device_name(device: torch.device) -> str:
    """A human name: the GPU's marketing name (plus gcnArchName on ROCm), or 'cpu'."""
    if device.type != "cuda":
        return "cpu"
    props = torch.cuda.get_device_properties(device)
    arch = getattr(props, "gcnArchName", "") if is_rocm() else ""
    return f"{props.name} ({arch})" if arch else props.name


def supports_bf16(device: torch.device) -> bool:
    """bf16 compute: CUDA capability >= 8.0 / ROCm gfx90a+ (torch decides); CPU always (autocast emulates)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return True
