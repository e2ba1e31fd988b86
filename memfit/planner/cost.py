"""A step-time model for ranking candidates: compute at an assumed utilisation plus communication.

    FLOPs per token, forward = 2 x (weights of every matmul, lm_head included) + layers x T x (query width +
                               value width, over all heads: 2 x hidden in a Llama) (causal attention: QK^T and
                               AV, half the square each); in a mixture of experts
                               the MLP weights a token runs through: the router's, its experts' and a shared MLP's
    training = forward x (3 for a full fine-tune: backward is twice the forward; 2 with LoRA: frozen
               weights need no weight gradients) + the recomputed forward of checkpointed modules
               (and of the output projection when the loss is chunked).
    time     = FLOPs / (peak rate x MFU) + bytes communicated / link bandwidth (no overlap assumed)
               + with activations offloaded, what the host copies do not hide: each way, offloaded bytes /
               host bandwidth, less OFFLOAD_OVERLAP of the forward's (to host) or the backward's (back)
               compute time; so offloading costs little where compute per saved byte is high (long
               sequences, large models) and much where it is low.
               + with the optimizer offloaded, the copies of every gradient to the host and of every updated
               weight back (the device's gradient bytes each way at host bandwidth) and the host's step, which
               reads and writes its state once (twice the host state's bytes at HOST_MEMORY_GBPS), without
               overlap with each other or with compute.
               + the device memory traffic of the elementwise work the FLOP count misses, at MEMORY_EFFICIENCY
               of the device's memory bandwidth (``memory_traffic_bytes``): autocast's bf16/fp16 copies of fp32
               trained weights, the gradient sums, and AdamW's pass over weights, gradients and state. This is
               what separates precisions: a full fine-tune's bf16-mixed step moves fp32 weights, gradients and
               state (and casts), bf16-pure's moves half of it (H200, Llama-2-7B, full checkpointing, 4 x 1024
               tokens: measured 0.583 s against 0.490 s, modelled difference 0.064 s).

The numbers are for ranking candidates against each other; the assumptions are printed with every
plan. Known limitations: the optimizer step, kernel launch overheads and the loss of efficiency at
tiny micro-batches are not modelled; nor are the eager low-bit AdamW update's and NF4 dequantization's extra
passes.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.config.strategy import Strategy
from memfit.models.planning import attention, experts

MFU = 0.40  # assumed model-FLOPs utilisation at bf16/fp16
FP32_SLOWDOWN = 4.0  # fp32 matmuls vs the bf16 peak (TF32 on NVIDIA is ~2x, MI200 fp32 matrix ~4x)
INTER_NODE_GBPS = 25.0  # per GPU across nodes (200 Gb/s InfiniBand / RoCE)
OFFLOAD_OVERLAP = 0.5  # share of a phase's compute time that hides its host copies (they share HBM bandwidth)
HOST_MEMORY_GBPS = 20.0  # host memory traffic of the offloaded optimizer's step (a fused CPU AdamW is memory-bound)
MEMORY_EFFICIENCY = 0.7  # share of the device memory bandwidth elementwise kernels (casts, sums, AdamW) reach
MIXED = ("bf16-mixed", "fp16-mixed")  # autocast over fp32 trained weights: a low-precision copy per forward run


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    intermediate: int  # of each expert in a mixture of experts
    attn_weights: int  # a layer's attention projections (``planning.Attention``)
    attn_width: int  # its queries' and values' widths over all heads, summed: what its core's FLOPs grow with
    vocab: int
    experts: int = 1  # a mixture of experts: how many each layer holds, how many run per token, and a shared MLP
    active_experts: int = 1
    shared_intermediate: int = 0
    dense_layers: int = 0  # a mixture of experts' layers of one dense MLP of dense_intermediate instead
    dense_intermediate: int = 0

    @classmethod
    def of(cls, config) -> "Shape":
        moe, attn = experts(config), attention(config)
        return cls(
            config.num_hidden_layers,
            config.hidden_size,
            moe.intermediate or config.intermediate_size,
            attn.weights,
            attn.q_width + attn.v_width,
            config.vocab_size,
            moe.count,
            moe.per_token,
            moe.shared_intermediate,
            moe.dense_layers,
            config.intermediate_size,
        )

    def _per_layer(self, sparse: int, dense: int) -> float:
        """A sparse layer's ``sparse`` and a dense one's ``dense``, averaged over the decoder's layers."""
        return (sparse * (self.layers - self.dense_layers) + dense * self.dense_layers) / self.layers

    def _mlp(self, experts: int) -> float:
        router = self.hidden * self.experts if self.experts > 1 else 0
        sparse = 3 * self.hidden * (experts * self.intermediate + self.shared_intermediate) + router
        return self._per_layer(sparse, 3 * self.hidden * self.dense_intermediate)

    @property
    def mlp_weights(self) -> float:
        """A layer's MLP weights held: every expert's (and the router's) in a mixture of experts; averaged over the
        layers where some are dense (as are all the per-layer sizes here: their sums over the stack are exact)."""
        return self._mlp(self.experts)

    @property
    def active_mlp_weights(self) -> float:
        """A layer's MLP weights each token runs through: in a mixture of experts, ``active_experts`` of them."""
        return self._mlp(self.active_experts)

    @property
    def routed_weights(self) -> float:
        """A layer's routed experts' weights each token runs through (none in a dense model)."""
        return self._per_layer(3 * self.hidden * self.active_experts * self.intermediate, 0) if self.experts > 1 else 0

    @property
    def matmul_weights(self) -> int:
        return round(self.layers * (self.attn_weights + self.mlp_weights)) + self.vocab * self.hidden


