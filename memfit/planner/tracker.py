"""A dispatch-level tracker of live tensor storage bytes, with categories and phases at each peak.

Every op's output storages are recorded (views share their base's storage and count once) and are
dropped when the storage dies; the total is the bytes a caching allocator would be asked for. Works on
real tensors and on FakeTensors alike, so the planner can "run" a training step without memory.

Each storage gets one category, the first that applies: parameters, gradients (``p.grad`` when the
optimizer step starts), optimizer state (``optimizer.state`` after it), activations (saved for backward,
seen through ``saved_tensors_hooks``), temporaries (everything else: logits, workspaces, inputs,
recomputed tensors). The result is a ``Timeline``: bytes per
category after every op.

Phases: ``forward`` from a model forward (the loss included); ``backward`` while the autograd engine
runs (activation-checkpoint recomputation included, and with ``optimizer.in_backward`` each parameter's
step: its gradient is marked when its step begins, its state when the step ends); ``clip`` after
backward until the optimizer step (gradient clipping, loss scaling); ``optimizer`` between the
optimizer's step pre- and post-hooks. Each phase's peak is kept separately so the planner can
extrapolate them one by one.

With ``strategy.activation_offload`` the offload hooks are innermost, so the tracker observes them instead
of its own: each host copy is ``host`` (not device memory), or an activation where host and device are one
memory (a CPU run, ``host_is_device``).

With ``optimizer.offload`` the offloaded optimizer announces its host work (``host_optimizer.observing_host``): what
it allocates there is ``host`` while it lives and ``host_state`` once it is the optimizer's (its masters, gradient
buffers and state, marked when the step ends), at exact bytes, its pinned blocks rounded up to a power of two when
planning for a GPU (``round_to`` > 1), as PyTorch's pinned allocator rounds them; on a CPU run they are optimizer
state and temporaries of the one memory.

Known limitations:
    - A gradient autograd sums from several contributions during backward (a tied embedding's, or the
      output projection's under a chunked loss, one per chunk) is summed out of place under this mode: the
      partial sums count as temporaries until the last one becomes ``p.grad``, where real tensors sum in
      place into the first contribution's buffer, which a profiler then reports as the gradient. Totals
      agree; the split between gradients and temporaries can differ by that buffer (measured: the tiny
      preset's 12.6 MB embedding gradient under a 4-chunk loss). The per-rank ZeRO-2/3 model relies on the
      gradients appearing layer by layer, so the label stays as traced.
    - Bytes are storage sizes rounded up to ``round_to`` (1 = exact, as the CPU profiler reports;
      512 = the CUDA/HIP caching allocator's minimum block). Allocator caching and fragmentation are
      not modelled here.
    - Storages resized in place (``UntypedStorage.resize_``, used by FSDP) keep their first size.
    - Tensors created before the tracker starts count only if passed to ``track`` (parameters,
      buffers, inputs, existing optimizer state).
    - A mixture of experts' ``_grouped_mm`` holds its output alone, as a device kernel does; the CPU kernel computes
      a bf16 one in an fp32 buffer of the output's size first (a CPU run's bf16 experts: measured 3.2% more
      temporaries than traced at a 2-layer, 4-expert model's backward peak under full checkpointing).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from memfit.planner.categories import HOST_CATEGORIES, Category
from memfit.planner.timeline import CATEGORIES, Timeline
from memfit.strategies.host_optimizer import host_tensors, observing_host
from memfit.strategies.offload import Offloaded, observing
from memfit.strategies.optimizer import running_slice_updates
from memfit.strategies.tensors import plain_tensors, state_tensors

_GROUPED_MM = getattr(getattr(torch.ops.aten, "_grouped_mm", None), "default", None)  # torch 2.8 on


def _grouped_mm_any_dtype(args: tuple, kwargs: dict) -> torch.Tensor:
    """``aten._grouped_mm`` (a mixture-of-experts' experts in transformers) on fake tensors of any dtype: its meta
    kernel states CUDA's bf16-only rule, while the CPU kernel a real step runs takes fp32 too. The output is the one
    of bf16 copies, at its true shape, in the dtype the CPU kernel gives (``out_dtype``, else the inputs')."""
    dtype = kwargs.pop("out_dtype", None) or args[0].dtype
    bf16 = [a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    return _GROUPED_MM(*bf16, **kwargs).to(dtype)


_BINCOUNT = torch.ops.aten.bincount.default


def _bincount_fake(values: torch.Tensor, weights: torch.Tensor | None = None, minlength: int = 0) -> torch.Tensor:
    """``aten.bincount`` on a fake tensor, which refuses it (its length is its largest value's, data a trace does not
    have): a vector of ``minlength`` counts (of the input's length where none is given), as a count of each expert's
    picks is (transformers 5.17's load-balancing loss counts them with ``minlength=num_experts``)."""
    dtype = weights.dtype if weights is not None else torch.int64
    return values.new_zeros(int(minlength) or values.numel(), dtype=dtype)


_ADD, _ADD_ = torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor
_dense = getattr(torch._prims_common, "is_non_overlapping_and_dense_or_false", torch.Tensor.is_contiguous)


def _accumulates_in_place(args: tuple, kwargs: dict) -> bool:
    """Whether ``aten.add(old, new)`` is autograd summing two gradients of one tensor (its input buffer, in backward
    with grad mode off) where a step without a dispatch mode adds ``new`` into ``old`` in place: ``old`` a dense tensor
    that is not a view and that nothing else holds. Under any dispatch mode (a trace's fake tensors, this tracker)
    autograd takes every operand for a tensor subclass and adds out of place, one buffer more: the gradient of tied
    embeddings under a chunked loss (its chunks summed into one, then the embeddings' added) held three copies in a
    trace, two in a real step. What else holds ``old`` is read from the reference counts, against ``new``'s (made by
    the op that just ran, held by the buffer alone: the same counts of dispatch and of this tracker)."""
    if kwargs or len(args) != 2 or torch._C._current_graph_task_id() == -1 or torch.is_grad_enabled():
        return False
    old, new = args
    if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)) or old._is_view():
        return False
    if old.shape != new.shape or old.dtype != new.dtype or old.device != new.device or old.is_nested:
        return False
    if not _dense(old):
        return False
    if not hasattr(old, "_use_count"):  # a torch without the count: summed out of place, as traced before
        return False
    storage_uses = torch._C._storage_Use_Count(old.untyped_storage()._cdata)
    alone = torch._C._storage_Use_Count(new.untyped_storage()._cdata) - (1 if new._is_view() else 0)
    return old._use_count() <= new._use_count() and storage_uses <= alone


def _storage(t: torch.Tensor):
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse / nested / wrapper subclasses without storage
        return None


_DEVICE_QUERY = torch.ops.prim.device.default


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, n - 1).bit_length() if n > 0 else 0


