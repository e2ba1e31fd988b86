"""Bench plumbing that needs no training run."""

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