@dataclass(frozen=True)
class TrainedWhole:
    """What a LoRA run trains beyond its adapters (``lora.modules_to_save``, ``lora.trainable_tokens``) and how big
    its adapters are, in elements, as the step-time model and ZeRO's gradient sharding read them: in the root group
    (embeddings, final norm, output head), in each decoder layer, and whether the head's weight gets a gradient (a
    matmul in backward: 2 x vocab x hidden FLOPs a token). Modules are known by a Llama's names; a name outside them
    (a fused projection, an expert stack) counts nothing here, though the trace holds its bytes as it does all."""

    root: int = 0
    per_layer: float = 0.0
    head: bool = False
    adapters_per_layer: float = 0.0

    @classmethod
    def of_run(cls, config, lora) -> TrainedWhole:
        """What ``lora`` (a ``LoraConfig``, or None: a full fine-tune, counted here as nothing) trains whole on a model
        of ``config``."""
        return cls() if lora is None else cls.of(Shape.of(config), lora, getattr(config, "tie_word_embeddings", False))

    @classmethod
    def of(cls, shape: Shape, lora, tied: bool) -> TrainedWhole:
        """``lora`` (a ``LoraConfig``) on a model of ``shape`` whose head is ``tied`` to its embeddings or not."""
        table = shape.vocab * shape.hidden
        saved = {n.rsplit(".", 1)[-1] for n in lora.modules_to_save}
        root = {
            "embed_tokens": table,
            "lm_head": 0 if tied and "embed_tokens" in saved else table,
            "norm": shape.hidden,
        }
        sides = cls._sides(shape)
        linear = {n for n, (out, _) in sides.items() if out > 1}
        targets = {n for n in lora.target_modules if n in linear} | (
            linear if "all-linear" in lora.target_modules else set()
        )
        return cls(
            sum(root.get(n, 0) for n in saved) + len(set(lora.trainable_tokens)) * shape.hidden,
            sum(out * inputs for n, (out, inputs) in sides.items() if n in saved),
            # a tied head's trainable rows are read from a merged weight, whose gradient backward computes whole
            "lm_head" in saved or (tied and ("embed_tokens" in saved or bool(lora.trainable_tokens))),
            lora.rank * sum(out + inputs for n, (out, inputs) in sides.items() if n in targets),
        )

    @staticmethod
    def _sides(shape: Shape) -> dict[str, tuple[float, float]]:
        """A Llama decoder layer's Linear modules as (out, in) features by name, and its norms as (1, hidden)."""
        h, q = shape.hidden, shape.attn_width // 2
        kv = (shape.attn_weights / h - 2 * q) / 2  # the key (and value) width over the K/V heads
        mlp = shape.mlp_weights / (3 * h)  # a dense layer's intermediate size
        return {
            "q_proj": (q, h),
            "k_proj": (kv, h),
            "v_proj": (kv, h),
            "o_proj": (h, q),
            "gate_proj": (mlp, h),
            "up_proj": (mlp, h),
            "down_proj": (h, mlp),
            "input_layernorm": (1, h),
            "post_attention_layernorm": (1, h),
        }

    def elements(self, layers: int) -> float:
        """Everything trained whole over ``layers`` decoder layers (adapters not)."""
        return self.root + layers * self.per_layer

    def root_share(self, layers: int) -> float:
        """The root group's share of all trained elements (adapters too) over ``layers`` decoder layers."""
        total = self.root + layers * (self.per_layer + self.adapters_per_layer)
        return self.root / total if total else 0.0


