"""Measured peaks on real tensors, independent of memfit's own accounting: torch.profiler's memory
events (every CPU/GPU allocation and release with its address and size) replayed in time order.

Used by tests and benchmarks to check the planner. Only allocations made inside the profiled region
appear as events, so the tensors alive before it (parameters, buffers, optimizer state, inputs) are
passed in and counted once by storage.

A release made on a thread the profiler does not follow (gloo's collective threads drop the last
reference to some buffers) is missing from the events, and a plain running sum would keep that block
forever: on 2 gloo ranks it over-counted one rank's peak by up to 7%. Events are therefore matched by
address: an allocation at an address that is still live proves the earlier block there was released.
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
    return base + peak_of(allocation_events(prof, device.lower()))


def allocation_events(prof, device_type: str) -> list[tuple[int, int, int]]:
    """(time ns, address, +bytes | -bytes) of every allocation and release on ``device_type``."""
    from torch._C._profiler import _EventType

    out = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        ev = stack.pop()
        stack.extend(ev.children)
        if ev.tag == _EventType.Allocation and ev.extra_fields.device.type == device_type:
            out.append((ev.start_time_ns, ev.extra_fields.ptr, ev.extra_fields.alloc_size))
    out.sort(key=lambda e: e[0])
    return out


def peak_of(events: list[tuple[int, int, int]]) -> int:
    """Highest sum of live blocks; a block counts from its allocation to its release, or to the next
    allocation at its address (whose release the profiler did not see)."""
    live: dict[int, int] = {}
    current = peak = 0
    for _, ptr, nbytes in events:
        if nbytes > 0:
            current += nbytes - live.pop(ptr, 0)
            live[ptr] = nbytes
            peak = max(peak, current)
        elif ptr in live:  # releases of blocks from before the profiled region are not reported
            current -= live.pop(ptr)
    return peak


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
