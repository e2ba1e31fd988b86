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
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from memfit.config.schema import OptimizerConfig
from memfit.memory.categories import Breakdown, Category


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


_SAVED = "memfit::saved:"  # a profiler marker per tensor autograd saves: "memfit::saved:<storage address>"


def _mark_saved(t: torch.Tensor) -> torch.Tensor:
    with record_function(f"{_SAVED}{t.untyped_storage().data_ptr()}"):
        pass
    return t


def profiled_breakdown(
    fn: Callable[[], object],
    *,
    params: Iterable[torch.Tensor],
    optimizer_state: Iterable[torch.Tensor],
    other_live: Iterable[torch.Tensor],
    grads: Callable[[], Iterable[torch.Tensor]],
) -> Breakdown:
    """Bytes per category at the peak while ``fn()`` runs on CPU, measured with the planner's rules
    but without its code: parameters and optimizer state by the storages passed in; gradients, the
    blocks still live at the end at the addresses of the tensors ``grads()`` returns after ``fn``;
    activations, the blocks autograd saved for backward (a ``saved_tensors_hooks`` marker in the
    profile while the block was live; tensors saved inside checkpointed regions and their
    recomputation go through the checkpoint's own hooks and stay temporaries, as in the planner);
    temporaries, everything else (``other_live`` too unless saved). The total equals
    ``profiled_peak_bytes``."""
    base: dict[int, tuple[int, Category | None]] = {}
    for tensors, category in ((params, Category.PARAMS), (optimizer_state, Category.OPTIMIZER), (other_live, None)):
        for t in tensors:
            st = t.untyped_storage()
            base.setdefault(st.data_ptr(), (st.nbytes(), category))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with torch.autograd.graph.saved_tensors_hooks(_mark_saved, lambda t: t):
            fn()
    grad_ptrs = {g.untyped_storage().data_ptr() for g in grads()}
    events = allocation_events(prof, "cpu")
    saved = _saved_markers(prof)
    blocks, at_peak = _blocks(events, saved)
    saved_base = {ptr for _, ptr in saved}
    out = dict.fromkeys(Category, 0)
    for ptr, (nbytes, category) in base.items():
        out[category or (Category.ACTIVATIONS if ptr in saved_base else Category.TEMPORARIES)] += nbytes
    last_at = {b.ptr: b for b in blocks}  # the last block allocated at each address
    for b in at_peak:
        if b.ptr in grad_ptrs and last_at[b.ptr] is b and b.end is None:
            out[Category.GRADS] += b.nbytes
        else:
            out[Category.ACTIVATIONS if b.saved else Category.TEMPORARIES] += b.nbytes
    return Breakdown(out)


def _saved_markers(prof) -> list[tuple[int, int]]:
    """(time ns, storage address) of every ``_mark_saved`` marker in the profile."""
    return [(ev.start_time_ns, int(ev.name[len(_SAVED):])) for ev in _all_events(prof) if ev.name.startswith(_SAVED)]


def _all_events(prof):
    """Every event of the profile's event tree (ops, markers, allocations), depth first."""
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        ev = stack.pop()
        stack.extend(ev.children)
        yield ev


def allocation_events(prof, device_type: str) -> list[tuple[int, int, int]]:
    """(time ns, address, +bytes | -bytes) of every allocation and release on ``device_type``."""
    from torch._C._profiler import _EventType

    out = [(ev.start_time_ns, ev.extra_fields.ptr, ev.extra_fields.alloc_size) for ev in _all_events(prof)
           if ev.tag == _EventType.Allocation and ev.extra_fields.device.type == device_type]
    out.sort(key=lambda e: e[0])
    return out


@dataclass
class _Block:
    ptr: int
    nbytes: int
    start: int  # index of its allocation event
    end: int | None = None  # index of the event that ended it (release, or reuse of its address)
    saved: bool = False  # autograd saved it for backward while it was live


def _blocks(events: list[tuple[int, int, int]], saved: Iterable[tuple[int, int]] = ()) -> tuple[list[_Block], list[_Block]]:
    """Replay ``events`` (and saved-tensor markers) in time order: every block allocated, in order,
    and the blocks live at the (first) peak. A block counts from its allocation to its release, or
    to the next allocation at its address (whose release the profiler did not see)."""
    marks = sorted(saved)
    live: dict[int, _Block] = {}
    blocks: list[_Block] = []
    current = peak = 0
    peak_at = -1
    m = 0
    for i, (time_ns, ptr, nbytes) in enumerate(events):
        while m < len(marks) and marks[m][0] <= time_ns:
            if marks[m][1] in live:
                live[marks[m][1]].saved = True
            m += 1
        if nbytes > 0:
            old = live.pop(ptr, None)
            if old is not None:
                old.end, current = i, current - old.nbytes
            live[ptr] = block = _Block(ptr, nbytes, i)
            blocks.append(block)
            current += nbytes
            if current > peak:
                peak, peak_at = current, i
        elif ptr in live:  # releases of blocks from before the profiled region are not reported
            old = live.pop(ptr)
            old.end, current = i, current - old.nbytes
    for _, ptr in marks[m:]:
        if ptr in live:
            live[ptr].saved = True
    at_peak = [b for b in blocks if b.start <= peak_at and (b.end is None or b.end > peak_at)]
    return blocks, at_peak


def peak_of(events: list[tuple[int, int, int]]) -> int:
    """Highest sum of live blocks (see ``_blocks``)."""
    return sum(b.nbytes for b in _blocks(events)[1])


def measured_steady_step(spec, model=None) -> Breakdown:
    """Bytes per category at the peak of the trainer's second (steady-state) step of ``spec`` on real
    CPU tensors, measured by torch.profiler (``profiled_breakdown``). ``model`` (built in the
    precision's dtype) defaults to random weights."""
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

    measured = profiled_breakdown(lambda: runner.step(batches), params=model.parameters(), optimizer_state=state,
                                  other_live=[*model.buffers(), tokens], grads=lambda: [p.grad for p in params if p.grad is not None])
    runner.zero_grad()
    return measured
