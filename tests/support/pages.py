"""Inputs for memfit report's pages: a snapshot made of markup, a bench directory, the page's data block."""

import json
import pickle
import re
from pathlib import Path

from memfit.telemetry.bench import Cell
from support.snapshots import fragmented

HOSTILE = "</script><script>alert(1)</script><!--"


def data_of(page_html: str) -> dict:
    """The JSON data block of a page."""
    m = re.search(r'<script type="application/json" id="memfit-data">(.*?)</script>', page_html, re.S)
    return json.loads(m.group(1))


def hostile_snapshot(tmp_path: Path) -> Path:
    """A snapshot whose frame names, file names and block frames are markup."""
    snap = fragmented()
    frame = {"name": HOSTILE, "filename": "<img src=x onerror=alert(2)>.py", "line": 7}
    for seg in snap["segments"]:
        for b in seg["blocks"]:
            b["frames"] = [frame]
    for e in snap["device_traces"][0]:
        e["frames"] = [frame]
    path = tmp_path / "hostile.pickle"
    path.write_bytes(pickle.dumps(snap))
    return path


def bench_dir(tmp_path: Path) -> Path:
    """A bench directory as memfit bench writes it: two cells that ran, one out of memory."""
    from memfit.config.strategy import Strategy

    ok = Cell(Strategy(), lora=True, status="ok", median_step_time_s=0.5, tokens_per_s=512.0)
    ok.peak_rss_bytes, ok.params_bytes, ok.predicted_peak_bytes = 900 << 20, 12 << 20, 200 << 20
    fast = Cell(Strategy(micro_batch_size=4), lora=True, status="ok", median_step_time_s=0.4, tokens_per_s=1280.0)
    fast.peak_rss_bytes, fast.params_bytes, fast.predicted_peak_bytes = 1100 << 20, 12 << 20, 400 << 20
    oom = Cell(Strategy(micro_batch_size=8), lora=False, status="oom", oom_request_bytes=3 << 30)
    out = tmp_path / "bench"
    out.mkdir()
    (out / "results.json").write_text(json.dumps([ok.as_dict(), fast.as_dict(), oom.as_dict()]))
    (out / "results.md").write_text("memfit bench tiny-cpu.yaml: 1 warm-up + 4 measured steps\n")
    return out
