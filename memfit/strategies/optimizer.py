"""AdamW with a chosen implementation, and the warmup + cosine learning-rate schedule.

The implementation matters for memory: ``foreach`` groups all parameters into multi-tensor kernels
and materialises temporaries the size of a whole parameter group (several GiB at 7B); ``for-loop``
steps one parameter at a time; ``fused`` runs one kernel per group with almost no temporaries.
"""

from __future__ import annotations

import math

import torch

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


def build_optimizer(params: list[torch.nn.Parameter], cfg: OptimizerConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW over ``params`` with the implementation ``optimizer.implementation`` resolves to."""
    return torch.optim.AdamW(
        adamw_groups(params, cfg), **adamw_kwargs(cfg, resolve_implementation(cfg.implementation, device))
    )


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
