"""Numeric precision policies: which dtype weights live in, which dtype matmuls run in, and loss scaling.

    fp32         fp32 weights and compute.
    bf16-mixed   fp32 master weights and optimizer state, bf16 autocast for compute. Weights that are not
                 trained (a LoRA run's frozen base) are stored in bf16: they need no master copy.
    fp16-mixed   fp32 master weights, fp16 autocast, dynamic loss scaling (GradScaler). GPU only. A frozen
                 base stays fp32: in fp16 the residual stream it feeds could overflow (max 65504).
    bf16-pure    bf16 weights, gradients and optimizer state; no autocast.
    auto         bf16-mixed on GPUs with bf16 (MI200/MI300, A100+), fp16-mixed on older GPUs, fp32 on CPU.

The loss is always computed from fp32 logits (the trainer upcasts before cross-entropy).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from memfit.device import supports_bf16
from memfit.errors import UserError


@dataclass(frozen=True)
class Precision:
    """``param_dtype``: the trained weights' storage; ``frozen_dtype``: the storage of weights that are not
    trained (``memfit.strategies.lora.apply_lora`` casts them)."""

    name: str
    param_dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    grad_scaler: bool
    frozen_dtype: torch.dtype

    def autocast(self, device: torch.device):
        """The autocast context for forward passes (a no-op context when there is none)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.autocast_dtype)


_POLICIES = {
    "fp32": Precision("fp32", torch.float32, None, False, torch.float32),
    "bf16-mixed": Precision("bf16-mixed", torch.float32, torch.bfloat16, False, torch.bfloat16),
    "fp16-mixed": Precision("fp16-mixed", torch.float32, torch.float16, True, torch.float32),
    "bf16-pure": Precision("bf16-pure", torch.bfloat16, None, False, torch.bfloat16),
}


def precision_policy(name: str) -> Precision:
    """The policy of a concrete name (not ``auto``), without device checks (the planner's targets)."""
    return _POLICIES[name]


def resolve_precision(name: str, device: torch.device) -> Precision:
    """Pick the policy for ``strategy.precision`` on ``device``.

    Raises:
        UserError: fp16-mixed on CPU, or bf16 on a GPU without bf16.
    """
    if name == "auto":
        if device.type == "cpu":
            name = "fp32"
        else:
            name = "bf16-mixed" if supports_bf16(device) else "fp16-mixed"
    if name == "fp16-mixed" and device.type == "cpu":
        raise UserError(
            "strategy.precision fp16-mixed needs a GPU (fp16 loss scaling is not supported on CPU); "
            "use bf16-mixed or fp32 on CPU"
        )
    if name.startswith("bf16") and not supports_bf16(device):
        raise UserError(f"strategy.precision {name}: this GPU has no bf16 support; use fp16-mixed or fp32")
    return _POLICIES[name]
