"""AdamW with a chosen implementation, stepped after backward or inside it, and the warmup + cosine
learning-rate schedule.

The implementation matters for memory: ``foreach`` groups all parameters into multi-tensor kernels
and materialises temporaries the size of a whole parameter group (several GiB at 7B); ``for-loop``
steps one parameter at a time; ``fused`` runs one kernel per group with almost no temporaries.

``optimizer.name`` chooses the moments' storage: ``adamw`` keeps them in the weights' dtype (PyTorch's AdamW);
``adamw8bit`` / ``adamw4bit`` are torchao's AdamW with block-quantized moments (8-bit codes with one fp32 scale
per 256 values, 4-bit codes with one per 128; tensors under 4,096 values, or not a whole number of blocks, stay
fp32, as in bitsandbytes). Their update runs in fp32 one parameter at a time, and memfit runs torchao's update
function eagerly (``torch.compiler.set_stance("force_eager")``) on every device: the planner's fake tensors
cannot run a compiled kernel, so only the eager step is one it can trace, and inductor would compile every
parameter shape (5-25 s each on a 2-core CPU). The eager update holds fp32 and int64 temporaries of about 13x
the fp32 bytes it works on, so a parameter above ``SLICE_VALUES`` values is stepped in block-aligned row slices
(bit-equal to the whole update): the temporaries are one slice's, and the planner counts them.

``optimizer.in_backward`` (``OptimizerInBackward``) steps each parameter from its post-accumulate-grad
hook and frees the gradient there, so at most a few gradients exist at any moment instead of all of
them (torchtune's ``optimizer_in_bwd``). The update is AdamW's own, parameter by parameter.

Known limitations of the step in backward:
    - No gradient accumulation, global-norm clipping, GradScaler or multi-rank engine
      (``Strategy.conflict`` says which); the gradient norm it reports is computed from each gradient
      before its step (the same number, without clipping).
    - A parameter used twice in one forward (a tied embedding) is stepped once, when autograd has summed
      both contributions: its post-accumulate-grad hook fires once per backward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator

import torch
from torch.utils.hooks import RemovableHandle

from memfit.config.schema import OptimizerConfig
from memfit.errors import UserError, first_line
from memfit.strategies.host_optimizer import HostOffloadOptimizer

LOW_BIT_BLOCK = {"adamw8bit": 256, "adamw4bit": 128}
"""Values per fp32 scale of torchao's quantized states (its defaults)."""


def resolve_implementation(
    name: str, device: torch.device, optimizer_name: str = "adamw", offload: bool = False
) -> str:
    """``optimizer.implementation`` made concrete: ``auto`` is fused on GPUs and foreach on CPU for AdamW, fused on
    the host for an offloaded AdamW (PyTorch's fused CPU kernel), and for-loop (one parameter at a time, the only
    way torchao steps) for low-bit states."""
    if name == "auto":
        if optimizer_name != "adamw":
            return "for-loop"
        return "fused" if device.type == "cuda" or offload else "foreach"
    return name


def engine_host_config(cfg: OptimizerConfig) -> OptimizerConfig:
    """``cfg`` for an engine that keeps the state on the host itself (FSDP2's CPUOffloadPolicy, DeepSpeed's
    offload_optimizer): a plain optimizer, no offloading wrapper, its implementation resolved for the host."""
    host = resolve_implementation(cfg.implementation, torch.device("cpu"), cfg.name, offload=True)
    return dataclasses.replace(cfg, offload=False, implementation=host)


def adamw_groups(params: list[torch.nn.Parameter], cfg: OptimizerConfig) -> list[dict]:
    """Parameter groups: weight decay on matrices only, as is usual for transformers."""
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def adamw_kwargs(cfg: OptimizerConfig, impl: str) -> dict:
    """AdamW's hyper-parameters and implementation flags (without the weight decay of a group)."""
    return {
        "lr": cfg.lr,
        "betas": (cfg.beta1, cfg.beta2),
        "eps": cfg.eps,
        "foreach": impl == "foreach",
        "fused": impl == "fused",
    }