def step_flops(
    shape: Shape,
    tokens: int,
    seq_len: int,
    lora: bool,
    strategy: Strategy,
    lora_experts: bool = False,
    trained: TrainedWhole = TrainedWhole(),
) -> float:
    """Training FLOPs for ``tokens`` tokens (one optimizer step on one rank): forward, backward and what
    checkpointing and a chunked loss recompute (each chunk's output projection runs again in backward).

    ``lora_experts``: LoRA on a mixture of experts' expert weights (``lora.target_parameters``), whose backward
    computes the gradient of each adapted expert stack whole (PEFT folds the adapters into it): the routed experts'
    matmuls cost a full fine-tune's backward. ``trained``: what LoRA trains whole, whose Linear weights (the head's
    among them) take a weight gradient in backward."""
    attn_core = seq_len * shape.attn_width  # per token per layer: 2 x T x width for QK^T and AV, each half causal
    layer_fwd = 2 * (shape.attn_weights + shape.active_mlp_weights) + attn_core
    mlp_fwd = 2 * shape.active_mlp_weights
    fwd = shape.layers * layer_fwd + 2 * shape.vocab * shape.hidden
    whole, mlp_only = recomputed_layers(shape, strategy)
    recompute = whole * layer_fwd + mlp_only * mlp_fwd
    if strategy.loss_chunks:
        recompute += 2 * shape.vocab * shape.hidden
    experts = 2 * shape.layers * shape.routed_weights if lora and lora_experts else 0
    if lora:  # weight gradients of what LoRA trains whole: Linear weights in the layers, and the head
        experts += 2 * (shape.layers * trained.per_layer + (shape.vocab * shape.hidden if trained.head else 0))
    return tokens * (fwd * (2 if lora else 3) + experts + recompute)


