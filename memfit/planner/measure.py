"""The planner's independent check: bytes per category at the peak of a real CPU step, measured by
torch.profiler (``memfit.telemetry.profiler``) and classified without the planner's own accounting.

Used by tests and benchmarks to hold the planner to its 3%-per-category bar.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from transformers import AutoModelForCausalLM

from memfit.config.schema import OptimizerConfig
from memfit.planner.categories import Breakdown, Category
from memfit.step.loss import ChunkedLoss
from memfit.step.runner import StepRunner
from memfit.strategies.checkpointing import apply_activation_checkpointing
from memfit.strategies.lora import apply_lora
from memfit.strategies.optimizer import build_optimizer
from memfit.strategies.precision import precision_policy
from memfit.telemetry.profiler import all_events, allocation_events, live_blocks

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
    blocks, at_peak = live_blocks(events, saved)
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
    return [(ev.start_time_ns, int(ev.name[len(_SAVED) :])) for ev in all_events(prof) if ev.name.startswith(_SAVED)]


def measured_steady_step(spec, model=None) -> Breakdown:
    """Bytes per category at the peak of the trainer's second (steady-state) step of ``spec`` on real
    CPU tensors, measured by torch.profiler (``profiled_breakdown``). ``model`` (built in the
    precision's dtype) defaults to random weights."""
    strategy = spec.strategy
    precision = precision_policy(strategy.precision)
    if model is None:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(spec.model_config, dtype=precision.param_dtype)
    model.config.use_cache = False
    if spec.lora:
        model = apply_lora(model, spec.lora)
    apply_activation_checkpointing(model, strategy.activation_checkpointing)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = build_optimizer(params, OptimizerConfig(implementation=strategy.optimizer), torch.device("cpu"))
    chunked = ChunkedLoss.attach(model, strategy.loss_chunks)
    runner = StepRunner(model, params, opt, precision, torch.device("cpu"), grad_clip=1.0, chunked=chunked)
    vocab = spec.model_config.vocab_size
    tokens = torch.randint(
        0, vocab, (strategy.micro_batch_size, spec.seq_len + 1), generator=torch.Generator().manual_seed(0)
    )
    batches = [(tokens, tokens)] * strategy.grad_accum_steps
    runner.step(batches)  # step 1 creates the optimizer state
    runner.zero_grad()
    state = [v for st in opt.state.values() for v in st.values()]

    measured = profiled_breakdown(
        lambda: runner.step(batches),
        params=model.parameters(),
        optimizer_state=state,
        other_live=[*model.buffers(), tokens],
        grads=lambda: [p.grad for p in params if p.grad is not None],
    )
    runner.zero_grad()
    return measured
