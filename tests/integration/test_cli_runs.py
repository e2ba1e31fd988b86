"""Integration tier: subprocess CLI runs, kill -9 + resume, and the real SmolLM2 model."""

import signal
import subprocess
import sys
import time

import pytest
from support.tiny import tiny_overrides

from memfit.telemetry.metrics_file import read_metrics

pytestmark = pytest.mark.integration


def _memfit(*args, **kw):
    return subprocess.Popen(
        [sys.executable, "-m", "memfit.cli", "train", "tiny-cpu", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def _losses(run_dir):
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "step"]


@pytest.mark.parametrize(
    "levers",
    [(), ("optimizer.in_backward=true", "optimizer.grad_clip=0", "strategy.activation_offload=true")],
    ids=["plain", "in-backward-offloaded"],
)
def test_kill_9_then_resume_continues_the_same_losses(tmp_path, embedded_dir, levers):
    args = [
        "train.max_steps=12",
        "train.checkpoint_every=4",
        "train.eval_every=0",
        "train.threads=1",
        "data.seq_len=128",
        "train.micro_batch_size=8",
        *levers,
    ]
    ref = _memfit(*tiny_overrides(tmp_path / "ref", *args))
    victim = _memfit(*tiny_overrides(tmp_path / "run", *args))
    first_ckpt = tmp_path / "run" / "checkpoints" / "step_0000004"
    deadline = time.time() + 120
    while not first_ckpt.is_dir() and time.time() < deadline and victim.poll() is None:
        time.sleep(0.01)
    assert victim.poll() is None, "the run ended before it could be killed: " + victim.communicate()[1][-500:]
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert victim.returncode == -signal.SIGKILL
    killed_at = max(s for s, _ in _losses(tmp_path / "run"))
    assert 4 <= killed_at < 12

    resumed = _memfit(*tiny_overrides(tmp_path / "run", *args, "train.resume=true"))
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-2000:]
    assert "resuming from step_" in out
    ref_out, ref_err = ref.communicate(timeout=300)
    assert ref.returncode == 0, ref_err[-2000:]

    got, want = _losses(tmp_path / "run"), _losses(tmp_path / "ref")
    assert [s for s, _ in got] == list(range(1, 13))  # no step lost or repeated
    assert got == want  # bit-identical on the same machine and thread count
    assert not list((tmp_path / "run" / "checkpoints").glob(".tmp-*"))


def test_cli_reports_user_errors_with_exit_code_2(tmp_path, embedded_dir):
    proc = _memfit(*tiny_overrides(tmp_path / "run", "train.micro_batch_sise=2"))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(
        "memfit: error: override: unknown key 'train.micro_batch_sise' (did you mean 'micro_batch_size'?); "
        "valid keys of 'train': device, max_steps, micro_batch_size,"
    )


def test_real_smollm2_lora_lowers_heldout_loss(tmp_path):
    """The default model and data: a short LoRA fine-tune of the pretrained SmolLM2-135M on Shakespeare."""
    from memfit.config.loader import load_config
    from memfit.config.shipped import shipped_configs
    from memfit.train.loop import Trainer

    cfg = load_config(
        shipped_configs()["smollm2-shakespeare-lora-cpu"],
        [
            "train.max_steps=12",
            "data.seq_len=64",
            "data.max_documents=6",
            "train.eval_every=0",
            "train.eval_batches=4",
            "optimizer.warmup_steps=2",
            "train.checkpoint_every=0",
            f"output.dir={tmp_path / 'run'}",
        ],
    )
    result = Trainer(cfg).fit()
    first, last = result.evals[0]["eval_loss"], result.evals[-1]["eval_loss"]
    assert 2.0 < first < 6.0, "a pretrained model starts far below ln(49152) = 10.8"
    assert last < first - 0.05, (first, last)
    assert (tmp_path / "run" / "export" / "adapter_model.safetensors").is_file()


def test_out_of_memory_exits_3_with_one_line_and_keeps_the_run_dir(tmp_path, embedded_dir):
    """A memory cap on the subprocess (RLIMIT_AS) makes the CPU allocator fail mid-run."""
    import resource

    from support.address_space import address_space_cap

    limit = address_space_cap(3 << 30)

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "memfit.cli",
            "train",
            "tiny-cpu",
            *tiny_overrides(out, "train.micro_batch_size=64", "data.seq_len=512", "data.max_documents=20"),
        ],
        capture_output=True,
        text=True,
        preexec_fn=cap,
        timeout=300,
    )
    assert proc.returncode == 3, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memfit: error: out of memory at step 1: an allocation of")
    assert "planner predicted" in lines[0]
    assert (out / "config.yaml").is_file() and (out / "metrics.jsonl").is_file()
    assert not (out / "checkpoints").exists() or not list((out / "checkpoints").glob(".tmp-*"))
    ooms = [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "oom"]  # the same failure, as data
    assert len(ooms) == 1 and ooms[0]["step"] == 1 and f"({ooms[0]['requested_bytes']} bytes)" in lines[0]
    assert ooms[0]["predicted_peak_bytes"] > 0 and ooms[0]["rank"] == 0
