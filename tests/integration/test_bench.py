"""memfit bench on the tiny preset (integration tier: every cell is a real `memfit train` subprocess)."""

import csv
import json

import pytest
import yaml
from support.tiny import REPO

from memfit.cli import main
from memfit.config.strategy import CheckpointPolicy

pytestmark = pytest.mark.integration
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_bench_2x2_matrix_on_cpu(tmp_path, capsys, embedded_dir):
    out = tmp_path / "bench"
    code = main(
        [
            "bench",
            "tiny-cpu",
            "--ac",
            "none,full",
            "--lora",
            "false,true",
            "--micro-batch",
            "2",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--out",
            str(out),
            "--set",
            "data.seq_len=32",
            "data.max_documents=1",
        ]
    )
    assert code == 0
    summary = _last_json(capsys.readouterr().out)
    assert summary["cells"] == 4 and summary["ok"] == 4 and summary["loss_flags"] == 0
    with open(out / "results.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert {r["cell"] for r in rows} == {
        "ac-none_fp32_mb2_full",
        "ac-full_fp32_mb2_full",
        "ac-none_fp32_mb2_lora",
        "ac-full_fp32_mb2_lora",
    }
    cells = json.loads((out / "results.json").read_text())
    assert all(c["status"] == "ok" and c["tokens_per_s"] > 0 and c["predicted_peak_bytes"] > 0 for c in cells)
    # on CPU the planner is compared with the profiler's tensor peak of an extra (untimed) step
    assert all(abs(c["prediction_error_pct"]) <= 3 and c["profiled_peak_bytes"] > 0 for c in cells)
    # the step-time model's error per cell, and how many pairs it orders as measured (on this CPU: ranking rates)
    for c in cells:
        assert c["step_time_error_pct"] == pytest.approx(
            100 * (c["predicted_step_time_s"] - c["median_step_time_s"]) / c["median_step_time_s"]
        )
    assert 0 <= summary["step_time_pairs_ordered_alike"] <= summary["step_time_pairs"] <= 6
    assert "| step-time error % |" in (out / "results.md").read_text()
    # checkpointing does not change the loss: same precision and tuning agree
    by = {c["name"]: c["loss"] for c in cells}
    assert by["ac-none_fp32_mb2_full"] == pytest.approx(by["ac-full_fp32_mb2_full"], rel=1e-5)
    for png in ("memory_per_cell.png", "pareto.png"):
        assert (out / png).read_bytes()[:8] == PNG_MAGIC
    assert "| cell | status |" in (out / "results.md").read_text()


def test_bench_reports_an_oom_cell(tmp_path, embedded_dir):
    """A cell that asks for more than --mem-limit is reported as OOM with the bytes it asked for. Run as a user
    runs it, in a process of its own: bench refuses a cap below what its own process maps, and a test process that
    has run other tests (or a pytest-xdist worker) maps more than a fresh one."""
    import subprocess
    import sys

    from support.address_space import address_space_cap

    out = tmp_path / "bench"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "memfit.cli",
            "bench",
            "tiny-cpu",
            "--ac",
            "none",
            "--lora",
            "false",
            "--micro-batch",
            "64",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--mem-limit",
            f"{address_space_cap(3 << 30) >> 20}MiB",
            "--out",
            str(out),
            "--set",
            "data.seq_len=512",
            "data.max_documents=20",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = _last_json(proc.stdout)
    assert summary["oom"] == 1
    cell = json.loads((out / "results.json").read_text())[0]
    assert cell["status"] == "oom" and cell["oom_request_bytes"] > 1 << 30


def test_bench_refuses_bad_matrix(tmp_path, capsys):
    assert main(["bench", "tiny-cpu", "--ac", "sometimes", "--out", str(tmp_path / "b")]) == 2
    assert "--ac must be none | full | ffn | every_k:N" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--packing", "true"], "bench cell ac-none_fp32_packed_mb2_lora: data.packing packs chat/instruction records"),
        (["--set", "data.source=no/such.jsonl"], "data.source: 'no/such.jsonl' does not exist"),
        (
            ["--lora", "true,false", "--set", "lora.modules_to_save=[embed_tokens]"],
            "bench cell ac-none_fp32_mb2_full: lora.modules_to_save trains beside a LoRA run's adapters",
        ),
    ],
)
def test_bench_refuses_a_cell_train_would_refuse_before_it_writes(tmp_path, capsys, args, needle):
    """A cell whose config ``memfit train`` refuses (packing on text, data that is not there) was run and reported
    as failed, the whole matrix long; now it is one line before ``--out`` is made."""
    assert main(["bench", "tiny-cpu", "--ac", "none", "--lora", "true", *args, "--out", str(tmp_path / "b")]) == 2
    assert needle in capsys.readouterr().err and not (tmp_path / "b").exists()


