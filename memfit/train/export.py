"""Final export in Hugging Face format: a full model (``save_pretrained``) or a PEFT adapter.

Activation-checkpoint wrappers are removed first so the saved names and module tree are the plain
model's; the result loads with ``AutoModelForCausalLM.from_pretrained`` or
``PeftModel.from_pretrained(base, export_dir)``. Written to a temporary directory and renamed.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import torch

from memfit.models.load import ModelSource
from memfit.strategies.checkpointing import remove_activation_checkpointing
from memfit.train.checkpoint import atomic_dir


@contextmanager
def kv_cache_on(model):
    """The model's ``use_cache`` (and its generation config's) on while it is saved: training turns the KV cache
    off, and exports said ``"use_cache": false`` in config.json. ``generate`` follows the generation config, which
    a checkpoint's own generation_config.json keeps on; one made from that config.json (a checkpoint without a
    readable one) generated without a cache: SmolLM2-135M on 2 CPUs, 256 new tokens in 90-105 s against 15 s."""
    configs = [c for c in (getattr(model, "config", None), getattr(model, "generation_config", None)) if c is not None]
    before = [getattr(c, "use_cache", None) for c in configs]
    for c, was in zip(configs, before):
        if was is False:
            c.use_cache = True
    try:
        yield
    finally:
        for c, was in zip(configs, before):
            if was is False:
                c.use_cache = False


def export_model(model, tokenizer, source: ModelSource, target: Path) -> None:
    remove_activation_checkpointing(model)
    if not torch.cuda.is_available():  # save_pretrained imports DeepSpeed (accelerate's unwrap), which warns it found
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # no GPU and falls back to the CPU: say the CPU at once
    base = str(source.path) if source.kind == "hf" else f"random:{source.preset or source.path}"

    def write(tmp: Path) -> None:
        kw = {}
        if hasattr(model, "peft_config"):
            for conf in model.peft_config.values():
                conf.base_model_name_or_path = base
            # memfit never resizes the vocabulary, so the base's embeddings are never part of the adapter; PEFT's
            # "auto" would look for the base's config.json (on the Hub, for a name that is no local path) to decide
            kw["save_embedding_layers"] = False
        with kv_cache_on(model):
            model.save_pretrained(tmp, safe_serialization=True, **kw)
        tokenizer.save_pretrained(tmp)

    atomic_dir(target, write)
