"""Distributed tier: real 2-rank runs under torchrun with gloo on CPU (FSDP2 ZeRO-2/3, DDP, ZeRO-1,
DeepSpeed ZeRO-2/3, the optimizer offloaded by FSDP2 and DeepSpeed), sharded checkpoints, rank death and a 2-node
rendezvous on localhost."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.scrape import scrape
from support.tiny import tiny_config, tiny_overrides

from memfit.telemetry.metrics_file import read_metrics

pytestmark = pytest.mark.integration

STEPS = 10
COMMON = (
    "train.max_steps=10",
    "train.eval_every=0",
    "train.eval_batches=1",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.keep_checkpoints=10",
)
DS_FP32 = '{"zero_optimization": {"contiguous_gradients": true, "overlap_comm": false}}'  # stage from memfit's config
CHUNKS = "strategy.loss_chunks=4"  # the chunked loss under every kind of engine: its weight is tied, sharded, gathered
ENGINES = {
    "fsdp2-zero2": ("distributed.zero_stage=2",),
    "fsdp2-zero3-chunked": ("distributed.zero_stage=3", CHUNKS),
    "ddp-zero1-chunked": ("distributed.zero_stage=1", CHUNKS),
    "ddp-zero0": ("distributed.zero_stage=0",),
    "deepspeed-zero2": ("distributed.engine=deepspeed", "distributed.zero_stage=2"),
    "deepspeed-zero3-chunked": ("distributed.engine=deepspeed", "distributed.zero_stage=3", CHUNKS),
    # optimizer.offload: FSDP2's CPUOffloadPolicy; DeepSpeed's offload_optimizer, filled into its JSON by memfit
    "fsdp2-zero3-offload": ("distributed.zero_stage=3", "optimizer.offload=true"),
    "deepspeed-zero2-offload": ("distributed.engine=deepspeed", "distributed.zero_stage=2", "optimizer.offload=true"),
}
"""One 2-rank run each. A chunked loss is exact in fp32, so three engines run it and their unchunked twins are
covered by the engine's other runs (fsdp2-zero2 and -offload, ddp-zero0, deepspeed-zero2): one run per engine
kind and feature instead of twelve."""


def _memfit(args, nproc=None, popen=False, timeout=300, extra_flags=()):
    cmd = [sys.executable, "-m", "memfit.cli", "train", "tiny-cpu", *args]
    if nproc:
        cmd += ["--nproc-per-node", str(nproc), *extra_flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    if popen:
        return proc
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def _in_process(out_dir, *extra: str) -> None:
    """A one-process run in this process (``memfit train tiny-cpu`` without a new interpreter's imports)."""
    from memfit.train.loop import Trainer

    Trainer(tiny_config(out_dir, *extra)).fit()


def _steps(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "step"]


def _summary(run_dir: Path) -> dict:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "summary"][-1]


