"""Trace one training step under FakeTensorMode with the trainer's own code, and extrapolate by depth.

The model is built on the ``meta`` device in the precision's parameter dtype, gets the same LoRA
adapters and activation-checkpoint wrappers as in training, and is materialised as FakeTensors on
CPU (``to_empty`` inside the fake mode; ties re-applied). The trainer's ``StepRunner`` then runs one
step (forward, backward, clipping, optimizer step) while ``StepTracker`` counts bytes; the optimizer
state that step creates is then added to the forward and backward phases, as in every later step
(``Timeline.steady``). Nothing real is allocated, so a 70B step costs seconds.

Decoder layers are identical, so the planner traces ``a`` and ``b`` layers and extrapolates each
category of each phase's peak linearly to the full depth (``extrapolated_step``). A mixture of experts' first
layers may differ from the rest (dense ones): both traces hold them (``spec.extrapolation_depths``); layers of two
kinds in turn are traced at full depth.

Known limitations:
    - Kernels are CPU kernels (fake CUDA tensors fail in backward): CUDA-only choices such as the
      flash-attention workspace or cuBLAS workspaces are not seen; SDPA's CPU flash kernel saves the
      same (B, H, T) log-sum-exp as the CUDA one.
    - fp16-mixed is traced without the GradScaler (its found-inf check reads a value); the scaler's
      own bytes are a few scalars.
    - every_k:N with a depth not divisible by N is extrapolated from whole groups of N layers.
    - The attention mask: see ``_masks_as_on_real_tensors``. Packed rows (``strategy.packing``) are traced with
      the (B, 1, T, T) block-causal mask transformers builds for them, and grouped K/V heads repeated to every
      head, as SDPA and eager run them. Otherwise
      grouped K/V heads are traced as SDPA's CPU
      flash kernel takes them (unexpanded); a device kernel that expands them for ``enable_gqa`` (the
      math fallback repeats K/V to every head) needs more than predicted. Not measured on a GPU yet.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from transformers import AutoModelForCausalLM

from memfit.models.planning import config_asks_loop, transformers_config
from memfit.planner.categories import StepMemory
from memfit.planner.spec import StepSpec, extrapolate_regions, extrapolation_depths
from memfit.planner.timeline import Timeline, collapse_regions
from memfit.planner.tracker import StepTracker
from memfit.step.runner import StepRunner, sample_batch
from memfit.strategies.checkpointing import apply_activation_checkpointing
from memfit.strategies.lora import apply_lora, quantize_base
from memfit.strategies.precision import precision_policy
from memfit.strategies.tensors import plain_tensors

CPU = torch.device("cpu")


def _build_fake_model(spec: StepSpec, num_layers: int, fake_mode: FakeTensorMode):
    config = transformers_config(spec.model_config)
    config.num_hidden_layers = num_layers
    if hasattr(config, "layer_types") and config.layer_types is not None:
        config.layer_types = config.layer_types[:num_layers]
    config.use_cache = False
    if config_asks_loop(config):  # a loop whose shapes the routing sets: traced as the default (EXPERTS_LOOP_NOTE)
        config._experts_implementation = "grouped_mm"
    precision = precision_policy(spec.strategy.precision)
    with torch.device("meta"):  # the adapters too: PEFT would allocate and initialise them for real
        model = AutoModelForCausalLM.from_config(config, dtype=precision.param_dtype)
        if spec.lora is not None:
            with warnings.catch_warnings():  # each trace worker would repeat PEFT's advice on an adapted tied head
                warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*", category=UserWarning)
                model = apply_lora(model, spec.lora, precision)
    _materialize(model, fake_mode)
    with fake_mode:
        quantize_base(model, spec.strategy.quantize_base)  # from (fake) values, as a real run does
    apply_activation_checkpointing(model, spec.strategy.activation_checkpointing)
    return model


def _materialize(model: torch.nn.Module, fake_mode: FakeTensorMode) -> None:
    """``to_empty`` on fake CPU tensors, each module once, and every parameter held in several places (tied
    embeddings; PEFT's trained copy of a tied embedding, which is also the head's) held there again: ``to_empty``
    makes a tensor per place, and fails on a module held twice (PEFT's trainable token rows of a tied head)."""
    places: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                places.setdefault(id(p), []).append((module, name))
    with fake_mode:
        for module in model.modules():  # each once
            module.to_empty(device=CPU, recurse=False)
    for (first, name), *others in places.values():
        for module, other in others:
            module._parameters[other] = first._parameters[name]


def trace_step(spec: StepSpec, num_layers: int | None = None) -> StepMemory:
    """Run one optimizer step of ``spec`` on fake tensors and return its steady-state peak breakdown.

    Args:
        num_layers: decoder depth to build (default: the config's own).
    """
    return steady_timeline(spec, num_layers).step_memory()


def trace_timeline(spec: StepSpec, num_layers: int | None = None) -> Timeline:
    """Bytes per category after every op of one (first) optimizer step of ``spec``, on fake tensors."""
    return _traced(spec, num_layers).timeline()


def steady_timeline(spec: StepSpec, num_layers: int | None = None) -> Timeline:
    """``trace_timeline`` made steady: every moment with the optimizer state whole, as in every later step."""
    return trace_timeline(spec, num_layers).steady()


def steady_timelines(specs: list[StepSpec], num_layers: int) -> list[Timeline]:
    """``steady_timeline`` of each of ``specs``; specs that differ in their micro-batch only (forward and backward
    without offloading: ``StepSpec.part`` "passes") from one trace, at ``batch_prime``'s micro-batch, resized to each.

    Resizing is exact where every storage is either made of whole rows of the batch or of none: measured equal, op by
    op and category by category, to a trace per micro-batch for every preset, checkpointing policy, precision, loss
    chunking and LoRA or not (``test_one_trace_resized_to_each_batch_equals_a_trace_of_each``).
    """
    if len(specs) == 1:
        return [steady_timeline(specs[0], num_layers)]
    first = specs[0]
    if any(s.with_strategy(micro_batch_size=first.strategy.micro_batch_size) != first for s in specs):
        raise ValueError("one trace stands only for specs that differ in their micro-batch only")
    if first.part != "passes" or first.strategy.activation_offload:
        raise ValueError("only forward and backward without offloading are resized to another micro-batch")
    tracker = _traced(first, num_layers, prime_batch=True)
    if tracker is None:  # no prime would do (not seen): each traced
        return [steady_timeline(s, num_layers) for s in specs]
    return [tracker.timeline((tracker.micro_batch, s.strategy.micro_batch_size)).steady() for s in specs]


BATCH_PRIMES = (101, 103, 107, 109, 113, 127, 131, 137, 139, 149, 151, 157, 163, 167, 173, 179, 181, 191, 193, 197)


def batch_prime(model: torch.nn.Module, spec: StepSpec) -> int | None:
    """The micro-batch ``steady_timelines`` traces at: a prime that divides none of the sizes the batch does not make
    (the parameters and buffers, and what the sequence length makes: position ids, RoPE's tables, a chunked loss's
    chunks), so that a storage whose size it divides holds that many rows of the batch. None where each of
    ``BATCH_PRIMES`` divides one of them (not seen; each batch is then traced)."""
    T, n = spec.seq_len, spec.strategy.loss_chunks
    held = (x for t in (*model.parameters(), *model.buffers()) for x in plain_tensors(t))  # an NF4 base's codes, scales
    sizes = {t.untyped_storage().nbytes() for t in held} | {T, T + 1}
    if n:
        chunk = -(-T // n)
        sizes |= {chunk, T - chunk * (-(-T // chunk) - 1)}
    return next((p for p in BATCH_PRIMES if all(size % p for size in sizes if size)), None)


def trace_allocations(spec: StepSpec, num_layers: int | None = None, steps: int = 1) -> list[tuple[int, int]]:
    """The storage allocations and releases of the first ``steps`` optimizer steps, in order: input for
    the allocator model. From step 2 on the optimizer state exists before the step and the cache holds
    what step 1 left, as in every later step (steps 3 and more replay exactly as step 2)."""
    return _traced(spec, num_layers, steps).allocation_events()


def _traced(spec: StepSpec, num_layers: int | None, steps: int = 1, prime_batch: bool = False) -> StepTracker | None:
    """Run ``steps`` steps of ``spec`` under a tracker. ``spec.part`` narrows what runs, for the predictor, which
    reads forward and backward from one trace and clipping and the optimizer step from another: "passes" runs
    forward and backward only (``StepRunner.accumulate``); "update" runs clipping and the optimizer step only
    (``StepRunner.update``), on zero gradients of the trainable parameters' shapes made before it, as backward
    leaves them. An offloaded optimizer moves each gradient to the host from a hook in backward, so its update is
    traced after a real backward. ``prime_batch``: at ``batch_prime``'s micro-batch instead of the spec's (the tracker's
    ``micro_batch`` says which), None where there is none."""
    if steps > 1 and spec.part != "step":
        raise ValueError("only a whole step is traced over several steps")
    depth = num_layers or spec.model_config.num_hidden_layers
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = _build_fake_model(spec, depth, fake_mode)
    if prime_batch:
        prime = batch_prime(model, spec)
        if prime is None:
            return None
        spec = spec.with_strategy(micro_batch_size=prime)
    model.train()
    in_backward = spec.strategy.optimizer_in_backward  # no update of its own: the whole step is traced
    update_alone = spec.part == "update" and not spec.strategy.optimizer_offload and not in_backward
    with fake_mode:
        runner = StepRunner.for_strategy(model, spec.strategy, CPU, copies_back=not spec.host_is_device)
        optimizer = runner.optimizer
        shape = (spec.strategy.micro_batch_size, spec.seq_len + 1)  # (B, T+1)
        batches = [
            sample_batch(torch.zeros(shape, dtype=torch.long), spec.strategy.packing)
            for _ in range(spec.strategy.grad_accum_steps)
        ]
        if update_alone:
            for p in runner.params:
                p.grad = torch.zeros_like(p)
        tracker = StepTracker(model, optimizer, spec.round_to, spec.host_is_device)
        tracker.micro_batch = spec.strategy.micro_batch_size
        tracker.track([*model.parameters(), *model.buffers(), *(t for b in batches for t in b)])
        if update_alone:
            # what backward leaves: the gradients, the step's loss (held by ``step``), and the token ids, which a
            # trainable embedding saved for its backward (activations, as a traced backward counts them)
            loss_sum = torch.zeros((), device=CPU)
            saved = [b[0] for b in batches] if model.get_input_embeddings().weight.requires_grad else []
            tracker.backward_done([p.grad for p in runner.params], [loss_sum], saved)
        packed = spec.strategy.packing  # real packed rows take the block-causal mask path, as fake ones do
        with tracker, contextlib.nullcontext() if packed else _masks_as_on_real_tensors():
            for _ in range(steps):
                if spec.part == "step" or in_backward:
                    runner.step(batches)
                elif spec.part == "passes":
                    runner.accumulate(batches)
                    tracker.mark_grads(runner.params)  # as the optimizer's step would
                else:
                    if not update_alone:
                        loss_sum = runner.accumulate(batches)  # held through the update, as ``step`` holds it
                    runner.update()
                runner.zero_grad()
    return tracker


@contextlib.contextmanager
def _masks_as_on_real_tensors():
    """Let transformers take the attention path it takes on real tensors.

    The trainer passes neither an attention mask nor position ids, so the model's own position ids
    are one ``arange`` per row and ``masking_utils.find_packed_sequence_indices`` returns None on
    real tensors: SDPA then runs with ``is_causal`` and no mask, and grouped-query models pass their
    key/value heads unexpanded (``enable_gqa``). On FakeTensors it cannot read the values and answers
    "packed", and the model builds a (B, 1, T, T) mask and repeats K/V to every head: the tiny
    preset's step was over-predicted by 0.75 MiB (0.2%), a Llama-3-8B LoRA step (8 K/V heads for 32,
    B=4, T=1024, ffn, bf16-mixed) by 1.75 GiB (3.4%). Here it answers for fake position ids as for
    real ones.
    """
    import transformers.masking_utils as masking

    original = getattr(masking, "find_packed_sequence_indices", None)
    if original is None:  # another transformers layout: nothing to patch
        yield
        return

    def find_packed_sequence_indices(position_ids):
        return None if isinstance(position_ids, FakeTensor) else original(position_ids)

    masking.find_packed_sequence_indices = find_packed_sequence_indices
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original


def extrapolated_step(spec: StepSpec) -> StepMemory:
    """Peak breakdown at full depth from two shallow traces (exact for identical decoder layers)."""
    depth = spec.model_config.num_hidden_layers
    la, lb = extrapolation_depths(spec)
    if depth <= lb:
        return trace_step(spec)
    ra, rb = (steady_timeline(spec, n).region_peaks() for n in (la, lb))
    return collapse_regions(extrapolate_regions(ra, rb, la, lb, depth, spec.strategy.activation_offload))
