"""A step-time model for ranking candidates: compute at an assumed utilisation plus communication.

    FLOPs per token, forward = 2 x (weights of every matmul, lm_head included) + 2 x layers x T x hidden
                               (causal attention: QK^T and AV, half the square each)
    training = forward x (3 for a full fine-tune: backward is twice the forward; 2 with LoRA: frozen
               weights need no weight gradients) + the recomputed forward of checkpointed modules
               (and of the output projection when the loss is chunked).
    time     = FLOPs / (peak rate x MFU) + bytes communicated / link bandwidth (no overlap assumed).

The numbers are for ranking candidates against each other; the assumptions are printed with every
plan. Known limitations: the optimizer step, kernel launch overheads and the loss of efficiency at
tiny micro-batches are not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.config.strategy import Strategy

MFU = 0.40  # assumed model-FLOPs utilisation at bf16/fp16
FP32_SLOWDOWN = 4.0  # fp32 matmuls vs the bf16 peak (TF32 on NVIDIA is ~2x, MI200 fp32 matrix ~4x)
INTER_NODE_GBPS = 25.0  # per GPU across nodes (200 Gb/s InfiniBand / RoCE)


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int

    @classmethod
    def of(cls, config) -> "Shape":
        return cls(
            config.num_hidden_layers,
            config.hidden_size,
            config.intermediate_size,
            config.num_attention_heads,
            config.num_key_value_heads or config.num_attention_heads,
            config.vocab_size,
        )

    @property
    def attn_weights(self) -> int:
        head_dim = self.hidden // self.heads
        return self.hidden * self.hidden * 2 + 2 * self.hidden * self.kv_heads * head_dim  # q, o + k, v

    @property
    def mlp_weights(self) -> int:
        return 3 * self.hidden * self.intermediate

    @property
    def matmul_weights(self) -> int:
        return self.layers * (self.attn_weights + self.mlp_weights) + self.vocab * self.hidden


def step_flops(shape: Shape, tokens: int, seq_len: int, lora: bool, strategy: Strategy) -> float:
    """Training FLOPs for ``tokens`` tokens (one optimizer step on one rank): forward, backward and what
    checkpointing and a chunked loss recompute (each chunk's output projection runs again in backward)."""
    ac = strategy.activation_checkpointing
    attn_core = 2 * seq_len * shape.hidden  # per token per layer
    layer_fwd = 2 * (shape.attn_weights + shape.mlp_weights) + attn_core
    mlp_fwd = 2 * shape.mlp_weights
    fwd = shape.layers * layer_fwd + 2 * shape.vocab * shape.hidden
    kind, k = ac.kind, ac.every
    recompute = {
        "none": 0.0,
        "full": shape.layers * layer_fwd,
        "ffn": shape.layers * mlp_fwd,
        "every_k": -(-shape.layers // k) * layer_fwd,
    }[kind]
    if strategy.loss_chunks:
        recompute += 2 * shape.vocab * shape.hidden
    return tokens * (fwd * (2 if lora else 3) + recompute)


def step_time_s(
    flops: float, peak_tflops: float, precision: str, comm_bytes: int, link_GBps: float, nodes: int
) -> float:
    rate = peak_tflops * 1e12 * MFU / (FP32_SLOWDOWN if precision == "fp32" else 1.0)
    bandwidth = (INTER_NODE_GBPS if nodes > 1 else link_GBps) * 1e9
    return flops / rate + comm_bytes / bandwidth


def assumptions(peak_tflops: float, link_GBps: float, nodes: int) -> str:
    bw = INTER_NODE_GBPS if nodes > 1 else link_GBps
    return (
        f"step time assumes {MFU:.0%} of {peak_tflops:g} TFLOP/s bf16 (fp32 {FP32_SLOWDOWN:g}x slower) "
        f"and {bw:g} GB/s per GPU for collectives, without overlap"
    )