def _close(a: list[float], b: list[float], rel: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rel * abs(y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, embedded_dir):
    """The single-process reference and one 2-rank run per engine, on the same global batch of 4."""
    root = tmp_path_factory.mktemp("dist")
    ds_json = root / "ds.json"
    ds_json.write_text(DS_FP32)
    out = {}
    _in_process(root / "single", *COMMON, "output.export=true")
    out["single"] = root / "single"
    for name, extra in ENGINES.items():
        export = (
            ("output.export=true",) if name.startswith("deepspeed-zero3") else ()
        )  # the consolidation test reads it
        args = tiny_overrides(root / name, *COMMON, *extra, f"distributed.deepspeed_config={ds_json}", *export)
        code, _, err = _memfit(args, nproc=2)
        assert code == 0, f"{name}: {err[-3000:]}"
        out[name] = root / name
    return out


@pytest.mark.parametrize("engine", list(ENGINES))
def test_two_ranks_reproduce_the_single_process_loss_curve(runs, engine):
    want = [r["loss"] for r in _steps(runs["single"])]
    got = [r["loss"] for r in _steps(runs[engine])]
    assert len(want) == STEPS
    assert _close(got, want, 1e-4), f"{engine}: {got} vs {want}"
    want_norm = [r["grad_norm"] for r in _steps(runs["single"])]
    if not engine.startswith("deepspeed"):  # DeepSpeed reports the norm of its flat fp32 partitions
        assert _close([r["grad_norm"] for r in _steps(runs[engine])], want_norm, 1e-3)


def test_low_bit_states_and_an_nf4_base_train_on_ddp_as_on_one_process(tmp_path, embedded_dir):
    """8-bit AdamW states over LoRA adapters on an NF4 base, planned on DDP without ZeRO: the 2-rank run's losses
    are the one-process run's on the same global batch (each rank steps the same averaged gradient; torch's
    deprecated ``broadcast_buffers`` is not passed, so no rank warns)."""
    levers = ("lora.enabled=true", "lora.quantize_base=nf4", "optimizer.name=adamw8bit")
    _in_process(tmp_path / "one", *COMMON, *levers)
    args = tiny_overrides(tmp_path / "two", *COMMON, *levers, "distributed.zero_stage=0")
    code, _, err = _memfit(args, nproc=2)
    assert code == 0, err[-3000:]
    assert "broadcast_buffers" not in err and "FutureWarning" not in err, err[-3000:]
    want, got = ([r["loss"] for r in _steps(tmp_path / d)] for d in ("one", "two"))
    assert len(want) == STEPS and _close(got, want, 1e-4), f"{got} vs {want}"


@pytest.mark.parametrize("engine", list(ENGINES))
def test_each_rank_holds_its_share_of_the_model_states(runs, engine):
    single = _summary(runs["single"])
    summary = _summary(runs[engine])
    assert summary["world_size"] == 2 and len(summary["rank_states"]) == 2
    P, G, OPT = single["params_bytes"], single["grads_bytes"], single["optimizer_bytes"]
    largest_param = 49152 * 64 * 4 * 2  # embedding of the tiny preset (fp32): AdamW holds 2 such states
    steps = OPT - 2 * P  # AdamW's 0-d fp32 step counters, one per parameter tensor, kept whole on every rank
    assert 0 < steps < 1000
    for held in summary["rank_states"]:
        p, g, o = held["params_bytes"], held["grads_bytes"], held["optimizer_bytes"]
        if engine.startswith("fsdp2"):  # every tensor is split on dim 0: exactly half each
            assert (p, g, o) == (P // 2, G // 2, (OPT - steps) // 2 + steps), held
        elif engine.startswith("ddp-zero1"):  # whole parameters go to one rank or the other
            assert (p, g) == (P, G) and 0 < o <= OPT // 2 + largest_param, held
        elif engine == "ddp-zero0":
            assert (p, g, o) == (P, G, OPT), held
        elif engine.startswith("deepspeed-zero2"):  # optimizer state of a flat, padded partition (host or device)
            assert p == P and abs(o - OPT / 2) <= 0.01 * OPT, held
        else:  # DeepSpeed ZeRO-3: each parameter's own padded partition (ds_tensor), and its state
            assert abs(p - P / 2) <= 0.01 * P and abs(o - OPT / 2) <= 0.01 * OPT, held
    if engine.startswith("ddp-zero1"):
        assert sum(h["optimizer_bytes"] for h in summary["rank_states"]) == OPT


@pytest.mark.parametrize("engine", ["single", *ENGINES])
def test_every_engines_summary_holds_the_plan_beside_the_measurement(runs, engine):
    summary = _summary(runs[engine])
    assert summary["predicted_peak_bytes"] > 0 and summary["predicted_step_time_s"] > 0
    assert summary["median_step_time_s"] > 0 and summary["peak_rss_bytes"] > 0
    # a rank computes half the single process's global batch, and gloo's collectives are not charged on a CPU (they
    # once were, at a bandwidth of 0: millions of seconds)
    assert summary["predicted_step_time_s"] <= _summary(runs["single"])["predicted_step_time_s"]


def test_per_rank_memory_is_recorded_with_max_and_min(runs):
    steps = _steps(runs["fsdp2-zero3-chunked"])
    for rec in steps:
        per_rank = rec["rank_memory"]["peak_rss_bytes"]
        assert len(per_rank) == 2 and rec["peak_rss_bytes"] == max(per_rank)
    summary = _summary(runs["fsdp2-zero3-chunked"])
    assert len(summary["rank_peak_bytes"]) == 2
    assert summary["peak_rss_bytes"] == max(summary["rank_peak_bytes"])


def _victim_pids(launcher_pid: int) -> dict[int, int]:
    """{rank: pid} of the torchrun workers under a launcher process (read from /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if ppid == launcher_pid:
            for var in env:
                if var.startswith(b"RANK="):
                    found[int(var[5:])] = int(entry.name)
    return found


def _wait_for(predicate, proc, seconds: float) -> None:
    deadline = time.time() + seconds
    while not predicate() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended early: " + proc.communicate()[1][-2000:]
    assert predicate(), "timed out waiting"


@pytest.mark.parametrize("engine", ["fsdp2-zero2", "deepspeed-zero3-chunked"])
def test_sharded_checkpoint_kill_and_resume_continue_the_same_losses(runs, tmp_path, engine):
    """Killed after its step-2 checkpoint, resumed: the losses of the module's uninterrupted run of the engine."""
    ds_json = tmp_path / "ds.json"
    ds_json.write_text(DS_FP32)
    extra = (*ENGINES[engine], f"distributed.deepspeed_config={ds_json}", "train.checkpoint_every=2")
    args = tiny_overrides(tmp_path / "run", *COMMON, *extra)
    victim = _memfit(args, nproc=2, popen=True)
    ckpt = tmp_path / "run" / "checkpoints" / "step_0000002"
    _wait_for(ckpt.is_dir, victim, 180)
    os.killpg(victim.pid, signal.SIGKILL)  # the launcher and both ranks, mid-run
    victim.wait()
    done = [r["step"] for r in _steps(tmp_path / "run")]
    assert 2 <= max(done) < STEPS

    code, out, err = _memfit(args + ["train.resume=true"], nproc=2)
    assert code == 0, err[-3000:]
    assert "resuming from step_" in out
    got, want = _steps(tmp_path / "run"), _steps(runs[engine])
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert _close([r["loss"] for r in got], [r["loss"] for r in want], 1e-6)
    assert all((p / "trainer_state.json").is_file() for p in (tmp_path / "run" / "checkpoints").glob("step_*"))
    assert not list((tmp_path / "run" / "checkpoints").glob(".tmp-*"))

    # resuming at another world size is refused with the sizes named
    code, _, err = _memfit(args + ["train.resume=true", "train.max_steps=10"], nproc=None)
    assert code == 2
    assert "written by 2 rank(s) but this run has 1" in err


def test_a_dying_rank_ends_the_job_within_bounded_time(tmp_path, embedded_dir):
    port = _free_port()
    args = tiny_overrides(
        tmp_path / "run", *COMMON, "train.max_steps=100000", "train.checkpoint_every=3", f"train.metrics_port={port}"
    )
    job = _memfit(args, nproc=2, popen=True)
    _wait_for_steps(tmp_path / "run", job, 2)
    workers = _victim_pids(job.pid)
    assert set(workers) == {0, 1}, workers
    # each local rank serves its own endpoint on port + local rank, bound to loopback
    for rank in (0, 1):
        got = scrape(port + rank)
        assert got["memfit_rank"][0].value == rank and got["memfit_step"][0].value >= 1
        assert got["memfit_loss"][0].value > 0
    killed_at = time.time()
    os.kill(workers[1], signal.SIGKILL)
    out, err = job.communicate(timeout=60)
    elapsed = time.time() - killed_at
    assert job.returncode == 4, err[-3000:]
    # bounded by torchrun, which SIGKILLs a rank still alive 30 s after its SIGTERM: 0.8-1.6 s in 26 runs by hand, and
    # once (a clean clone's CI, 2026-12-03) 31.3 s, the survivor not leaving before that kill (cause not found)
    assert elapsed < 45, (elapsed, err[-3000:])
    line = [ln for ln in err.splitlines() if ln.startswith("memfit: error:")][-1]
    assert f"rank 1 (pid {workers[1]}) was killed by SIGKILL" in line
    assert "train.resume=true" in line
    for pid in workers.values():
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    assert all((p / "trainer_state.json").is_file() for p in (tmp_path / "run" / "checkpoints").glob("step_*"))


def test_a_data_error_every_rank_finds_is_said_once(tmp_path, embedded_dir):
    """Each rank reads the data; rank 0 alone prints what they found wrong (it printed twice, once as rank 1's)."""
    data = tmp_path / "chat.jsonl"
    data.write_text((json.dumps({"prompt": "x " * 500, "response": "y " * 5}) + "\n") * 10)
    args = tiny_overrides(tmp_path / "run", *COMMON, f"data.source={data}", "data.max_documents=null")
    code, _, err = _memfit(args, nproc=2)
    assert code == 2, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("memfit: error:")]
    assert len(lines) == 1 and "hold no token that takes a loss: every answer lies past" in lines[0], err[-3000:]


def test_sigterm_to_the_launcher_checkpoints_every_rank_in_one_line_and_the_job_resumes(tmp_path, embedded_dir):
    """What a scheduler's preemption sends: torchrun passes it on to the ranks, each writes its part of a final
    checkpoint and rank 0 says so in one line; the launcher exits 143, as one process does (it ended in torchrun's
    SignalException traceback, exit 1)."""
    args = tiny_overrides(tmp_path / "run", *COMMON, "train.max_steps=100000")
    job = _memfit(args, nproc=2, popen=True)
    _wait_for_steps(tmp_path / "run", job, 2)
    os.kill(job.pid, signal.SIGTERM)
    _, err = job.communicate(timeout=90)
    assert job.returncode == 143 and "Traceback" not in err, err[-3000:]
    (line,) = [ln for ln in err.splitlines() if ln.startswith("memfit: error:")]
    assert line.startswith("memfit: error: interrupted by SIGTERM after step ") and "train.resume=true" in line
    (last,) = (tmp_path / "run" / "checkpoints").glob("step_*")
    step = int(last.name.split("_")[1])
    assert f"step {step} of 100000" in line and (last / "manifest.json").is_file()
    more = tiny_overrides(tmp_path / "run", *COMMON, f"train.max_steps={step + 1}", "train.resume=true")
    code, _, err = _memfit(more, nproc=2)
    assert code == 0, err[-3000:]
    assert [r["step"] for r in _steps(tmp_path / "run")][-1] == step + 1


def _wait_for_steps(run_dir: Path, job, steps: int) -> None:
    """Until ``run_dir``'s running ``job`` has logged ``steps`` steps."""
    metrics = run_dir / "metrics.jsonl"
    _wait_for(lambda: metrics.is_file() and sum(r["kind"] == "step" for r in read_metrics(metrics)) >= steps, job, 180)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_localhost_match_one_node_with_two_processes(runs, tmp_path):
    args = tiny_overrides(tmp_path / "run", *COMMON, "distributed.zero_stage=2")
    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = [
        _memfit(
            args, nproc=1, popen=True, extra_flags=("--nnodes", "2", "--node-rank", str(r), "--rdzv-endpoint", endpoint)
        )
        for r in (0, 1)
    ]
    for node in nodes:
        out, err = node.communicate(timeout=300)
        assert node.returncode == 0, err[-3000:]
    got = [r["loss"] for r in _steps(tmp_path / "run")]
    want = [r["loss"] for r in _steps(runs["fsdp2-zero2"])]
    assert _close(got, want, 1e-6), (got, want)
    assert _summary(tmp_path / "run")["world_size"] == 2


def test_fsdp2_lora_export_is_the_consolidated_adapter(tmp_path, embedded_dir):
    lora = ("lora.enabled=true", "strategy.activation_checkpointing=full", "output.export=true", "train.max_steps=3")
    _in_process(tmp_path / "one", *COMMON, *lora)
    code, _, err = _memfit(tiny_overrides(tmp_path / "two", *COMMON, *lora, "distributed.zero_stage=3"), nproc=2)
    assert code == 0, err[-3000:]
    one = load_file(tmp_path / "one" / "export" / "adapter_model.safetensors")
    two = load_file(tmp_path / "two" / "export" / "adapter_model.safetensors")
    assert one.keys() == two.keys() and len(one) > 0
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=1e-4, atol=1e-6)


