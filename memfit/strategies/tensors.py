"""What a tensor occupies when it is a wrapper subclass: torchao's quantized optimizer states and NF4 weights,
DTensor shards. Their own storage is a stand-in of their apparent dtype and shape; their inner tensors hold
the bytes. And what an optimizer's state occupies, in those terms."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold ``t``: itself, or the inner tensors of a wrapper subclass (a torchao
    quantized state's codes, scales and code map; an NF4 weight's codes and scalers; a DTensor's local
    shard), recursively."""
    if isinstance(t, DTensor):
        return plain_tensors(t.to_local())
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        inner = (getattr(t, n) for n in names)
        return [x for i in inner if isinstance(i, torch.Tensor) for x in plain_tensors(i)]
    return [t]


def held_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements, or of its inner tensors' for a wrapper subclass."""
    return sum(x.numel() * x.element_size() for x in plain_tensors(t))


def state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every plain tensor of the optimizer's state (see ``plain_tensors``): what its state occupies."""
    out = []
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                out += plain_tensors(v)
    return out
