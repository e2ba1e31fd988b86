"""LoRA through PEFT: adapters on the named Linear modules, base weights frozen."""

from __future__ import annotations

import warnings

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model

from memfit.config.schema import LoraConfig
from memfit.errors import UserError, did_you_mean


def linear_module_names(model: torch.nn.Module) -> set[str]:
    """The last name component of every ``nn.Linear`` in the model (q_proj, down_proj, lm_head, ...)."""
    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def apply_lora(model: torch.nn.Module, cfg: LoraConfig):
    """Wrap ``model`` with PEFT LoRA adapters.

    Raises:
        UserError: when a target module is not a Linear layer of this model.
    """
    available = linear_module_names(model)
    for target in cfg.target_modules:
        if target not in available:
            raise UserError(
                f"lora.target_modules: '{target}' is not a Linear module of this model"
                f"{did_you_mean(target, available)}; available: {', '.join(sorted(available))}"
            )
    peft_config = PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings():  # PEFT asks transformers a deprecated question; not ours to fix
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        # adapters in the base weights' dtype: PEFT would upcast them to fp32 under bf16 weights, and cast each
        # adapted input to fp32 (saved for backward): +7 to 13 GiB on a Llama-2-7B LoRA step (bf16-pure, 4 x 1024)
        return get_peft_model(model, peft_config, autocast_adapter_dtype=False)
