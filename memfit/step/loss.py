"""The token loss every step, evaluation and trace computes, and the token count it is normalised by."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from memfit.distributed.runtime import DistContext

IGNORE_INDEX = -100
"""Label of a position that takes no loss (prompt tokens, padding)."""


def token_loss_sum(model, tokens: torch.Tensor, labels: torch.Tensor, precision, device) -> torch.Tensor:
    """Summed next-token cross-entropy over supervised positions, from fp32 logits.

    Args:
        tokens: (B, T+1) token ids; the model reads tokens[:, :-1].
        labels: (B, T+1) targets with IGNORE_INDEX where no loss is taken; scored on labels[:, 1:].
    """
    with precision.autocast(device):
        logits = model(input_ids=tokens[:, :-1]).logits  # (B, T, V)
    return F.cross_entropy(
        logits.float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def supervised_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Positions of (B, T+1) ``labels`` that take a loss (a 0-d tensor)."""
    return (labels[:, 1:] != IGNORE_INDEX).sum()


def global_token_count(
    batches: list[tuple[torch.Tensor, torch.Tensor]], ctx: DistContext, device: torch.device
) -> torch.Tensor:
    """Supervised tokens of the whole step over every rank (a tensor, not an int: no host sync, and
    traceable under FakeTensorMode); the loss of each micro-batch is divided by it."""
    n_tokens = sum(supervised_tokens(labels) for _, labels in batches).to(device)
    return ctx.all_reduce_sum(n_tokens).clamp_min(1)
