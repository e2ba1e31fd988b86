"""AdamW with a chosen implementation, stepped after backward or inside it, and the warmup + cosine
learning-rate schedule.

The implementation matters for memory: ``foreach`` groups all parameters into multi-tensor kernels
and materialises temporaries the size of a whole parameter group (several GiB at 7B); ``for-loop``
steps one parameter at a time; ``fused`` runs one kernel per group with almost no temporaries.

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

import math
from collections import OrderedDict
from collections.abc import Callable

import torch
from torch.utils.hooks import RemovableHandle

from memfit.config.schema import OptimizerConfig


def resolve_implementation(name: str, device: torch.device) -> str:
    if name == "auto":
        return "fused" if device.type == "cuda" else "foreach"
    return name


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
    """AdamW over ``params`` with the implementation ``optimizer.implementation`` resolves to, stepped
    after backward, or inside it (``OptimizerInBackward``) with ``optimizer.in_backward``."""
    kwargs = adamw_kwargs(cfg, resolve_implementation(cfg.implementation, device))
    if cfg.in_backward:
        return OptimizerInBackward(adamw_groups(params, cfg), kwargs)
    return torch.optim.AdamW(adamw_groups(params, cfg), **kwargs)


class OptimizerInBackward(torch.optim.Optimizer):
    """One AdamW per parameter, stepped from the parameter's post-accumulate-grad hook during backward.

    To the LR scheduler and the checkpoint it is one optimizer: its ``param_groups`` are the per-parameter
    AdamWs' own groups (one parameter each, so a scheduler's learning rate reaches them) and its ``state``
    is theirs (one dict shared by all), so ``state_dict`` / ``load_state_dict`` are ``Optimizer``'s.
    ``step()`` steps any parameter that still holds a gradient (none after a backward).

    Args:
        groups: AdamW parameter groups (``adamw_groups``).
        kwargs: AdamW's other arguments (``adamw_kwargs``).
    """

    def __init__(self, groups: list[dict], kwargs: dict):
        self._inner: dict[torch.nn.Parameter, torch.optim.AdamW] = {}
        for group in groups:
            for p in group["params"]:
                self._inner[p] = torch.optim.AdamW([p], weight_decay=group["weight_decay"], **kwargs)
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
