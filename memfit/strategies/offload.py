"""Activation offloading (``strategy.activation_offload``): what autograd saves for backward waits in host memory.

``ActivationOffload`` is a ``torch.autograd.graph.saved_tensors_hooks`` context around the forward. Each saved
tensor of at least ``MIN_OFFLOAD_BYTES`` that is not a parameter (or a view of one) is copied to host memory
when autograd saves it, so the device copy is freed as soon as the forward is done with it; in backward it is
copied back when autograd unpacks it. With activation checkpointing only the checkpoint boundaries move: a
checkpointed region saves through the checkpoint's own (inner) hooks, and its inputs through these.

On CUDA/ROCm the host buffers are pinned and the copies run on a side stream: device-to-host copies overlap
the forward (the caching allocator keeps each source block until its copy is done, ``record_stream``), and
when backward unpacks entry k the copies back of the ``PREFETCH`` entries saved before it start, so they
overlap the backward of what follows (torchtune's ``OffloadActivations`` is the reference design). On a
CPU device the hooks still copy (into host memory, which is the same memory), so runs, losses and the
planner's accounting take the same path; there the copy back is the host copy itself (``copies_back``).

A tensor saved twice in one forward (an RMSNorm input, saved by its ``pow`` and its ``mul``) is copied once.

Observers (``observing``) see every pack and unpack: the planner's tracker and the profiler measurement use
them to tell host copies from device tensors, since these hooks are innermost and theirs are not called.

Known limitations:
    - The copies back wait for the side stream at first use; a backward that unpacks out of pack order
      (a tensor saved early and used late) waits for a copy that was not prefetched.
    - The entries of one forward are prefetched by pack order, across micro-batches only within each one.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator

import torch

from memfit.config.strategy import OFFLOAD_PREFETCH as PREFETCH

MIN_OFFLOAD_BYTES = 256 << 10
"""Smaller saved tensors stay on the device: their copies cost more in latency than they free."""

_observers: list[tuple[Callable, Callable]] = []


@contextlib.contextmanager
def observing(on_pack: Callable, on_unpack: Callable) -> Iterator[None]:
    """While open, ``on_pack(tensor, packed)`` runs on every save (``packed`` is the tensor itself when it
    stays, else its ``Offloaded`` entry) and ``on_unpack(packed, tensor)`` on every unpack."""
    pair = (on_pack, on_unpack)
    _observers.append(pair)
    try:
        yield
    finally:
        _observers.remove(pair)


class Offloaded:
    """One saved tensor's host copy; ``device_copy`` once it is back (or on its way) on the device."""

    def __init__(self, host: torch.Tensor, index: int, event=None):
        self.host, self.index, self.copied = host, index, event  # event: the copy to host is done
        self.device_copy: torch.Tensor | None = None
        self.ready = None  # event: the copy back is done (side stream)


class ActivationOffload(torch.autograd.graph.saved_tensors_hooks):
    """Offload saved tensors of the forward run inside this context (enter it once per forward).

    Args:
        device: the device the model runs on.
        copies_back: copy each tensor back to a new device buffer in backward (default: on any device but
            the CPU, where the host copy is already where it is needed). The planner sets it to trace what a
            GPU does on CPU tensors.
    """

    def __init__(self, device: torch.device, copies_back: bool | None = None, min_bytes: int = MIN_OFFLOAD_BYTES):
        self.device, self.min_bytes = device, min_bytes
        self.copies_back = device.type != "cpu" if copies_back is None else copies_back
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._entries: list[weakref.ref] = []  # this forward's entries in pack order
        self._by_tensor: dict[int, tuple[weakref.ref, weakref.ref]] = {}  # id(tensor) -> (tensor, entry)
        super().__init__(self._pack, self._unpack)

    def __enter__(self):
        self._entries, self._by_tensor = [], {}
        return super().__enter__()

    def _stays(self, t: torch.Tensor) -> bool:
        """Parameters and views of them (a matmul saves ``weight.t()``) stay, and so do small tensors."""
        param = isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)
        return param or t.numel() * t.element_size() < self.min_bytes

    def _pack(self, t: torch.Tensor):
        if self._stays(t):
            packed = t
        else:
            packed = self._known(t) or self._offload(t)
        for on_pack, _ in list(_observers):
            on_pack(t, packed)
        return packed

    def _known(self, t: torch.Tensor) -> Offloaded | None:
        seen = self._by_tensor.get(id(t))
        if seen is not None and seen[0]() is t:
            return seen[1]()
        return None

    def _offload(self, t: torch.Tensor) -> Offloaded:
        if self._stream is not None:
            host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=True)
            self._stream.wait_stream(torch.cuda.current_stream(self.device))  # t is computed
            with torch.cuda.stream(self._stream):
                host.copy_(t, non_blocking=True)
                event = self._stream.record_event()
            t.record_stream(self._stream)  # its block is not reused before the copy is done
        else:
            host, event = torch.empty(t.size(), dtype=t.dtype, layout=t.layout), None
            host.copy_(t)
        entry = Offloaded(host, len(self._entries), event)
        self._entries.append(weakref.ref(entry))
        self._by_tensor[id(t)] = (weakref.ref(t), weakref.ref(entry))
        return entry

    def _unpack(self, packed):
        if isinstance(packed, Offloaded):
            t = self._back(packed)
            if self.copies_back:
                self._prefetch(packed)
        else:
            t = packed
        for _, on_unpack in list(_observers):
            on_unpack(packed, t)
        return t

    def _prefetch(self, entry: Offloaded) -> None:
        """Start the copies back of the entries saved just before ``entry`` (the next ones backward needs):
        at most ``PREFETCH``, and beyond the first no more bytes than ``entry``'s, so what is in flight at
        most doubles what backward holds of them."""
        budget, spent = entry.host.nbytes, 0
        for j in range(entry.index - 1, max(-1, entry.index - 1 - PREFETCH), -1):
            earlier = self._entries[j]()
            if earlier is None or earlier.device_copy is not None:
                continue
            if spent and spent + earlier.host.nbytes > budget:
                break
            self._start_back(earlier)
            spent += earlier.host.nbytes

    def _start_back(self, entry: Offloaded) -> None:
        """Start ``entry``'s copy back to the device (on the side stream where there is one)."""
        if self._stream is None:
            entry.device_copy = entry.host.clone()  # the planner's stand-in for a device buffer
            return
        with torch.cuda.stream(self._stream):
            entry.device_copy = entry.host.to(self.device, non_blocking=True)
            entry.ready = self._stream.record_event()

    def _back(self, entry: Offloaded) -> torch.Tensor:
        if not self.copies_back:
            return entry.host
        if entry.device_copy is None:
            self._start_back(entry)
        if entry.ready is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(entry.ready)
            entry.device_copy.record_stream(current)  # made on the side stream, used and freed on this one
            entry.ready = None
        return entry.device_copy


def activation_offload(enabled: bool, device: torch.device, copies_back: bool | None = None):
    """The offload context of ``strategy.activation_offload`` for ``device``, or None when it is off."""
    return ActivationOffload(device, copies_back) if enabled else None