def test_deepspeed_zero3_export_is_the_consolidated_model(runs):
    """ZeRO-3 partitions every weight between forward passes: the export gathers them on all ranks
    and rank 0 writes the whole model, equal to the one-process run's after the same 10 steps."""
    one = load_file(runs["single"] / "export" / "model.safetensors")
    two = load_file(runs["deepspeed-zero3-chunked"] / "export" / "model.safetensors")
    assert one.keys() == two.keys() and len(one) > 0
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=1e-4, atol=1e-5)


EMBEDDINGS_TRAINED = ("lora.enabled=true", "lora.modules_to_save=[embed_tokens]")
PER_RANK = {  # id: (ZeRO stage, overrides), on a SmolLM2-135M-shaped model in fp32, 1 x 64 tokens unless said
    "zero2": (2, ()),
    "zero3": (3, ()),
    "zero2-lora-embeddings-trained": (2, EMBEDDINGS_TRAINED),
    "zero3-lora-embeddings-trained": (3, EMBEDDINGS_TRAINED),
    # the peak at the first layer's all-gather in forward: the root group's output still held beside its copy
    "zero3-lora": (3, ("lora.enabled=true",)),
    # the peak in the loss's backward, before the gradient of the model's output: no layer gathered
    "zero3-4x128": (3, ("train.micro_batch_size=4", "data.seq_len=128")),
    # a tied head's gradient summed in place over the chunks, whole on each rank until the root's post-backward
    "zero3-chunked-loss": (3, ("strategy.loss_chunks=4",)),
    "zero3-chunked-loss-4x128": (3, ("strategy.loss_chunks=4", "train.micro_batch_size=4", "data.seq_len=128")),
    # MixedPrecisionPolicy: fp32 shards gathered as bf16 copies, no autocast (ZeRO-2 1 x 64 was +32.8%)
    "zero2-bf16-mixed": (2, ("strategy.precision=bf16-mixed",)),
    "zero3-bf16-mixed-lora-4x128": (
        3,
        ("strategy.precision=bf16-mixed", "lora.enabled=true", "train.micro_batch_size=4", "data.seq_len=128"),
    ),
}