def test_bench_sets_what_its_lora_cells_train_beside_the_adapters(tmp_path, capsys, embedded_dir):
    """``--set lora.modules_to_save=...`` describes the LoRA cells' adapters: the base config was checked with it
    and LoRA off, and refused it ("a full fine-tune trains every weight") though every cell was LoRA."""
    out = tmp_path / "b"
    args = ["bench", "tiny-cpu", "--ac", "none", "--lora", "true", "--steps", "1", "--warmup", "0", "--out", str(out)]
    assert main([*args, "--set", "data.max_documents=2", "lora.modules_to_save=[embed_tokens]"]) == 0
    (cell,) = json.loads((out / "results.json").read_text())
    assert cell["status"] == "ok", cell
    ran = yaml.safe_load((out / "cells" / cell["name"] / "config.yaml").read_text())["lora"]
    assert ran["enabled"] is True and ran["modules_to_save"] == ["embed_tokens"]


def test_a_second_bench_into_an_out_in_use_is_one_line_and_touches_nothing(tmp_path, capsys):
    """Two benches into one ``--out`` both ran, each cell failing in one of them on the other's lock, and both
    exited 0 over one mixed results table; now ``--out`` is held (a ``flock``, as a run's ``output.dir`` is)."""
    import subprocess
    import sys

    out = tmp_path / "b"
    out.mkdir()
    holder = (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(out / '.memfit.lock')!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, b'4242\\n'); print('held', flush=True); time.sleep(120)\n"
    )
    other = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "held"
        assert main(["bench", "tiny-cpu", "--ac", "none", "--lora", "true", "--out", str(out)]) == 2
    finally:
        other.kill()
        other.wait()
    err = capsys.readouterr().err
    assert f"--out '{out}' is in use by another memfit bench (pid 4242)" in err
    assert [p.name for p in out.iterdir()] == [".memfit.lock"]


def test_bench_zero_cells_run_on_two_ranks(tmp_path, capsys, embedded_dir):
    out = tmp_path / "bench"
    code = main(
        [
            "bench",
            "tiny-cpu",
            "--ac",
            "none",
            "--lora",
            "false",
            "--micro-batch",
            "2",
            "--zero",
            "none,1,3",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--out",
            str(out),
            "--set",
            "data.seq_len=32",
            "data.max_documents=1",
        ]
    )
    assert code == 0
    cells = {c["name"]: c for c in json.loads((out / "results.json").read_text())}
    assert set(cells) == {"ac-none_fp32_mb2_full", "ac-none_fp32_mb2_full_zero1x2", "ac-none_fp32_mb2_full_zero3x2"}
    assert all(c["status"] == "ok" for c in cells.values())
    single, zero1, zero3 = (cells[k] for k in sorted(cells))
    assert (single["nproc"], single["grad_accum_steps"]) == (1, 2) and (zero3["nproc"], zero3["grad_accum_steps"]) == (
        2,
        1,
    )
    assert zero1["loss"] == pytest.approx(single["loss"], rel=1e-4) == zero3["loss"]
    assert zero3["profiled_peak_bytes"] and zero1["profiled_peak_bytes"] is None  # DDP buckets: not profiled
    assert abs(zero3["prediction_error_pct"]) <= 10  # vs the worst rank; ranks differ by up to ~6% on gloo


