"""Shared fixtures. Tiny models are random-initialised presets; the tokenizer is the embedded
SmolLM2 one (converted once per machine into the memfit cache)."""

from __future__ import annotations

import os
import pathlib

import pytest
import torch
from support.tiny import tiny_config

from memfit.models.load import embedded_checkpoint_dir

# the planner's trace, plan and config caches are off unless a test turns them on: a test that patches a module
# constant a trace depends on must never read a trace (or an answer) made without the patch (subprocesses inherit this)
os.environ["MEMFIT_TRACE_CACHE"] = "off"
os.environ["MEMFIT_PLAN_CACHE"] = "off"
os.environ["MEMFIT_CONFIG_CACHE"] = "off"


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


@pytest.fixture
def tiny_cfg(tmp_path, embedded_dir):
    def make(*extra: str):
        return tiny_config(tmp_path / "run", *extra)

    return make


def pytest_collection_modifyitems(items):
    """Tests under tests/integration/ and tests/gpu/ carry their tier's marker (a bare pytest skips them)."""
    for item in items:
        parts = pathlib.Path(str(item.fspath)).parts
        if "integration" in parts:
            item.add_marker(pytest.mark.integration)
        if "gpu" in parts:
            item.add_marker(pytest.mark.gpu)
