"""The token loss every step, evaluation and trace computes, and the token count it is normalised by.

The loss is taken from fp32 logits, either whole or chunked (``strategy.loss_chunks``, ``ChunkedLoss``):
the output projection and the fp32 cross-entropy run per chunk of the sequence inside the model's own
forward, and each chunk's logits are recomputed in backward (non-reentrant checkpoint), so the (B, T, V)
logits, their fp32 copy, the log-softmax and the logits' gradient never exist whole. Running inside the
model's forward keeps every engine's hooks in charge of the projection's weights (FSDP2's root group,
DeepSpeed's parameter gathering); tied embeddings stay tied (the projection module is not replaced).

Known limitations:
    - Chunks split the sequence dimension: T not divisible by N gives a shorter last chunk.
    - A chunk's backward keeps its recomputed (B, T/N, V) logits and their gradient alive together: the
      saving is at most a factor N on the loss's temporaries, not on the rest of the step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from memfit.distributed.runtime import DistContext

IGNORE_INDEX = -100
"""Label of a position that takes no loss (prompt tokens, padding)."""


class ChunkedLoss:
    """The summed token loss computed chunk by chunk inside the model's output projection.

    ``attach`` swaps the projection module's ``forward`` for one that, while ``targets`` are set, returns
    the summed fp32 cross-entropy (a 0-d tensor) instead of the logits; with no targets it is the
    projection as before (generation, export).
    """

    def __init__(self, head: torch.nn.Module, chunks: int):
        self.head, self.chunks = head, chunks
        self._project = head.forward  # the projection's own forward (a LoRA wrapper's too)
        self._targets: torch.Tensor | None = None
        head.forward = self._forward  # an instance attribute: nn.Module.__call__ and its hooks call it

    @classmethod
    def attach(cls, model: torch.nn.Module, chunks: int) -> ChunkedLoss | None:
        """Chunk ``model``'s loss into ``chunks`` pieces (None, and the model untouched, for 0)."""
        if not chunks:
            return None
        return cls(model.get_output_embeddings(), chunks)

    @contextlib.contextmanager
    def targets(self, labels: torch.Tensor) -> Iterator[None]:
        """While open, the projection returns the summed loss against ``labels`` (B, T): the target of
        every position the model reads, IGNORE_INDEX where none."""
        self._targets = labels
        try:
            yield
        finally:
            self._targets = None

    def _forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._targets is None:
            return self._project(hidden)
        total = torch.zeros((), device=hidden.device, dtype=torch.float32)
        for h, y in zip(hidden.chunk(self.chunks, dim=1), self._targets.chunk(self.chunks, dim=1)):
            total = total + checkpoint(self._chunk_loss, h, y, use_reentrant=False)  # (B, T/N, C), (B, T/N)
        return total

    def _chunk_loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # through the module's __call__, so engines that hook it (DeepSpeed ZeRO-3 gathers its weight) do so
        # for each chunk, in forward and in the recomputation in backward; targets are hidden meanwhile
        held, self._targets = self._targets, None
        try:
            # a chunk of the sequence is a strided view; as rows, its matmul is one (B*T/N, C) x (C, V) mm in
            # forward and in the recomputation alike. A 3-D input is folded into rows only where its strides allow
            # it (or its weight is trained), and offloading's copies do not keep the layout: at micro-batch 1 a
            # chunk is "contiguous" with a stride no copy keeps, so forward ran a batched matmul (saving an expanded
            # frozen weight) and the recomputation an mm, which checkpointing refused (CheckpointError)
            logits = self.head(hidden.reshape(-1, hidden.shape[-1]))  # (B*T/N, V)
        finally:
            self._targets = held
        return F.cross_entropy(logits.float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def token_loss_sum(
    model,
    tokens: torch.Tensor,
    labels: torch.Tensor,
    precision,
    device,
    chunked: ChunkedLoss | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Summed next-token cross-entropy over supervised positions, from fp32 logits.

    Args:
        tokens: (B, T+1) token ids; the model reads tokens[:, :-1].
        labels: (B, T+1) targets with IGNORE_INDEX where no loss is taken; scored on labels[:, 1:].
        chunked: the model's ``ChunkedLoss`` when ``strategy.loss_chunks`` is on.
        positions: (B, T+1) position ids of packed rows (restarting with each record), else None: given, the
            model isolates the records (transformers' block-causal mask, or varlen flash attention).
    """
    inputs = {"input_ids": tokens[:, :-1]}
    if positions is not None:  # without a cache: transformers skips its packed-rows check where one is used
        inputs.update(position_ids=positions[:, :-1], use_cache=False)
    if chunked is not None:
        with precision.autocast(device), chunked.targets(labels[:, 1:]):
            output = model(**inputs)
        return output.logits + router_loss(model, output, labels)  # the summed loss, chunk by chunk
    with precision.autocast(device):
        output = model(**inputs)
    summed = F.cross_entropy(
        output.logits.float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return summed + router_loss(model, output, labels)


def router_loss(model, output, labels: torch.Tensor) -> torch.Tensor | float:
    """A mixture of experts' load-balancing loss, where its config asks for it (``output_router_logits``), as
    transformers adds it to the mean token loss (``router_aux_loss_coef`` x ``aux_loss``), here weighted by the
    batch's supervised tokens as the summed token loss is (so the step's mean is the mean loss plus it); else 0."""
    aux = getattr(output, "aux_loss", None)
    if aux is None:
        return 0.0
    config = getattr(model, "config", None) or getattr(getattr(model, "module", None), "config", None)  # DeepSpeed's
    return getattr(config, "router_aux_loss_coef", 0.0) * aux.float() * supervised_tokens(labels)


def batch_loss_sum(model, batch: tuple[torch.Tensor, ...], precision, device, chunked=None) -> torch.Tensor:
    """``token_loss_sum`` of one batch: (tokens, labels) or, packed, (tokens, labels, positions), on ``device``."""
    tokens, labels, *positions = (t.to(device, non_blocking=True) for t in batch)
    return token_loss_sum(model, tokens, labels, precision, device, chunked, positions[0] if positions else None)


def supervised_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Positions of (B, T+1) ``labels`` that take a loss (a 0-d tensor)."""
    return (labels[:, 1:] != IGNORE_INDEX).sum()


def global_token_count(batches: list[tuple[torch.Tensor, ...]], ctx: DistContext, device: torch.device) -> torch.Tensor:
    """Supervised tokens of the whole step over every rank (a tensor, not an int: no host sync, and
    traceable under FakeTensorMode); the loss of each micro-batch is divided by it."""
    n_tokens = sum(supervised_tokens(batch[1]) for batch in batches).to(device)
    return ctx.all_reduce_sum(n_tokens).clamp_min(1)