@pytest.mark.parametrize("case", PER_RANK)
def test_per_rank_profiled_peak_matches_the_planner(tmp_path, embedded_dir, case):
    """torch.profiler's tensor peak on each real rank vs the planner's per-rank FSDP2 prediction,
    on a SmolLM2-135M-shaped model (root group ~21% of the weights, so the stages differ). LoRA with the (tied)
    embeddings trained whole puts a trained copy and its gradient in the root group: ZeRO-2 measured 1,318,128,844 B
    on each rank, ZeRO-3 1,024,999,228 B, the planner 3 kB and 1.4 kB under. Its peak is in the embeddings' backward,
    after every layer's, where ZeRO-3 holds no decoder layer gathered (the planner held two there: +2.8%). What
    ZeRO-3 holds at each moment (``sharding.zero3_gathered``) took the other ZeRO-3 cases from +2.2%, +1.5%, +8.2% and
    -1.6% to within 0.001%; tracing bf16-mixed as FSDP2 computes it, bf16-mixed went from +32.8% (ZeRO-2, 1 x 64) and
    +1.7% (ZeRO-3 LoRA, 1 x 64) to within 0.0011% (benchmarks/RESULTS.md)."""
    stage, overrides = PER_RANK[case]
    args = tiny_overrides(
        tmp_path / "run",
        "model.source=random:smollm2-135m",
        "train.max_steps=2",
        "train.profile_step=2",
        "train.micro_batch_size=1",
        "train.eval_batches=0",  # no evaluation, and no final checkpoint: this test reads the profiled step only
        "train.keep_checkpoints=0",
        f"distributed.zero_stage={stage}",
        *overrides,
    )
    code, _, err = _memfit(args, nproc=2)
    assert code == 0, err[-3000:]
    rec = [r for r in _steps(tmp_path / "run") if "rank_profiled_peak_bytes" in r][0]
    ranks, predicted = rec["rank_profiled_peak_bytes"], rec["predicted_peak_bytes"]
    assert len(ranks) == 2 and rec["profiled_peak_bytes"] == max(ranks)
    # every release of the program's tensors is seen (collectives_release_on_caller) and gloo's private
    # buffers are left out, so the measurement no longer depends on the machine's load: idle and
    # with 3 busy loops on the 2 cores, ZeRO-2 read 1,560,606,184 B on both ranks (planner -0.10%), ZeRO-3
    # 1,486,648,040 B (planner +1.9% while it held two decoder layers gathered in the embeddings' backward, after
    # every layer's; 1 kB under since it holds none there)
    assert all(abs(predicted - r) / r <= 0.01 for r in ranks), (case, predicted, ranks)  # the bar 3%; all < 0.15%


