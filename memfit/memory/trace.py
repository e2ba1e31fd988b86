"""Trace one training step under FakeTensorMode with the trainer's own code, and extrapolate by depth.

The model is built on the ``meta`` device in the precision's parameter dtype, gets the same LoRA
adapters and activation-checkpoint wrappers as in training, and is materialised as FakeTensors on
CPU (``to_empty`` inside the fake mode; ties re-applied). The trainer's ``StepRunner`` then runs one
step (forward, backward, clipping, optimizer step) while ``StepTracker`` counts bytes. Nothing real
is allocated, so a 70B step costs seconds.

Decoder layers are identical, so the planner traces ``a`` and ``b`` layers and extrapolates each
category of each phase's peak linearly to the full depth (``extrapolated_step``).

Known limitations:
    - Kernels are CPU kernels (fake CUDA tensors fail in backward): CUDA-only choices such as the
      flash-attention workspace or cuBLAS workspaces are not seen; SDPA's CPU flash kernel saves the
      same (B, H, T) log-sum-exp as the CUDA one.
    - fp16-mixed is traced without the GradScaler (its found-inf check reads a value); the scaler's
      own bytes are a few scalars.
    - every_k:N with a depth not divisible by N is extrapolated from whole groups of N layers.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import AutoModelForCausalLM, PretrainedConfig

from memfit.config.schema import LoraConfig, OptimizerConfig, parse_ac_policy
from memfit.memory.categories import Breakdown, StepMemory
from memfit.memory.tracker import StepTracker
from memfit.strategies.checkpointing import apply_activation_checkpointing
from memfit.strategies.lora import apply_lora
from memfit.strategies.optimizer import build_optimizer
from memfit.strategies.precision import precision_policy

CPU = torch.device("cpu")


@dataclass(frozen=True)
class StepSpec:
    """Everything that decides the memory of one training step on one device (rank)."""

    model_config: PretrainedConfig
    micro_batch_size: int
    seq_len: int
    precision: str = "fp32"  # a concrete policy, not "auto"
    activation_checkpointing: str = "none"
    optimizer_implementation: str = "foreach"  # a concrete implementation, not "auto"
    lora: LoraConfig | None = None
    grad_accum_steps: int = 1
    round_to: int = 1  # 512 for a CUDA/HIP caching allocator's block rounding


def _build_fake_model(spec: StepSpec, num_layers: int, fake_mode: FakeTensorMode):
    config = copy.deepcopy(spec.model_config)
    config.num_hidden_layers = num_layers
    if hasattr(config, "layer_types") and config.layer_types is not None:
        config.layer_types = config.layer_types[:num_layers]
    config.use_cache = False
    precision = precision_policy(spec.precision)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=precision.param_dtype)
    if spec.lora is not None:
        model = apply_lora(model, spec.lora)
    apply_activation_checkpointing(model, spec.activation_checkpointing)
    with fake_mode:
        model.to_empty(device=CPU)
    if getattr(config, "tie_word_embeddings", False):
        model.get_output_embeddings().weight = model.get_input_embeddings().weight  # to_empty untied them
    return model, precision


def trace_step(spec: StepSpec, num_layers: int | None = None) -> StepMemory:
    """Run one optimizer step of ``spec`` on fake tensors and return its peak breakdown.

    Args:
        num_layers: decoder depth to build (default: the config's own).
    """
    from memfit.train.loop import StepRunner  # the trainer's step; imported here to keep layers acyclic

    depth = num_layers or spec.model_config.num_hidden_layers
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    model, precision = _build_fake_model(spec, depth, fake_mode)
    model.train()
    with fake_mode:
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = build_optimizer(params, OptimizerConfig(implementation=spec.optimizer_implementation), CPU)
        runner = StepRunner(model, params, optimizer, precision, CPU, grad_clip=1.0)
        shape = (spec.micro_batch_size, spec.seq_len + 1)  # (B, T+1)
        batches = [(torch.zeros(shape, dtype=torch.long),) * 2 for _ in range(spec.grad_accum_steps)]
        tracker = StepTracker(model, optimizer, spec.round_to)
        tracker.track([*model.parameters(), *model.buffers(), *(t for b in batches for t in b)])
        with tracker:
            runner.step(batches)
            runner.zero_grad()
    return tracker.result()


def _extrapolate(a: StepMemory, b: StepMemory, la: int, lb: int, depth: int) -> StepMemory:
    k = (depth - la) / (lb - la)
    phases = {p: a.phase_peaks[p].scaled(b.phase_peaks[p], k) for p in a.phase_peaks if p in b.phase_peaks}
    peak_phase = max(phases, key=lambda p: phases[p].total_bytes)
    return StepMemory(peak=phases[peak_phase], phase_peaks=phases, peak_phase=peak_phase)


def extrapolation_depths(spec: StepSpec) -> tuple[int, int]:
    """The two depths traced: (2, 3) layers, or (N, 2N) for every_k:N (whole groups of wrapped layers)."""
    kind, k = parse_ac_policy(spec.activation_checkpointing)
    return (k, 2 * k) if kind == "every_k" and k > 1 else (2, 3)


def extrapolated_step(spec: StepSpec) -> StepMemory:
    """Peak breakdown at full depth from two shallow traces (exact for identical decoder layers)."""
    depth = spec.model_config.num_hidden_layers
    la, lb = extrapolation_depths(spec)
    if depth <= lb:
        return trace_step(spec)
    return _extrapolate(trace_step(spec, la), trace_step(spec, lb), la, lb, depth)


def with_batch(spec: StepSpec, micro_batch_size: int) -> StepSpec:
    return replace(spec, micro_batch_size=micro_batch_size)


__all__ = ["Breakdown", "StepSpec", "extrapolated_step", "trace_step", "with_batch"]
