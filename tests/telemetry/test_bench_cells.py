"""Bench plumbing that needs no training run."""

import json
import time
from pathlib import Path

from memfit.telemetry.bench import run_in_group


def test_a_command_past_its_limit_is_killed_with_its_whole_process_group(tmp_path):
    """A part past its time limit must not leave a cell process holding the GPU for the next part."""
    pidfile = tmp_path / "pid"
    assert run_in_group(["bash", "-c", f"sleep 60 & echo $! > {pidfile}; wait"], 2) is None
    status = Path(f"/proc/{int(pidfile.read_text())}/status")
    time.sleep(0.5)
    assert not status.exists() or "State:\tZ" in status.read_text()  # gone, or a zombie awaiting its reaper


def test_a_command_within_its_limit_returns_its_output():
    proc = run_in_group(["bash", "-c", "echo out; echo err >&2; exit 3"], 30)
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "out\n", "err\n")


def test_the_step_time_model_is_judged_by_how_many_pairs_of_cells_it_orders_as_measured():
    from memfit.config.strategy import Strategy
    from memfit.telemetry.bench import Cell, step_time_order

    def cell(modelled, measured, status="ok"):
        return Cell(Strategy(), True, status=status, predicted_step_time_s=modelled, median_step_time_s=measured)

    cells = [cell(1.0, 2.0), cell(2.0, 3.0), cell(3.0, 2.5), cell(1.01, 2.9), cell(9.0, 9.0, "oom")]
    # a-b, a-c and b-d ordered alike; b-c and c-d reversed; a-d within 2% in the model (not counted); the OOM cell
    # never counts
    assert step_time_order(cells) == {"step_time_pairs": 5, "step_time_pairs_ordered_alike": 3}


def test_a_cell_read_back_from_results_json_is_the_cell_written():
    from memfit.config.strategy import CheckpointPolicy, Strategy
    from memfit.telemetry.bench import Cell

    strategy = Strategy(activation_checkpointing=CheckpointPolicy("every_k", 2), precision="bf16-mixed", packing=True)
    cell = Cell(strategy, False, nproc=2, status="oom", oom_request_bytes=3 << 30, loss_flag="differs")
    again = Cell.from_dict(json.loads(json.dumps(cell.as_dict())))
    assert again.strategy == strategy and again.as_dict() == cell.as_dict()


def _run_under(monkeypatch, tmp_path, code: str, mem_limit):
    """``run_cell`` with the cell's ``memfit train`` swapped for a Python that does ``code`` (a real child, under
    the real cap)."""
    import sys

    from memfit.config.strategy import Strategy
    from memfit.telemetry import bench

    monkeypatch.setattr(bench, "_cell_command", lambda *a: [sys.executable, "-c", code])
    return bench.run_cell("tiny-cpu", bench.Cell(Strategy(), True), tmp_path, 0, 1, 2, [], mem_limit)


def test_a_cell_the_cap_refuses_before_its_step_is_oom_named_by_what_stopped_it(monkeypatch, tmp_path):
    """Under ``--mem-limit`` a cell that died before its training step (a MemoryError in an import, a SIGSEGV where
    a library did not check its allocation) read as "failed: exit code -11"; it is the cap's OOM, and says so."""
    cell = _run_under(monkeypatch, tmp_path, "bytearray(1 << 40)", 1 << 30)
    assert cell.status == "oom" and cell.oom_request_bytes is None
    assert cell.message == "MemoryError under --mem-limit 1.00 GiB, before the training step; raise --mem-limit"
    cell = _run_under(monkeypatch, tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", 1 << 30)
    assert (cell.status, cell.message.split(" under")[0]) == ("oom", "killed by SIGSEGV (signal 11)")


def test_without_a_cap_a_killed_cell_is_failed_and_names_its_signal(monkeypatch, tmp_path):
    cell = _run_under(monkeypatch, tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", None)
    assert (cell.status, cell.message) == ("failed", "killed by SIGSEGV (signal 11)")
    cell = _run_under(monkeypatch, tmp_path, "raise SystemExit('no such thing')", None)
    assert (cell.status, cell.message) == ("failed", "no such thing")


def test_a_cap_below_what_this_process_maps_is_refused_in_one_line(tmp_path, capsys):
    from memfit.cli import main

    assert main(["bench", "tiny-cpu", "--ac", "none", "--mem-limit", "1KiB", "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("memfit: error: --mem-limit 1,024 bytes is below the ")
    assert not (tmp_path / "b").exists()