def build_optimizer(
    params: list[torch.nn.Parameter], cfg: OptimizerConfig, device: torch.device
) -> torch.optim.Optimizer:
    """AdamW (``optimizer.name``) over ``params`` with the implementation ``optimizer.implementation`` resolves to,
    stepped after backward, or inside it (``OptimizerInBackward``) with ``optimizer.in_backward``."""
    if cfg.name == "adamw":
        impl = resolve_implementation(cfg.implementation, device, offload=cfg.offload)
        kind, kwargs = torch.optim.AdamW, adamw_kwargs(cfg, impl)
    else:
        kind, kwargs = low_bit_adamw(cfg.name), adamw_kwargs(cfg, "for-loop")
        del kwargs["foreach"], kwargs["fused"]
    if cfg.in_backward:
        return OptimizerInBackward(adamw_groups(params, cfg), kwargs, kind)
    if cfg.offload:
        return HostOffloadOptimizer(
            adamw_groups(params, cfg), lambda groups: kind(groups, **kwargs), device, {**kwargs, "weight_decay": 0.0}
        )
    return kind(adamw_groups(params, cfg), **kwargs)


def low_bit_adamw(name: str) -> type[torch.optim.Optimizer]:
    """torchao's AdamW with ``name``'s quantized states, its update run eagerly (see the module's docstring).

    Raises:
        UserError: when torchao is not installed (the ``lowbit`` extra).
    """
    try:
        from torchao.optim import AdamW4bit, AdamW8bit
    except ImportError as e:
        raise UserError(
            f"optimizer.name {name} needs torchao: pip install 'memfit[lowbit]' (or torchao); {first_line(e)}"
        ) from None
    kind = {"adamw8bit": AdamW8bit, "adamw4bit": AdamW4bit}[name]
    _code_maps_computed()
    return _eager_step(kind)


def _code_maps_computed() -> None:
    """torchao computes its quantization code maps once, from real tensors, and caches them; on the planner's
    fake tensors that computation cannot run (it reads values), so it runs here first, outside any fake mode."""
    import torchao.optim.subclass_4bit as four
    import torchao.optim.subclass_8bit as eight
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        for module in (four, eight):
            for fn in ("get_qmap_signed", "get_qmap_unsigned"):
                getattr(module, fn, lambda: None)()


SLICE_VALUES = 1 << 24
"""Values of a parameter the eager low-bit update works on at once (64 MiB in fp32; a 4096 x 4096 projection is
one slice): a larger parameter is stepped in slices of whole rows, so the update's fp32 and int64 temporaries
(about 13x a slice's fp32 bytes) stay under 1 GiB. The planner traces one slice of each shape and replays the rest
(``StepTracker._run_update``); before it did, 4M-value slices took a Llama-2-7B search 57 s instead of 25 s on a
2-core VM."""


_update_runners: list[Callable] = []


@contextlib.contextmanager
def running_slice_updates(runner: Callable) -> Iterator[None]:
    """While open, the low-bit update of each parameter slice runs as ``runner(update, args)`` instead of
    ``update(*args)``: the planner's tracker runs it, or replays what an update of the same shapes allocated."""
    _update_runners.append(runner)
    try:
        yield
    finally:
        _update_runners.remove(runner)


