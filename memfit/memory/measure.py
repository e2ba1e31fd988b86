"""Measured peaks on real tensors, independent of memfit's own accounting: torch.profiler's memory
events (every CPU/GPU allocation and release with its size) replayed in time order.

Used by tests and benchmarks to check the planner. Only allocations made inside the profiled region
appear as events, so the tensors alive before it (parameters, buffers, optimizer state, inputs) are
passed in and counted once by storage.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch.profiler import ProfilerActivity, profile

from memfit.config.schema import OptimizerConfig


def live_storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (tied and viewed tensors count once)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def profiled_peak_bytes(fn: Callable[[], object], already_live: Iterable[torch.Tensor], device: str = "CPU") -> int:
    """Peak bytes while ``fn()`` runs: what ``already_live`` holds plus the profiler's running sum
    of allocation events on ``device`` ("CPU" or "CUDA")."""
    base = live_storage_bytes(already_live)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "CUDA" else [])
    with profile(activities=activities, profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type().name == device
    )
    current = peak = 0
    for _, nbytes in events:
        current += nbytes
        peak = max(peak, current)
    return base + peak


def measured_steady_peak(spec, model=None) -> int:
    """Peak bytes of the trainer's second (steady-state) step of ``spec`` on real CPU tensors, measured
    by torch.profiler. ``model`` (built in the precision's dtype) defaults to random weights."""
    from memfit.strategies.checkpointing import apply_activation_checkpointing
    from memfit.strategies.lora import apply_lora
    from memfit.strategies.optimizer import build_optimizer
    from memfit.strategies.precision import precision_policy
    from memfit.train.loop import StepRunner

    precision = precision_policy(spec.precision)
    if model is None:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(spec.model_config, dtype=precision.param_dtype)
    model.config.use_cache = False
    if spec.lora:
        model = apply_lora(model, spec.lora)
    apply_activation_checkpointing(model, spec.activation_checkpointing)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = build_optimizer(params, OptimizerConfig(implementation=spec.optimizer_implementation), torch.device("cpu"))
    runner = StepRunner(model, params, opt, precision, torch.device("cpu"), grad_clip=1.0)
    vocab = spec.model_config.vocab_size
    tokens = torch.randint(0, vocab, (spec.micro_batch_size, spec.seq_len + 1), generator=torch.Generator().manual_seed(0))
    batches = [(tokens, tokens)] * spec.grad_accum_steps
    runner.step(batches)  # step 1 creates the optimizer state
    runner.zero_grad()
    state = [v for st in opt.state.values() for v in st.values()]

    def step():
        runner.step(batches)
        runner.zero_grad()

    return profiled_peak_bytes(step, [*model.parameters(), *model.buffers(), tokens, *state])