def test_a_rank_dying_on_another_node_stops_this_node_too(tmp_path, embedded_dir):
    # a survivor waiting on a peer that can no longer answer gives up after distributed.timeout_s
    args = tiny_overrides(tmp_path / "run", *COMMON, "train.max_steps=100000", "distributed.timeout_s=30")
    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = [
        _memfit(
            args, nproc=1, popen=True, extra_flags=("--nnodes", "2", "--node-rank", str(r), "--rdzv-endpoint", endpoint)
        )
        for r in (0, 1)
    ]
    _wait_for(
        lambda: (
            (tmp_path / "run" / "metrics.jsonl").is_file()
            and sum(r["kind"] == "step" for r in read_metrics(tmp_path / "run" / "metrics.jsonl")) >= 2
        ),
        nodes[0],
        180,
    )
    workers = {rank: (node, pid) for node in nodes for rank, pid in _victim_pids(node.pid).items()}
    assert set(workers) == {0, 1}, workers
    victim_node, victim_pid = workers[1]
    killed_at = time.time()
    os.kill(victim_pid, signal.SIGKILL)
    errors = {}
    for node in nodes:
        out, err = node.communicate(timeout=120)
        assert node.returncode == 4, err[-3000:]
        errors[node] = [ln for ln in err.splitlines() if ln.startswith("memfit: error:")][-1]
    assert time.time() - killed_at < 60
    assert f"rank 1 (pid {victim_pid}) was killed by SIGKILL" in errors[victim_node]
    survivor = next(n for n in nodes if n is not victim_node)
    assert "rank 0 lost contact with its peers" in errors[survivor]


def test_plain_torchrun_runs_the_same_worker(runs, tmp_path):
    args = tiny_overrides(tmp_path / "run", *COMMON, "distributed.zero_stage=2")
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "memfit.train", "tiny-cpu", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = [r["loss"] for r in _steps(tmp_path / "run")]
    assert _close(got, [r["loss"] for r in _steps(runs["fsdp2-zero2"])], 1e-6)