_DEVICE, _EXACT, _PINNED = range(3)  # how a storage's bytes are rounded: round_to, not at all (host), a power of two


# The layer of a saved tensor that several decoder layers saved (RoPE's cos/sin). Tagged with the last
# layer that saved it, its unpack in the first layer's backward flipped the region to "last" and put
# the moments of that region out of step between the two traced depths: on Llama-2-7B (LoRA, ffn,
# bf16-pure, 4 x 1024) the step was over-predicted by 5.5% against the H200's allocator, 0.6% after.
SHARED = object()


REPLAY_SLICE_UPDATES = True
"""Replay the storages of a low-bit update slice of shapes already traced (``_run_update``) instead of tracing it."""

_NOT_REPLAYABLE = object()
_replays: dict[tuple, object] = {}
"""What an update of one slice's shapes allocated and released, op by op, as recorded in this process: per op its
events with serials counted from the update's first, the events after its last op, and how many storages it made
(``_NOT_REPLAYABLE`` where the update touched storages that existed before it or kept one)."""


def _replay_key(args: tuple, *context) -> tuple | None:
    """What an update's allocations depend on: each tensor's type, shape, dtype and strides (its inner tensors' too,
    and a subclass's metadata), the other arguments' values. None on real tensors (a real step is run, not replayed):
    the planner's are fake (a quantized state's code map excepted, made once for real)."""
    parts, fake = list(context), False
    for a in args:
        if not isinstance(a, torch.Tensor):
            parts.append((type(a), a))
            continue
        inner = plain_tensors(a)
        fake = fake or any(isinstance(t, FakeTensor) for t in inner)
        meta = repr(a.__tensor_flatten__()[1]) if is_traceable_wrapper_subclass(a) else None
        parts.append((type(a), tuple(a.shape), a.dtype, meta, tuple((t.shape, t.stride(), t.dtype) for t in inner)))
    return tuple(parts) if fake else None


