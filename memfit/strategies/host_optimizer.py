"""Optimizer offloading (``optimizer.offload``): the optimizer state and step live in host memory.

``HostOffloadOptimizer`` keeps, for every trainable parameter, a host copy (its master, in the parameter's
dtype), a host gradient buffer and an optimizer of its own over that copy (AdamW as ``optimizer.name`` says,
with ``optimizer.implementation`` resolved for the CPU: ``auto`` is PyTorch's fused CPU kernel). Its step runs
after backward and after clipping: every gradient is copied to its host buffer, the host steps each parameter
as soon as its gradient has arrived, and writes the result back into the device parameter. On CUDA/ROCm the
host buffers are pinned and both copies run on a side stream without blocking, so the copies of later
gradients overlap the host's work on earlier ones and the copies back overlap the host's next parameters; the
device's next forward waits for the last copy back. The device keeps its parameters and its gradients (until
``zero_grad``) as without offloading; the optimizer state, the host copies and the step's temporaries are host
memory. On a CPU device the copies are plain host copies, so a CPU run takes the same path (and, host and device
being one memory there, pays for the copies).

Why not torchao's ``CPUOffloadOptimizer`` (whose design, one optimizer per parameter over pinned host copies with
a side stream, this follows): it refuses to start without CUDA or XPU, so nothing here could run or be measured
on a CPU, and it copies each gradient to the host in its post-accumulate-grad hook, before the trainer clips the
global gradient norm, so a clipped run would step unclipped gradients.

The host's work is announced to observers (``observing_host``): the planner's tracker and the profiler
measurement use it to tell host storages from device ones, since in a trace and on a CPU every tensor is a CPU
tensor.

Known limitations:
    - The copies to the host start when the step starts (after clipping), not during backward: the device holds
      every gradient until ``zero_grad``, as without offloading.
    - One process only (``Strategy.conflict``); with several ranks, FSDP2's or DeepSpeed's offloading is the way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from memfit.strategies.tensors import state_tensors

HOST = torch.device("cpu")

_host_observers: list[Callable[[bool, bool], None]] = []


@contextlib.contextmanager
def observing_host(on_host: Callable[[bool, bool], None]) -> Iterator[None]:
    """While open, ``on_host(True, pinned)`` runs when the offloaded optimizer starts work on host memory
    (allocating its host copies, which a GPU run pins, or stepping a parameter) and ``on_host(False, pinned)``
    when it stops."""
    _host_observers.append(on_host)
    try:
        yield
    finally:
        _host_observers.remove(on_host)


@contextlib.contextmanager
def host_side(pinned: bool = False) -> Iterator[None]:
    """The offloaded optimizer's host work: what it allocates in here is host memory, pinned on a GPU run
    where ``pinned`` (PyTorch's pinned-memory allocator rounds each block up to a power of two)."""
    for on_host in list(_host_observers):
        on_host(True, pinned)
    try:
        yield
    finally:
        for on_host in list(_host_observers):
            on_host(False, pinned)


class HostOffloadOptimizer(torch.optim.Optimizer):
    """Step ``groups``' parameters on the host with one ``make([group])`` optimizer per parameter.

    ``param_groups`` are the device parameters' groups (the LR scheduler and a GradScaler act on them; their
    hyper-parameters are handed to each host optimizer at every step); ``state`` maps each device parameter to
    its host state, so ``state_dict`` has the layout of the same optimizer without offloading.
    """

    def __init__(self, groups: list[dict], make: Callable[[list[dict]], torch.optim.Optimizer], device, defaults):
        super().__init__(groups, defaults)
        self.device = torch.device(device)
        self._make = make
        self._pinned = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self._pinned else None
        self._host: dict[torch.nn.Parameter, torch.Tensor] = {}
        self._inner: dict[torch.nn.Parameter, torch.optim.Optimizer] = {}

    state_device = HOST
    """Where this optimizer's state lives (a checkpoint's state is loaded there)."""

    def _host_copy(self, p: torch.nn.Parameter) -> torch.Tensor:
        """``p``'s host master and gradient buffer, made from the device value on first use."""
        host = self._host.get(p)
        if host is None:
            with host_side(pinned=True):
                host = torch.empty_like(p, device=HOST, pin_memory=self._pinned)
                host.copy_(p.detach())
                host.grad = torch.empty_like(host, pin_memory=self._pinned)
            self._host[p] = host
        return host

    def _optimizer_of(self, p: torch.nn.Parameter, group: dict) -> torch.optim.Optimizer:
        inner = self._inner.get(p)
        if inner is None:
            host = self._host_copy(p)
            hyper = {k: v for k, v in group.items() if k != "params"}
            with host_side():
                inner = self._make([{"params": [host], **hyper}])
            self._inner[p] = inner
            self.state[p] = inner.state[host]  # the same dict: filled in place by the host optimizer
        for k, v in group.items():  # the scheduler's learning rate, the group's weight decay
            own = inner.param_groups[0]
            if k == "params" or k not in own:
                continue
            if isinstance(own[k], torch.Tensor):  # torchao keeps lr as a tensor
                own[k].fill_(v)
            else:
                own[k] = v
        return inner

    def _copy(self, dst: torch.Tensor, src: torch.Tensor):
        """``dst.copy_(src)``, on the side stream and without blocking where there is one; the copy's event."""
        if self._stream is None:
            dst.copy_(src)
            return None
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
            return self._stream.record_event()

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("optimizer.offload steps without a closure")
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))  # backward and clipping are done
        arrived = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    host = self._host_copy(p)
                    arrived.append((group, p, host, self._copy(host.grad, p.grad)))
        for group, p, host, event in arrived:
            if event is not None:
                event.synchronize()
            inner = self._optimizer_of(p, group)
            with host_side():
                inner.step()
            self._copy(p.detach(), host)
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)  # the next forward sees the update

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore from ``state_dict`` (this optimizer's, or the same optimizer's without offloading): the
        hyper-parameters into ``param_groups``, each parameter's state into its host optimizer (on the host)."""
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups) or any(
            len(s["params"]) != len(g["params"]) for s, g in zip(saved, self.param_groups)
        ):
            raise ValueError("the saved optimizer state has other parameter groups than this model's")
        for s, group in zip(saved, self.param_groups):
            group.update({k: v for k, v in s.items() if k != "params"})
            for index, p in zip(s["params"], group["params"]):
                if index in state_dict["state"]:
                    inner = self._optimizer_of(p, group)
                    own = {"state": {0: state_dict["state"][index]}, "param_groups": [{**inner.param_groups[0]}]}
                    own["param_groups"][0]["params"] = [0]
                    with host_side():
                        inner.load_state_dict(own)
                    self.state[p] = inner.state[self._host[p]]

    def host_tensors(self) -> list[torch.Tensor]:
        """Every host storage this optimizer holds: masters, gradient buffers, state (see ``host_tensors``)."""
        out = [t for host in self._host.values() for t in (host, host.grad)]
        for inner in self._inner.values():
            out += state_tensors(inner)
        return out


def host_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The host storages of an offloaded optimizer (none for any other)."""
    return optimizer.host_tensors() if isinstance(optimizer, HostOffloadOptimizer) else []
