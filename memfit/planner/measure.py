"""The planner's independent check: bytes per category at the peak of a real CPU step, measured by
torch.profiler (``memfit.telemetry.profiler``) and classified without the planner's own accounting.

Used by tests and benchmarks to hold the planner to its 3%-per-category bar.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from transformers import AutoModelForCausalLM

from memfit.models.planning import transformers_config
from memfit.planner.categories import Breakdown, Category
from memfit.step.runner import StepRunner, sample_batch
from memfit.strategies.checkpointing import apply_activation_checkpointing
from memfit.strategies.host_optimizer import host_tensors, observing_host
from memfit.strategies.lora import apply_lora, quantize_base
from memfit.strategies.offload import Offloaded, observing
from memfit.strategies.precision import precision_policy
from memfit.strategies.tensors import plain_tensors, state_tensors
from memfit.telemetry.profiler import all_events, allocation_events, live_blocks, split_host

_SAVED = "memfit::saved:"  # a profiler marker per tensor autograd saves: "memfit::saved:<storage address>"
_HOST = "memfit::host:"  # a profiler marker per offloaded activation's host copy
_HOST_SIDE = "memfit::host_side"  # a profiler range around the offloaded optimizer's host work


def _mark_saved(t: torch.Tensor) -> torch.Tensor:
    for inner in plain_tensors(t):  # an NF4 weight saved by its matmul: its codes and scalers
        with record_function(f"{_SAVED}{inner.untyped_storage().data_ptr()}"):
            pass
    return t


def _mark_host(t: torch.Tensor) -> None:
    with record_function(f"{_HOST}{t.untyped_storage().data_ptr()}"):
        pass


def _on_pack(t: torch.Tensor, packed) -> None:
    """Under ``ActivationOffload`` (innermost, so ``_mark_saved`` is not called): mark what stays or its host copy."""
    _mark_host(packed.host) if isinstance(packed, Offloaded) else _mark_saved(t)


def profiled_breakdown(
    fn: Callable[[], object],
    *,
    params: Iterable[torch.Tensor],
    optimizer_state: Iterable[torch.Tensor],
    other_live: Iterable[torch.Tensor],
    grads: Callable[[], Iterable[torch.Tensor]],
    host_apart: bool = False,
    host_state: Iterable[torch.Tensor] = (),
) -> Breakdown:
    """Bytes per category at the peak while ``fn()`` runs on CPU, measured with the planner's rules
    but without its code: parameters and optimizer state by the storages passed in; gradients, the
    blocks still live at the end at the addresses of the tensors ``grads()`` returns after ``fn``;
    activations, the blocks autograd saved for backward (a ``saved_tensors_hooks`` marker in the
    profile while the block was live; tensors saved inside checkpointed regions and their
    recomputation go through the checkpoint's own hooks and stay temporaries, as in the planner);
    temporaries, everything else (``other_live`` too unless saved). The total equals
    ``profiled_peak_bytes``.

    Offloaded activations (``strategy.activation_offload``): their host copies (a host marker while the
    block lived) are ``host``, at the peak of everything (host and device are one memory on a CPU); with
    ``host_apart``, the device categories are those at the peak of everything else, and ``host`` is the
    highest the host copies reach by themselves (as on a GPU, whose memory they leave).

    An offloaded optimizer (``optimizer.offload``): ``host_state`` (its masters, gradient copies and state) is
    ``host_state``, and with ``host_apart`` the blocks it allocates in its host work (a profiler range around it)
    are host blocks too; without, they are optimizer state and temporaries of the one memory."""
    base: dict[int, tuple[int, Category | None]] = {}
    held = Category.HOST_STATE if host_apart else Category.OPTIMIZER
    for tensors, category in (
        (params, Category.PARAMS),
        (host_state, held),
        (optimizer_state, Category.OPTIMIZER),
        (other_live, None),
    ):
        for t in (x for t in tensors for x in plain_tensors(t)):
            st = t.untyped_storage()
            base.setdefault(st.data_ptr(), (st.nbytes(), category))
    ranges: list[record_function] = []

    def host_range(on: bool, _pinned: bool) -> None:
        if on:
            ranges.append(record_function(_HOST_SIDE))
            ranges[-1].__enter__()
        else:
            ranges.pop().__exit__(None, None, None)

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with (
            torch.autograd.graph.saved_tensors_hooks(_mark_saved, lambda t: t),
            observing(_on_pack, _ignore),
            observing_host(host_range),
        ):
            fn()
    grad_ptrs = {g.untyped_storage().data_ptr() for g in grads()}
    events = allocation_events(prof, "cpu")
    saved, host = _markers(prof, _SAVED), _markers(prof, _HOST)
    blocks, at_peak = live_blocks(events, saved, host)
    if host_apart:
        spans = [(ev.start_time_ns, ev.end_time_ns) for ev in all_events(prof) if ev.name == _HOST_SIDE]
        for b in blocks:
            at = events[b.start][0]
            b.host = b.host or any(start <= at <= end for start, end in spans)
    host_peak = None
    if host_apart:
        events, host_peak = split_host(events, blocks)
        blocks, at_peak = live_blocks(events, saved)
    saved_base = {ptr for _, ptr in saved}
    out = dict.fromkeys(Category, 0)
    for ptr, (nbytes, category) in base.items():
        out[category or (Category.ACTIVATIONS if ptr in saved_base else Category.TEMPORARIES)] += nbytes
    last_at = {b.ptr: b for b in blocks}  # the last block allocated at each address
    for b in at_peak:
        if b.ptr in grad_ptrs and last_at[b.ptr] is b and b.end is None:
            out[Category.GRADS] += b.nbytes
        elif b.host:
            out[Category.HOST] += b.nbytes
        else:
            out[Category.ACTIVATIONS if b.saved else Category.TEMPORARIES] += b.nbytes
    if host_peak is not None:
        out[Category.HOST] = host_peak
    return Breakdown(out)


def _ignore(*_) -> None:
    pass


def _markers(prof, prefix: str) -> list[tuple[int, int]]:
    """(time ns, storage address) of every marker named ``prefix<address>`` in the profile."""
    return [(ev.start_time_ns, int(ev.name[len(prefix) :])) for ev in all_events(prof) if ev.name.startswith(prefix)]


def measured_steady_step(spec, model=None) -> Breakdown:
    """Bytes per category at the peak of the trainer's second (steady-state) step of ``spec`` on real
    CPU tensors, measured by torch.profiler (``profiled_breakdown``). ``model`` (built in the
    precision's dtype) defaults to random weights. Offloaded activations are measured as a GPU holds them
    (copied back into new buffers, host copies apart) unless ``spec.host_is_device`` (as a CPU run does)."""
    strategy = spec.strategy
    precision = precision_policy(strategy.precision)
    if model is None:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(transformers_config(spec.model_config), dtype=precision.param_dtype)
    model.config.use_cache = False
    if spec.lora:
        model = apply_lora(model, spec.lora, precision)
    quantize_base(model, strategy.quantize_base)
    apply_activation_checkpointing(model, strategy.activation_checkpointing)
    apart = not spec.host_is_device
    runner = StepRunner.for_strategy(model, strategy, torch.device("cpu"), copies_back=apart)
    params, opt = runner.params, runner.optimizer
    vocab = spec.model_config.vocab_size
    tokens = torch.randint(
        0, vocab, (strategy.micro_batch_size, spec.seq_len + 1), generator=torch.Generator().manual_seed(0)
    )
    batches = [sample_batch(tokens, strategy.packing)] * strategy.grad_accum_steps
    runner.step(batches)  # step 1 creates the optimizer state
    runner.zero_grad()
    measured = profiled_breakdown(
        lambda: runner.step(batches),
        params=model.parameters(),
        optimizer_state=state_tensors(opt),
        other_live=[*model.buffers(), *batches[0]],
        grads=lambda: [p.grad for p in params if p.grad is not None],
        host_apart=apart,
        host_state=host_tensors(opt),
    )
    runner.zero_grad()
    return measured
