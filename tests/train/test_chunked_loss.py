"""Chunked cross-entropy (strategy.loss_chunks) against the whole-logits loss: same loss and gradients."""

import pytest
import torch

from memfit.config.schema import LoraConfig, ModelConfig
from memfit.config.strategy import CheckpointPolicy
from memfit.models.load import ModelSource, build_model
from memfit.step.loss import IGNORE_INDEX, ChunkedLoss, token_loss_sum
from memfit.strategies.checkpointing import apply_activation_checkpointing
from memfit.strategies.lora import apply_lora
from memfit.strategies.precision import resolve_precision
from memfit.train.checkpoint import clean_name

CPU = torch.device("cpu")


def _model(lora: bool, ac: str):
    model = build_model(ModelSource("preset", preset="tiny"), ModelConfig(), torch.float32, seed=0)
    if lora:
        model = apply_lora(model, LoraConfig(enabled=True, rank=4), resolve_precision("fp32", CPU))
        with torch.no_grad():  # non-zero B so adapters contribute
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(n)))
    apply_activation_checkpointing(model, CheckpointPolicy.parse(ac))
    return model


def _loss_and_grads(model, tokens, labels, precision, chunked):
    loss = token_loss_sum(model, tokens, labels, precision, CPU, chunked)
    loss.backward()
    return loss.detach(), {clean_name(n): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("chunks", [2, 5])
@pytest.mark.parametrize(
    "lora, ac", [(False, "none"), (True, "ffn"), (False, "full")], ids=["full-ft", "lora-ffn", "ac-full"]
)
def test_chunked_loss_equals_the_whole_logits_loss_in_fp32(lora, ac, chunks):
    """Tied embeddings (the tiny preset ties them as SmolLM2 does), LoRA and checkpointing; T=33 is not
    divisible by 2 or 5, so the last chunk is shorter; a third of the labels are ignored. The loss agrees to
    1e-6; gradients to 2e-6 per tensor (worst seen 1.01e-6: the chunks' smaller matmuls sum in another order)."""
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 49152, (2, 34), generator=gen)
    labels = tokens.clone()
    labels[:, :12] = IGNORE_INDEX
    fp32 = resolve_precision("fp32", CPU)
    ref_loss, ref_grads = _loss_and_grads(_model(lora, ac), tokens, labels, fp32, None)
    model = _model(lora, ac)
    chunked = ChunkedLoss.attach(model, chunks)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # still tied
    loss, grads = _loss_and_grads(model, tokens, labels, fp32, chunked)
    assert torch.allclose(loss, ref_loss, rtol=1e-6, atol=0)
    assert grads.keys() == ref_grads.keys() and grads
    for name, g in grads.items():
        rel = (g - ref_grads[name]).norm() / ref_grads[name].norm().clamp_min(1e-30)
        assert rel <= 2e-6, f"{name}: relative gradient difference {rel:.2e}"


def test_chunked_loss_under_bf16_autocast_stays_close_and_projection_works_without_targets():
    tokens = torch.randint(0, 49152, (2, 17), generator=torch.Generator().manual_seed(4))
    bf16 = resolve_precision("bf16-mixed", CPU)
    ref = token_loss_sum(_model(False, "none"), tokens, tokens, bf16, CPU)
    model = _model(False, "none")
    chunked = ChunkedLoss.attach(model, 4)
    assert torch.allclose(token_loss_sum(model, tokens, tokens, bf16, CPU, chunked), ref, rtol=1e-3)
    assert model(input_ids=tokens[:, :-1]).logits.shape == (2, 16, model.config.vocab_size)  # plain outside a loss
    assert ChunkedLoss.attach(model, 0) is None