@functools.cache
def _eager_step(kind: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """``kind`` with torchao's per-parameter update (``single_param_adam``) run eagerly, on slices of at most
    ``SLICE_VALUES`` values: the same elementwise update on each value (block-aligned slices of a quantized state
    are views of its codes and scales, torchao's own ``aten.slice``), so the result is the same to the bit."""
    from torchao.optim.adam import single_param_adam

    class Eager(kind):
        @torch.no_grad()
        def step(self, closure=None):
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            with torch.compiler.set_stance("force_eager"):
                for group in self.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            self._step_param(p, group)
            return loss

        def _step_param(self, p: torch.Tensor, group: dict) -> None:
            state = self.state[p]
            if not state:  # as torchao's step creates it
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = self._new_buffer(p, True)
                state["exp_avg_sq"] = self._new_buffer(p, False)
                if group["amsgrad"]:
                    state["max_exp_avg_sq"] = self._new_buffer(p, False)
            state["step"] += 1
            beta1, beta2 = group["betas"]
            moments = [state["exp_avg"], state["exp_avg_sq"], state.get("max_exp_avg_sq")]
            param, grad = p.detach(), p.grad
            for rows in _row_slices(p, self.block_size):

                def part(t: torch.Tensor | None, rows: slice | None = rows) -> torch.Tensor | None:
                    return t if t is None or rows is None else t[rows]

                args = (
                    part(param),
                    part(grad),
                    state["step"],
                    *(part(m) for m in moments),
                    group["lr"],
                    beta1,
                    beta2,
                    group["weight_decay"],
                    group["eps"],
                    self.is_adamw,
                    self.bf16_stochastic_round and p.dtype is torch.bfloat16,
                )
                if _update_runners:
                    _update_runners[-1](single_param_adam, args)
                else:
                    single_param_adam(*args)

    Eager.__name__ = Eager.__qualname__ = f"{kind.__name__}Eager"
    return Eager


def _row_slices(p: torch.Tensor, block: int) -> list[slice | None]:
    """Slices of ``p``'s first dimension of at most ``SLICE_VALUES`` values each, every one a whole number of
    quantization blocks (``[None]``: the whole parameter at once)."""
    if p.numel() <= SLICE_VALUES or p.ndim < 2:
        return [None]
    row = math.prod(p.shape[1:])
    step = max(1, SLICE_VALUES // row)
    step = math.lcm(step, block // math.gcd(block, row))  # row * step is a whole number of blocks
    return [slice(i, min(i + step, p.shape[0])) for i in range(0, p.shape[0], step)]


class OptimizerInBackward(torch.optim.Optimizer):
    """One AdamW (of class ``kind``) per parameter, stepped from the parameter's post-accumulate-grad hook during
    backward.

    To the LR scheduler and the checkpoint it is one optimizer: its ``param_groups`` are the per-parameter
    AdamWs' own groups (one parameter each, so a scheduler's learning rate reaches them) and its ``state``
    is theirs (one dict shared by all), so ``state_dict`` / ``load_state_dict`` are ``Optimizer``'s.
    ``step()`` steps any parameter that still holds a gradient (none after a backward).

    Args:
        groups: AdamW parameter groups (``adamw_groups``).
        kwargs: AdamW's other arguments (``adamw_kwargs``).
    """

    def __init__(self, groups: list[dict], kwargs: dict, kind: type[torch.optim.Optimizer] = torch.optim.AdamW):
        self._inner: dict[torch.nn.Parameter, torch.optim.Optimizer] = {}
        for group in groups:
            for p in group["params"]:
                self._inner[p] = kind([p], weight_decay=group["weight_decay"], **kwargs)
        super().__init__(groups, dict(kwargs, weight_decay=0.0))
        self._relink()
        self._pre_param: OrderedDict[int, Callable] = OrderedDict()  # RemovableHandle holds weak references
        self._post_param: OrderedDict[int, Callable] = OrderedDict()
        self._norm_sq: torch.Tensor | None = None
        self._handles = [p.register_post_accumulate_grad_hook(self._step_param) for p in self._inner]

    def _relink(self) -> None:
        """Share groups and state with the per-parameter AdamWs (again after ``load_state_dict``)."""
        self.param_groups = [g for opt in self._inner.values() for g in opt.param_groups]
        for opt in self._inner.values():
            opt.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        by_param = {g["params"][0]: g for g in self.param_groups}
        for p, opt in self._inner.items():
            opt.param_groups = [by_param[p]]
        self._relink()

    def register_param_step_hooks(self, pre: Callable, post: Callable) -> RemovableHandle:
        """``pre(p)`` before a parameter's step (its gradient whole), ``post(p)`` after it (the gradient
        freed): how the planner's tracker tells gradients and optimizer state apart inside backward."""
        handle = RemovableHandle(self._pre_param, extra_dict=self._post_param)
        self._pre_param[handle.id], self._post_param[handle.id] = pre, post
        return handle

    def begin_step(self) -> None:
        """Start an optimizer step: the gradient norm restarts from zero."""
        self._norm_sq = None

    def grad_norm(self, device: torch.device) -> torch.Tensor:
        """The global L2 norm of the gradients stepped since ``begin_step`` (a 0-d fp32 tensor)."""
        if self._norm_sq is None:
            return torch.zeros((), device=device)
        return self._norm_sq.sqrt()

    @torch.no_grad()
    def _step_param(self, p: torch.nn.Parameter) -> None:
        for fn in list(self._pre_param.values()):
            fn(p)
        sq = torch.linalg.vector_norm(p.grad, dtype=torch.float32).square()
        self._norm_sq = sq if self._norm_sq is None else self._norm_sq + sq
        self._inner[p].step()
        p.grad = None
        for fn in list(self._post_param.values()):
            fn(p)

    @torch.no_grad()
    def step(self, closure=None):
        for p in self._inner:
            if p.grad is not None:
                self._step_param(p)
        return None


def lr_at(step: int, max_steps: int, cfg: OptimizerConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup, then cosine to lr * min_lr_ratio."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(1, max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, max_steps: int, cfg: OptimizerConfig):
    """A LambdaLR that follows ``lr_at`` (its state_dict is checkpointed with the run)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, max_steps, cfg) / cfg.lr)
