"""Shared fixtures. Tiny models are random-initialised presets; the tokenizer is the embedded
SmolLM2 one (converted once per machine into the memfit cache)."""

from __future__ import annotations

import atexit
import os
import pathlib
import shutil
import tempfile

import pytest
import torch
from support.tiny import tiny_config

from memfit.models.load import embedded_checkpoint_dir
from memfit.planner import trace_cache

# under pytest-xdist (make test), each worker's torch runs one thread, and so do the processes its tests start: two
# workers of two threads each, and their subprocesses, oversubscribed the 2-core Intel VM (40 min CPU for 28 serially)
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

# the plan and config caches are off unless a test turns them on: a test that patches a module constant an answer
# depends on must never read one made without the patch (subprocesses inherit this)
os.environ["MEMFIT_PLAN_CACHE"] = "off"
os.environ["MEMFIT_CONFIG_CACHE"] = "off"
os.environ["MEMFIT_DATA_CACHE"] = "off"  # and tokenized records: a test of the tokenizing must tokenize

# the trace cache: off in this process for the same reason, unless a test points MEMFIT_TRACE_CACHE elsewhere; the
# memfit processes the tests start (which nothing patches) share one for the session, so that the same fit check is
# traced once and not in every ``memfit train`` (a trace is named by memfit's source bytes and the library versions)
SHARED_TRACES = tempfile.mkdtemp(prefix="memfit-test-traces-")
atexit.register(shutil.rmtree, SHARED_TRACES, ignore_errors=True)
os.environ["MEMFIT_TRACE_CACHE"] = SHARED_TRACES
_trace_cache_root = trace_cache.cache_root


def _this_process_trace_cache_root() -> pathlib.Path | None:
    root = _trace_cache_root()
    return None if root == pathlib.Path(SHARED_TRACES) else root


trace_cache.cache_root = _this_process_trace_cache_root


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
