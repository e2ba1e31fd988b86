"""Activation checkpointing by wrapping modules (non-reentrant), as PyTorch's ``checkpoint_wrapper`` does.

Policies:
    none        nothing is recomputed.
    full        every decoder layer is wrapped: only layer inputs are kept, the rest is recomputed.
    ffn         only each layer's MLP block is wrapped (the article's choice: attention is left alone).
    every_k:N   decoder layers 0, N, 2N, ... are wrapped.

The wrapper's state-dict hooks strip its ``_checkpoint_wrapped_module.`` prefix, so checkpoints and
exports keep the model's own parameter names.
"""

from __future__ import annotations

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    checkpoint_wrapper,
)

from memfit.config.strategy import CheckpointPolicy
from memfit.models.load import decoder_layers


def _wrap(module: torch.nn.Module) -> torch.nn.Module:
    return checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=True)


def apply_activation_checkpointing(model: torch.nn.Module, policy: CheckpointPolicy) -> int:
    """Wrap the modules ``policy`` selects, in place.

    Returns:
        how many modules were wrapped.
    """
    kind, k = policy.kind, policy.every
    if kind == "none":
        return 0
    layers = decoder_layers(model)
    wrapped = 0
    for i, layer in enumerate(layers):
        if kind == "ffn":
            layer.mlp = _wrap(layer.mlp)
        elif kind == "full" or (kind == "every_k" and i % k == 0):
            layers[i] = _wrap(layer)
        else:
            continue
        wrapped += 1
    return wrapped


def remove_activation_checkpointing(model: torch.nn.Module) -> int:
    """Put every wrapped module back in its parent's place (before export). Returns how many."""
    removed = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, CheckpointWrapper):
                setattr(parent, name, child._checkpoint_wrapped_module)  # ModuleList accepts "3" too
                removed += 1
    return removed
