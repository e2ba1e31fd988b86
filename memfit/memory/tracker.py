"""A dispatch-level tracker of live tensor storage bytes, with categories and phases at each peak.

Every op's output storages are recorded (views share their base's storage and count once) and are
dropped when the storage dies; the total is the bytes a caching allocator would be asked for. Works on
real tensors and on FakeTensors alike, so the planner can "run" a training step without memory.

At each new peak the live storages are classified, first match wins: parameters, gradients
(``p.grad``), optimizer state (``optimizer.state``), activations (saved for backward, seen through
``saved_tensors_hooks``), temporaries (everything else: logits, workspaces, inputs, recomputed tensors).

Phases: ``optimizer`` between the optimizer's step pre- and post-hooks; ``backward`` while the
autograd engine runs (activation-checkpoint recomputation included); ``forward`` otherwise (the loss
and gradient clipping included).

Known limitations:
    - Bytes are storage sizes rounded up to ``round_to`` (1 = exact, as the CPU profiler reports;
      512 = the CUDA/HIP caching allocator's minimum block). Allocator caching and fragmentation are
      not modelled here.
    - Storages resized in place (``UntypedStorage.resize_``, used by FSDP) keep their first size.
    - Tensors created before the tracker starts count only if passed to ``track`` (parameters,
      buffers, inputs, existing optimizer state).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from memfit.memory.categories import PHASES, Breakdown, Category, StepMemory


def _storage(t: torch.Tensor):
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse / nested / wrapper subclasses without storage
        return None


class StepTracker(TorchDispatchMode):
    """Track live storage bytes of everything ``model``/``optimizer`` do inside the context."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, round_to: int = 1):
        super().__init__()
        self.model, self.optimizer, self.round_to = model, optimizer, round_to
        self._live: dict[int, tuple[weakref.ref, int]] = {}
        self._saved: set[int] = set()
        self.total_bytes = 0
        self._in_optimizer = False
        self._peak_total = -1
        self._peak: Breakdown = Breakdown()
        self._peak_phase = "forward"
        self._phase_peak_total = dict.fromkeys(PHASES, -1)
        self._phase_peak: dict[str, Breakdown] = {p: Breakdown() for p in PHASES}
        self._param_ids = {id(s) for p in model.parameters() if (s := _storage(p)) is not None}
        self._hooks: list = []
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    # -- bookkeeping ------------------------------------------------------------------------------

    def _round(self, n: int) -> int:
        r = self.round_to
        return n if r <= 1 else (n + r - 1) // r * r

    def _add(self, t: torch.Tensor) -> None:
        st = _storage(t)
        if st is None or id(st) in self._live:
            return
        key = id(st)
        nbytes = self._round(st.nbytes())

        def gone(_ref, key=key, nbytes=nbytes):
            if self._live.pop(key, None) is not None:
                self.total_bytes -= nbytes
                self._saved.discard(key)

        self._live[key] = (weakref.ref(st, gone), nbytes)
        self.total_bytes += nbytes

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count tensors that exist before the context starts (parameters, buffers, inputs, state)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._add(t)
        self._check_peak()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        st = _storage(t)
        if st is not None:
            self._saved.add(id(st))
        return t

    def _phase(self) -> str:
        if self._in_optimizer:
            return "optimizer"
        return "backward" if torch._C._current_graph_task_id() != -1 else "forward"

    def _classify(self) -> Breakdown:
        grads = {id(s) for p in self.model.parameters() if p.grad is not None and (s := _storage(p.grad)) is not None}
        opt = {
            id(s)
            for state in self.optimizer.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor) and (s := _storage(v)) is not None
        }
        out = dict.fromkeys(Category, 0)
        for key, (_, nbytes) in self._live.items():
            if key in self._param_ids:
                out[Category.PARAMS] += nbytes
            elif key in grads:
                out[Category.GRADS] += nbytes
            elif key in opt:
                out[Category.OPTIMIZER] += nbytes
            elif key in self._saved:
                out[Category.ACTIVATIONS] += nbytes
            else:
                out[Category.TEMPORARIES] += nbytes
        return Breakdown(out)

    def _check_peak(self) -> None:
        phase = self._phase()
        if self.total_bytes > self._phase_peak_total[phase]:
            snap = self._classify()
            assert snap.total_bytes == self.total_bytes, "categories must add up to the live total"
            self._phase_peak_total[phase] = self.total_bytes
            self._phase_peak[phase] = snap
            if self.total_bytes > self._peak_total:
                self._peak_total, self._peak, self._peak_phase = self.total_bytes, snap, phase

    # -- the dispatch mode --------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t)
        self._check_peak()
        return out

    def __enter__(self):
        def pre(*_):
            self._in_optimizer = True

        def post(*_):
            self._in_optimizer = False

        self._hooks = [self.optimizer.register_step_pre_hook(pre), self.optimizer.register_step_post_hook(post)]
        self._saved_hooks.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        self._saved_hooks.__exit__(*exc)
        for h in self._hooks:
            h.remove()
        return out

    def result(self) -> StepMemory:
        phases = {p: b for p, b in self._phase_peak.items() if self._phase_peak_total[p] >= 0}
        return StepMemory(peak=self._peak, phase_peaks=phases, peak_phase=self._peak_phase)