def test_gpu_check_script_runs_its_default_parts_on_cpu_and_brings_back_at_most_eight_files(tmp_path, embedded_dir):
    """benchmarks/gpu_check.py is run once per lent GPU with no time to debug it: its --smoke mode runs the default
    parts (what the open issues ask of a GPU) on the tiny preset on CPU, and GPU-only parts report themselves skipped.
    The device tool brings back at most 8 files, so the default run's must fit."""
    import subprocess
    import sys

    script = REPO / "benchmarks" / "gpu_check.py"
    sys.path.insert(0, str(REPO / "benchmarks"))
    from gpu_check import OPEN_PARTS

    out = tmp_path / "gc"
    parts = [*OPEN_PARTS, "replay", "restart"]
    proc = subprocess.run(
        [sys.executable, str(script), "--smoke", "--out", str(out), "--parts", ",".join(parts)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert {k: v["status"] for k, v in summary["parts"].items()} == {
        **{name: "ok" for name in OPEN_PARTS},
        "replay": "skipped",
        "restart": "skipped",
    }
    for name in OPEN_PARTS:
        for cell in summary["parts"][name].get("cells", []):
            assert cell["status"] == "ok" and cell["predicted_peak_bytes"] > 0, (name, cell)
    qlora = {c["name"]: c for c in summary["parts"]["bench-qlora"]["cells"]}
    assert any("nf4" in n for n in qlora) and any("nf4" not in n for n in qlora)
    packing = summary["parts"]["packing"]["result"]
    assert set(packing["arms"]) == {"memfit-packed", "memfit-padded", "hf-flat"}
    assert all(arm["supervised_tokens_per_s"] > 0 for arm in packing["arms"].values())
    text = (out / "summary.md").read_text()
    assert "| cell |" in text and "memfit-packed" in text  # the bench tables and the packing table
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8, files
    assert {"summary.json", "summary.md", "log.txt", "packing.txt"} <= set(files)


def test_gpu_check_refuses_a_part_it_does_not_have(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--smoke", "--out", str(tmp_path), "--parts", "x"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "--parts: no part x" in proc.stderr
    assert not (tmp_path / "summary.json").exists()


def test_results_json_is_rewritten_after_each_cell(tmp_path):
    """An interrupted bench keeps the cells it finished: results.json holds them, the rest pending."""
    from memfit.telemetry.bench import matrix, write_progress

    cells, _ = matrix(
        {
            "activation_checkpointing": [CheckpointPolicy("none"), CheckpointPolicy("full")],
            "precision": ["fp32"],
            "micro_batch_size": [2],
        },
        [True],
    )
    cells[0].status, cells[0].tokens_per_s = "ok", 123.0
    write_progress(cells, tmp_path)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [(c["name"], c["status"]) for c in saved] == [(cells[0].name, "ok"), (cells[1].name, "pending")]
    assert saved[0]["tokens_per_s"] == 123.0 and not (tmp_path / ".results.json.tmp").exists()


@pytest.mark.parametrize(
    "flag, values, lever, suffix",
    [
        ("--loss-chunks", "0,4", "loss_chunks", "_ce4"),
        ("--activation-offload", "false,true", "activation_offload", "_offload"),
        ("--optimizer-in-backward", "false,true", "optimizer_in_backward", "_optbwd"),
    ],
    ids=["loss-chunks", "activation-offload", "optimizer-in-backward"],
)
def test_bench_takes_a_lever_as_an_axis(tmp_path, capsys, embedded_dir, flag, values, lever, suffix):
    """A lever of the strategy vocabulary is a bench axis: both cells run, reach the same fp32 loss (the
    bench flags cells of one precision whose losses differ), and the lever's cell is predicted no larger
    (a chunked loss: smaller; offloading, on a CPU where host and device are one memory: no smaller)."""
    out = tmp_path / "bench"
    args = ["bench", "tiny-cpu", "--ac", "none", "--lora", "false", flag, values, "--steps", "1"]
    extra = ["data.seq_len=64", "data.max_documents=1", "optimizer.grad_clip=0"]
    code = main([*args, "--warmup", "1", "--out", str(out), "--set", *extra])
    assert code == 0
    summary = _last_json(capsys.readouterr().out)
    assert summary["cells"] == 2 and summary["ok"] == 2 and summary["loss_flags"] == 0
    cells = {c["name"]: c for c in json.loads((out / "results.json").read_text())}
    plain, on = cells["ac-none_fp32_mb2_full"], cells[f"ac-none_fp32{suffix}_mb2_full"]
    assert not plain[lever] and on[lever]
    if lever == "activation_offload":  # a CPU run keeps the host copies in the one memory: nothing saved
        assert on["predicted_peak_bytes"] >= plain["predicted_peak_bytes"]
    else:
        assert on["predicted_peak_bytes"] <= plain["predicted_peak_bytes"]
    if lever == "loss_chunks":
        assert on["predicted_peak_bytes"] < plain["predicted_peak_bytes"]
    assert on["loss"] == pytest.approx(plain["loss"], rel=1e-5)


def test_bench_compares_packed_and_padded_chat_rows(tmp_path, capsys, embedded_dir):
    """--packing true,false on chat data: both cells run, each says its supervised tokens per second (how much
    more the packed one trains is a benchmark's, not a test's: benchmarks/packing.py), and the packed cell is
    predicted larger by its block-causal mask."""
    records = tmp_path / "chat.jsonl"
    lines = [json.dumps({"prompt": f"Question {i}?", "response": "Yes. " * (1 + i % 7)}) for i in range(120)]
    records.write_text("\n".join(lines) + "\n")
    out = tmp_path / "bench"
    args = ["bench", "tiny-cpu", "--ac", "none", "--lora", "false", "--packing", "true,false", "--steps", "2"]
    extra = [f"data.source={records}", "data.seq_len=256", "data.max_documents=null"]
    assert main([*args, "--warmup", "1", "--out", str(out), "--set", *extra]) == 0
    summary = _last_json(capsys.readouterr().out)
    assert summary["cells"] == 2 and summary["ok"] == 2
    cells = {c["name"]: c for c in json.loads((out / "results.json").read_text())}
    packed, padded = cells["ac-none_fp32_packed_mb2_full"], cells["ac-none_fp32_mb2_full"]
    assert packed["packing"] and not padded["packing"]
    assert packed["predicted_peak_bytes"] > padded["predicted_peak_bytes"]
    assert packed["supervised_tokens_per_s"] > 0 and padded["supervised_tokens_per_s"] > 0