class StepTracker(TorchDispatchMode):
    """Record live storage bytes of everything ``model``/``optimizer`` do inside the context.

    Every storage gets a serial number when first seen; allocation and release are logged per op.
    Categories are resolved after the step, from what each storage turned out to be.
    """

    def __init__(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, round_to: int = 1, host_is_device: bool = False
    ):
        super().__init__()
        self.model, self.optimizer, self.round_to = model, optimizer, round_to
        # offloaded copies (strategy.activation_offload): host memory, or on a CPU run the same memory
        self._host_category = Category.ACTIVATIONS if host_is_device else Category.HOST
        self._host_is_device = host_is_device
        self._on_host = self._on_pinned = False  # inside the offloaded optimizer's host work (optimizer.offload)
        # planning for a GPU (its allocator's rounding): the pinned host blocks are rounded up as PyTorch's pinned
        # allocator rounds them, to a power of two
        self._pow2_pinned = round_to > 1 and not host_is_device
        self._host_serials: set[int] = set()  # storages made there: host memory unless host_is_device
        self._observer = self._host_observer = self._updates = None
        self._serial_of: dict[int, int] = {}  # id(storage) -> serial, for live storages
        self._events: list[tuple[int, int]] = []  # (serial, +nbytes | -nbytes)
        self._raw: dict[int, tuple[int, int]] = {}  # serial -> (storage bytes before rounding, how rounded: _DEVICE...)
        self._ops: list[tuple[int, str]] = []  # (number of events after the op, phase)
        self._category: dict[int, Category] = {}
        self._refs: dict[int, weakref.ref] = {}  # keeps the release callbacks alive
        self._next = 0
        self._replayed = False  # some storages replayed (``_replay``), their sizes not kept
        self.micro_batch: int | None = None  # of the traced step (set by the tracer)
        self.total_bytes = 0
        self._in_optimizer = False
        self._after_backward = False  # reset by each model forward (gradient accumulation)
        self._layer: int | None = None  # decoder layer running now (forward, recompute or backward)
        # the loss outside the model: ops after its forward returned, and their backward until the gradient of its
        # output exists (FSDP's root group runs its pre-backward then; a chunked loss, inside the model, has none)
        self._in_loss = False
        self._layer_of: dict[int, int | object] = {}  # serial of a saved tensor -> layer that saved it, or SHARED
        self._hooks: list = []
        self._depth = 0  # how many times entered: once, and again inside each tensor subclass's op
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    # -- bookkeeping ------------------------------------------------------------------------------

    def _round(self, n: int) -> int:
        r = self.round_to
        return n if r <= 1 else (n + r - 1) // r * r

    def _rounded(self, nbytes: int, rounding: int) -> int:
        return self._round(nbytes) if rounding == _DEVICE else _pow2_ceil(nbytes) if rounding == _PINNED else nbytes

    def _add(self, t: torch.Tensor) -> int | None:
        if is_traceable_wrapper_subclass(t):  # its storage is a stand-in of its apparent dtype: count its inner ones
            for inner in plain_tensors(t):
                self._add(inner)
            return None
        st = _storage(t)
        if st is None:
            return None
        key = id(st)
        if key in self._serial_of:
            return self._serial_of[key]
        serial, self._next = self._next, self._next + 1
        raw = st.nbytes()
        if not (self._on_host and not self._host_is_device):  # host blocks are not the device allocator's
            rounding = _DEVICE
        else:
            rounding = _PINNED if self._on_pinned and self._pow2_pinned else _EXACT
        self._raw[serial] = raw, rounding
        nbytes = self._rounded(raw, rounding)

        def gone(_ref, key=key, serial=serial, nbytes=nbytes):
            if self._serial_of.get(key) == serial:
                del self._serial_of[key]
                self._events.append((serial, -nbytes))
                self.total_bytes -= nbytes

        self._serial_of[key] = serial
        if self._on_host:
            self._host_serials.add(serial)
        self._refs[serial] = weakref.ref(st, gone)
        self._events.append((serial, nbytes))
        self.total_bytes += nbytes
        return serial

    def _mark(self, tensors: Iterable[torch.Tensor], category: Category) -> None:
        for t in (x for t in tensors for x in plain_tensors(t)):
            serial = self._add(t)
            if serial is not None:
                self._category.setdefault(serial, category)

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count tensors that exist before the context starts (parameters, buffers, inputs, state)."""
        tensors = list(tensors)
        self._mark(self.model.parameters(), Category.PARAMS)
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._add(t)
        self._ops.append((len(self._events), "forward"))

    def mark_grads(self, params: Iterable[torch.Tensor]) -> None:
        """Count the gradients of ``params`` as gradients (a trace without an optimizer step, which would)."""
        self._mark((p.grad for p in params if p.grad is not None), Category.GRADS)

    def backward_done(
        self, grads: Iterable[torch.Tensor], temporaries: Iterable[torch.Tensor], saved: Iterable[torch.Tensor]
    ) -> None:
        """Count what backward leaves (``grads``, ``temporaries``, inputs it ``saved``) before the context starts:
        what follows is clipping (a trace of the update alone)."""
        self._mark(grads, Category.GRADS)
        self._mark(saved, Category.ACTIVATIONS)
        self._mark(temporaries, Category.TEMPORARIES)
        self._after_backward = True
        self._ops.append((len(self._events), "clip"))

    def _pack(self, t: torch.Tensor, category: Category = Category.ACTIVATIONS) -> torch.Tensor:
        serial = self._add(t)
        if serial is not None:
            self._category.setdefault(serial, category)
            # where backward is when it reads the storage: in this layer, or (None) outside the layers, as the
            # embeddings' backward after every layer's; one saved in several places (RoPE's cos/sin, a mask) says
            # nothing of where backward is
            known = self._layer_of.get(serial, self._layer)
            self._layer_of[serial] = self._layer if known == self._layer else SHARED
        return t

    def _on_pack(self, t: torch.Tensor, packed) -> None:
        """Under ``ActivationOffload`` (its hooks shadow this tracker's): the tensor as saved, or its host copy;
        the device tensor it was copied from is no longer held for backward (a temporary until it dies)."""
        self._pack(packed.host, self._host_category) if isinstance(packed, Offloaded) else self._pack(t)

    def _on_unpack(self, packed, t: torch.Tensor) -> None:
        self._unpack(packed.host if isinstance(packed, Offloaded) else packed)

    def _unpack(self, t: torch.Tensor) -> torch.Tensor:
        st = _storage(t)
        serial = self._serial_of.get(id(st)) if st is not None else None
        layer = self._layer_of.get(serial, SHARED)
        if layer is not SHARED:
            self._layer = layer  # backward has reached the layer that saved it
        return t

    def _region(self) -> str:
        """Where in the stack the op runs: first / last / mid decoder layer, outer (embeddings, head, a loss inside
        the model), or the loss outside the model. Peaks are kept per (phase, region): each is linear in depth on its
        own."""
        if self._in_loss:
            return "loss"
        i = self._layer
        if i is None:
            return "outer"
        return "first" if i == 0 else "last" if i == self._num_layers - 1 else "mid"

    def _phase(self) -> str:
        if self._in_optimizer:
            return "optimizer"
        if torch._C._current_graph_task_id() != -1:
            self._after_backward = True
            return f"backward:{self._region()}"
        return "clip" if self._after_backward else f"forward:{self._region()}"

    def _run_update(self, update, args: tuple) -> None:
        """One slice of a low-bit optimizer update (``running_slice_updates``): on fake tensors of shapes this process
        has traced it for, its storages' allocations and releases are replayed op by op, as the ops would record
        them: a 7B model's update runs the same few slice shapes dozens of times, thousands of fake ops each."""
        key = None if self._on_host or not REPLAY_SLICE_UPDATES else _replay_key(args, update, self.round_to)
        recorded = _NOT_REPLAYABLE if key is None else _replays.get(key)
        if recorded is _NOT_REPLAYABLE:
            update(*args)
        elif recorded is not None:
            self._replay(*recorded)
        else:
            first_event, first_op, first_serial = len(self._events), len(self._ops), self._next
            update(*args)
            _replays[key] = self._recorded(first_event, first_op, first_serial)

    def _recorded(self, first_event: int, first_op: int, first_serial: int) -> object:
        """The events since ``first_event`` per op since ``first_op``, serials relative to ``first_serial``; or
        ``_NOT_REPLAYABLE`` where one concerns an older storage, a storage outlives them, or the phase changed."""
        events = self._events[first_event:]
        net: dict[int, int] = {}
        for serial, delta in events:
            net[serial] = net.get(serial, 0) + delta
        ops = self._ops[first_op:]
        if min(net, default=first_serial) < first_serial or any(net.values()) or len({p for _, p in ops}) > 1:
            return _NOT_REPLAYABLE
        per_op, done = [], first_event
        for end, _ in ops:
            per_op.append([(serial - first_serial, delta) for serial, delta in self._events[done:end]])
            done = end
        after = [(serial - first_serial, delta) for serial, delta in self._events[done:]]
        return per_op, after, self._next - first_serial

    def _replay(self, per_op: list, after: list, storages: int) -> None:
        self._replayed = True
        base, self._next = self._next, self._next + storages
        phase = self._phase()
        for events in per_op:
            self._append_events(base, events)
            self._ops.append((len(self._events), phase))
        self._append_events(base, after)

    def _append_events(self, base: int, events: list[tuple[int, int]]) -> None:
        for local, delta in events:
            self._events.append((base + local, delta))
            self.total_bytes += delta

    # -- the dispatch mode --------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE_QUERY:  # a third of all ops; allocates nothing, so it adds no moment
            return args[0].device
        kwargs = kwargs or {}
        sub = next((t for t in tree_flatten((args, kwargs))[0] if is_traceable_wrapper_subclass(t)), None)
        if sub is not None:
            # a tensor subclass (a torchao quantized optimizer state) runs its op as ops on its inner tensors:
            # run its handler with this mode on, so those ops (and their temporaries) are seen one by one
            with self:
                out = type(sub).__torch_dispatch__(func, types, args, kwargs)
        elif func is _GROUPED_MM and isinstance(args[0], FakeTensor) and args[0].dtype != torch.bfloat16:
            out = _grouped_mm_any_dtype(args, kwargs)
        elif func is _BINCOUNT and isinstance(args[0], FakeTensor):
            out = _bincount_fake(*args, **kwargs)
        elif func is _ADD and _accumulates_in_place(args, kwargs):
            out = _ADD_(*args)
        else:
            out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t)
        self._ops.append((len(self._events), self._phase()))
        return out

    def __enter__(self):
        self._depth += 1
        if self._depth > 1:  # entered again to run a tensor subclass's op: its hooks and observers are on
            return super().__enter__()

        def pre(*_):
            self._in_optimizer = True
            self._mark((p.grad for p in self.model.parameters() if p.grad is not None), Category.GRADS)

        def post(*_):
            self._in_optimizer = False
            # optimizer.offload: the host's master weights, gradient copies and state (on a CPU run, the state of
            # the one memory there is, held as long as the optimizer's)
            host = Category.OPTIMIZER if self._host_is_device else Category.HOST_STATE
            self._mark(host_tensors(self.optimizer), host)
            self._mark(state_tensors(self.optimizer), Category.OPTIMIZER)

        def forward_starts(*_):
            self._after_backward = self._in_loss = False
            self._layer = None

        def forward_ends(_module, _args, output):
            self._in_loss = True

            def output_gradient(_grad):
                self._in_loss = False

            for t in tree_flatten(output)[0]:  # transformers registers its ModelOutput with torch's pytree
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(output_gradient)

        self._hooks = [
            self.optimizer.register_step_pre_hook(pre),
            self.optimizer.register_step_post_hook(post),
            self.model.register_forward_pre_hook(forward_starts),
            self.model.register_forward_hook(forward_ends),
        ]
        if hasattr(self.optimizer, "register_param_step_hooks"):  # optimizer.in_backward: steps inside backward

            def param_pre(p):
                self._mark([p.grad], Category.GRADS)

            def param_post(p):
                state = self.optimizer.state.get(p, {})
                self._mark((v for v in state.values() if isinstance(v, torch.Tensor)), Category.OPTIMIZER)

            self._hooks.append(self.optimizer.register_param_step_hooks(param_pre, param_post))

        from memfit.models.load import decoder_layers  # transformers' modeling code: only to trace

        wrappers = decoder_layers(self.model)
        self._num_layers = len(wrappers)
        for i, wrapper in enumerate(wrappers):
            # the layer itself fires in forward and in checkpoint recomputation; a checkpoint wrapper around it
            # in forward only, where it saves the layer's inputs (copies of them, when activations are offloaded)
            layer = getattr(wrapper, "_checkpoint_wrapped_module", wrapper)
            for module in {id(m): m for m in (wrapper, layer)}.values():
                self._hooks.append(module.register_forward_pre_hook(lambda *_, i=i: setattr(self, "_layer", i)))
                self._hooks.append(module.register_forward_hook(lambda *_: setattr(self, "_layer", None)))
        self._saved_hooks.__enter__()
        self._observer = observing(self._on_pack, self._on_unpack)
        self._observer.__enter__()

        def on_host(on: bool, pinned: bool) -> None:
            self._on_host, self._on_pinned = on, on and pinned

        self._host_observer = observing_host(on_host)
        self._host_observer.__enter__()
        self._updates = running_slice_updates(self._run_update)
        self._updates.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        self._depth -= 1
        if self._depth:
            return out
        self._updates.__exit__(*exc)
        self._host_observer.__exit__(*exc)
        self._observer.__exit__(*exc)
        self._saved_hooks.__exit__(*exc)
        for h in self._hooks:
            h.remove()
        return out

    # -- results ------------------------------------------------------------------------------------

    def allocation_events(self) -> list[tuple[int, int]]:
        """Every device storage allocation (+bytes) and release (-bytes) in order, keyed by storage serial
        (host memory: offloaded activations' copies, the offloaded optimizer's storages, is left out)."""
        return [(s, d) for s, d in self._events if self._category_of(s) not in HOST_CATEGORIES]

    def _sized_at(self, traced: int, wanted: int) -> dict[int, int]:
        if self._replayed:
            raise ValueError("a trace with replayed update slices is not resized to another batch")
        return {
            serial: self._rounded(raw // traced * wanted if raw % traced == 0 else raw, rounding)
            for serial, (raw, rounding) in self._raw.items()
        }

    def _category_of(self, serial: int) -> Category:
        """What a storage turned out to be; unmarked, a temporary (of the host, in the offloaded optimizer's work)."""
        if serial in self._category:
            return self._category[serial]
        return Category.HOST if serial in self._host_serials and not self._host_is_device else Category.TEMPORARIES

    def timeline(self, batch: tuple[int, int] | None = None) -> Timeline:
        """Bytes per category after each op; categories as the storages turned out to be.

        Args:
            batch: (traced, wanted): the step as it runs at micro-batch ``wanted``, from this trace of it at micro-batch
                ``traced``, a prime that divides the size of no storage the batch does not make (``trace.batch_prime``):
                a storage whose size ``traced`` divides holds that many rows of the batch and is resized to ``wanted``
                rows before it is rounded; the others are the same at every batch size.
        """
        index = {c: i for i, c in enumerate(CATEGORIES)}
        totals = [0] * len(CATEGORIES)
        rows, phases, done = [], [], 0
        sized = None if batch is None else self._sized_at(*batch)
        for end, phase in self._ops:
            for serial, delta in self._events[done:end]:
                if sized is not None:
                    delta = sized[serial] if delta > 0 else -sized[serial]
                totals[index[self._category_of(serial)]] += delta
            done = end
            rows.append(tuple(totals))
            phases.append(phase)
        return Timeline(phases, rows)