def recomputed_layers(shape: Shape, strategy: Strategy) -> tuple[int, int]:
    """How many decoder layers checkpointing runs a second time in backward: whole, and MLP blocks only."""
    ac = strategy.activation_checkpointing
    return {
        "none": (0, 0),
        "full": (shape.layers, 0),
        "ffn": (0, shape.layers),
        "every_k": (-(-shape.layers // ac.every), 0),
    }[ac.kind]


def recomputed_share(shape: Shape, strategy: Strategy) -> float:
    """The share of the decoder's matmul weights that checkpointing runs a second time in backward."""
    whole, mlp_only = recomputed_layers(shape, strategy)
    layer = shape.attn_weights + shape.mlp_weights
    return (whole * layer + mlp_only * shape.mlp_weights) / (shape.layers * layer)


def memory_traffic_bytes(grad_bytes: int, optimizer_bytes: int, strategy: Strategy, recomputed: float) -> int:
    """Device memory bytes one optimizer step reads and writes outside the matmuls, per rank.

    Per micro-batch: under autocast (bf16-/fp16-mixed) each forward run of an fp32 trained weight reads it and
    writes its low-precision copy (1.5 x the gradient bytes, once more for what checkpointing recomputes), and
    backward adds each weight's new gradient into ``.grad`` (reads both, writes one: 3 x the gradient bytes).
    Per step: AdamW reads weights, gradients and state and writes weights and state (3 x the gradient bytes + 2 x
    the state bytes on the device; none where the optimizer runs on the host). Low-bit states are charged as
    32-bit ones: their eager update moves at least as much (its dequantized copies).

    Args:
        grad_bytes: the trained weights' gradient bytes on the device (a weight's gradient has its dtype).
        optimizer_bytes: the optimizer state's bytes on the device.
        recomputed: ``recomputed_share``.
    """
    casts = 1.5 * grad_bytes * (1 + recomputed) if strategy.precision in MIXED else 0.0
    per_micro_batch = casts + 3 * grad_bytes
    if strategy.optimizer_name != "adamw":  # the eager low-bit update dequantizes to fp32 and back: charged as
        optimizer_bytes = 2 * 4 * grad_bytes // (2 if strategy.precision == "bf16-pure" else 4)  # 32-bit moments
    step = 0 if strategy.optimizer_offload else 3 * grad_bytes + 2 * optimizer_bytes
    return int(strategy.grad_accum_steps * per_micro_batch + step)


def memory_traffic_s(traffic_bytes: int, memory_GBps: float) -> float:
    """Seconds of ``traffic_bytes`` at MEMORY_EFFICIENCY of ``memory_GBps``; 0 where the bandwidth is 0 (a CPU
    plan: its fp32-first ranking stands, as bf16 computes no faster without bf16 matrix units)."""
    return traffic_bytes / (memory_GBps * 1e9 * MEMORY_EFFICIENCY) if memory_GBps else 0.0


def step_time_s(
    flops: float,
    peak_tflops: float,
    precision: str,
    comm_bytes: int,
    link_GBps: float,
    nodes: int,
    offload_bytes: int = 0,
    host_GBps: float = 25.0,
    lora: bool = False,
    fp32_slowdown: float = FP32_SLOWDOWN,
) -> float:
    """Modelled seconds of one optimizer step on one rank.

    Args:
        offload_bytes: bytes copied to host memory per step (and back), by activation offloading.
        lora: the forward is half the training compute (a third for a full fine-tune).
    """
    rate = peak_tflops * 1e12 * MFU / (fp32_slowdown if precision == "fp32" else 1.0)
    bandwidth = (INTER_NODE_GBPS if nodes > 1 else link_GBps) * 1e9
    compute_s = flops / rate
    comm_s = comm_bytes / bandwidth if bandwidth else 0.0  # a CPU (link 0): gloo's collectives on one node not charged
    return compute_s + comm_s + offload_time_s(offload_bytes, host_GBps, compute_s, lora)


def offload_time_s(offload_bytes: int, host_GBps: float, compute_s: float, lora: bool) -> float:
    """Copy time that activation offloading adds: each way, what OFFLOAD_OVERLAP of the phase's compute
    time does not hide (to host during the forward, back during the backward)."""
    if not offload_bytes or not host_GBps:  # nothing offloaded, or a CPU: host and device are one memory
        return 0.0
    copy_s = offload_bytes / (host_GBps * 1e9)
    forward_s = compute_s * (0.5 if lora else 1 / 3)
    exposed = max(0.0, copy_s - OFFLOAD_OVERLAP * forward_s)
    return exposed + max(0.0, copy_s - OFFLOAD_OVERLAP * (compute_s - forward_s))


def optimizer_offload_time_s(grad_bytes: int, host_state_bytes: int, host_GBps: float) -> float:
    """Seconds an offloaded optimizer step adds: ``grad_bytes`` to the host and the same back (the weights), at
    ``host_GBps`` each way, and the host's step over ``host_state_bytes`` (read and written once); 0 on a CPU
    (``host_GBps`` 0: host and device are one memory, the step is the plain one)."""
    if not host_GBps:
        return 0.0
    return 2 * grad_bytes / (host_GBps * 1e9) + 2 * host_state_bytes / (HOST_MEMORY_GBPS * 1e9)


def assumptions(
    peak_tflops: float,
    link_GBps: float,
    nodes: int,
    host_GBps: float | None = None,
    activations: bool = True,
    optimizer: bool = False,
    fp32_slowdown: float = FP32_SLOWDOWN,
    memory_GBps: float = 2039.0,
) -> str:
    """The step-time model's assumptions in words (the host's where ``host_GBps`` is given: offloaded
    ``activations`` and/or an ``optimizer`` on the host)."""
    bw = INTER_NODE_GBPS if nodes > 1 else link_GBps
    host = ""
    if host_GBps is not None and activations:
        host += f"; offloaded activations at {host_GBps:g} GB/s each way, {OFFLOAD_OVERLAP:.0%} of compute hiding them"
    if host_GBps is not None and optimizer:
        host += (
            f"; an offloaded optimizer's gradient and weight copies at {host_GBps:g} GB/s and its host step at "
            f"{HOST_MEMORY_GBPS:g} GB/s of host memory traffic, not hidden"
        )
    memory = (
        f"; casts, gradient sums and AdamW at {MEMORY_EFFICIENCY:.0%} of {memory_GBps:g} GB/s" if memory_GBps else ""
    )
    if not link_GBps:  # one CPU process: no collectives
        return f"step time assumes {MFU:.0%} of {peak_tflops:g} TFLOP/s, fp32 as fast as bf16{memory}{host}"
    return (
        f"step time assumes {MFU:.0%} of {peak_tflops:g} TFLOP/s bf16 (fp32 {fp32_slowdown:g}x slower) "
        f"and {bw:g} GB/s per GPU for collectives, without overlap{memory}{host}"
    )
