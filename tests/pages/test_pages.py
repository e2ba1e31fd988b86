"""memfit report's pages, read as HTML (the browser tier is tests/integration/test_report_browser.py)."""

import gzip
import json
from pathlib import Path

import pytest
from support.pages import HOSTILE, bench_dir, data_of, hostile_snapshot
from support.snapshots import segment
from support.tiny import FIXTURES

from memfit.allocator.layout import Rebuilt
from memfit.allocator.snapshot import analyze, load_snapshot
from memfit.cli import main
from memfit.config.strategy import levers
from memfit.pages.html import script_json
from memfit.pages.plan import plan_page
from memfit.train.loop import Trainer

H200 = FIXTURES / "h200-llama2-7b-lora-ffn-bf16pure-step3.pickle.gz"


def report(*args: str) -> int:
    return main(["report", *args])


def test_the_data_block_cannot_close_its_script_and_survives_nan():
    text = script_json({"name": HOSTILE, "loss": float("nan"), "big": float("inf")})
    assert "<" not in text and ">" not in text and "&" not in text
    assert json.loads(text) == {"name": HOSTILE, "loss": None, "big": None}


def test_untrusted_snapshot_text_is_escaped_everywhere(tmp_path):
    path = hostile_snapshot(tmp_path)
    assert report(str(path), "--out", str(tmp_path / "p.html")) == 0
    page = (tmp_path / "p.html").read_text()
    assert "<script>alert" not in page and "<img src=x" not in page
    assert "&lt;/script&gt;&lt;script&gt;alert(1)" in page  # a block's frames, in its title
    assert HOSTILE in data_of(page)["snapshot"]["frames"][0]  # the hover's frames, as data read by textContent


def test_the_h200_snapshot_page_holds_every_segment_and_the_numbers_of_frag(tmp_path):
    out = tmp_path / "h200.html"
    assert report(str(H200), "--simulate", "--capacity", "141GiB", "--out", str(out)) == 0
    page = out.read_text()
    snap = load_snapshot(H200)
    at_dump, rebuilt = analyze(snap, 0), Rebuilt(snap, 0)
    peak = rebuilt.peak()
    assert page.count('<div class="seg">') == len(at_dump.segments) + len(peak.report.segments) == 2 * 529
    numbers = page[page.index('id="numbers"') : page.index("</table>", page.index('id="numbers"'))]
    assert f"{at_dump.reserved_bytes / 2**30:.3f} GiB" in numbers
    assert f"{peak.report.allocated_bytes / 2**30:.3f} GiB" in numbers
    assert f"{at_dump.fragmentation_ratio:.3f}" in numbers
    data = data_of(page)
    assert len(data["snapshot"]["entry"]) == len(rebuilt.entries)  # every entry of the trace, under the limit
    assert data["snapshot"]["allocated"][peak.index] == peak.report.allocated_bytes
    assert "recommendation: expandable_segments:True" in page
    assert out.stat().st_size < 2_500_000  # mailable: 1.9 MB measured
    assert not (tmp_path / ".h200.html.tmp").exists()


def test_a_long_trace_is_drawn_from_buckets_that_keep_the_peak(tmp_path, monkeypatch):
    import memfit.pages.snapshot as snapshot_page

    monkeypatch.setattr(snapshot_page, "TIMELINE_POINTS", 1000)
    out = tmp_path / "h200.html"
    assert report(str(H200), "--out", str(out)) == 0
    data = data_of(out.read_text())["snapshot"]
    assert 900 < len(data["entry"]) <= 1000
    peak = Rebuilt(load_snapshot(H200), 0).peak()
    assert max(data["allocated"]) == peak.report.allocated_bytes


def test_a_gzipped_snapshot_reads_as_the_pickle_and_a_damaged_one_is_one_line(tmp_path, capsys):
    raw = tmp_path / "s.pickle"
    raw.write_bytes(gzip.decompress(H200.read_bytes()))
    assert load_snapshot(raw) == load_snapshot(H200)
    bad = tmp_path / "bad.pickle.gz"
    bad.write_bytes(H200.read_bytes()[:5000])
    assert report(str(bad)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.pickle.gz" in err[0] and "not a readable pickle" in err[0]
    assert not (tmp_path / "bad.pickle.gz.html").exists()


@pytest.fixture(scope="module")
def tiny_plan(tmp_path_factory):
    """memfit plan --json of the tiny preset, LoRA on a 2 GiB device (real traces)."""
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    args = ["plan", "--model", "tiny", "--gpu-mem", "2GiB", "--seq-len", "128", "--global-batch", "4", "--lora"]
    args += ["--precision", "fp32", "--json"]
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(args) == 0
    path.write_text(buf.getvalue())
    return path


def test_the_plan_page_lists_every_fitting_candidate_with_a_lever_column_each_that_varies(tiny_plan, tmp_path):
    data = json.loads(tiny_plan.read_text())
    page = plan_page(data, str(tiny_plan)).render()
    table = page[page.index('id="candidates"') : page.index("</table>", page.index('id="candidates"'))]
    assert table.count("<tr data-row=") == len(data["fitting"]) > 1
    varying = [n for n in levers() if len({str(c[n]) for c in data["fitting"]}) > 1]
    for name in varying:
        assert f"<th>{name.replace('_', ' ')}</th>" in table
    best = data["fitting"][0]
    assert f"{best['peak_bytes'] / 2**30:.2f}" in table.split("<tr data-row=")[1]
    candidates = data_of(page)["candidates"]
    assert [c["phase_peaks_bytes"] for c in candidates] == [c["phase_peaks_bytes"] for c in data["fitting"]]


def test_plan_html_writes_the_same_page_as_report_on_the_json(tiny_plan, tmp_path, capsys):
    out = tmp_path / "plan.html"
    args = ["plan", "--model", "tiny", "--gpu-mem", "2GiB", "--seq-len", "128", "--global-batch", "4", "--lora"]
    assert main([*args, "--precision", "fp32", "--html", str(out)]) == 0
    assert report(str(tiny_plan), "--out", str(tmp_path / "from-json.html")) == 0
    direct, from_json = data_of(out.read_text()), data_of((tmp_path / "from-json.html").read_text())
    assert direct["candidates"] == from_json["candidates"]


def test_the_run_page_shows_steps_memory_and_the_summary_of_a_real_run(tiny_cfg, tmp_path):
    cfg = tiny_cfg("train.max_steps=4", "train.eval_every=2")
    Trainer(cfg).fit()
    run_dir = Path(cfg.output.dir)
    with (run_dir / "metrics.jsonl").open("a") as fh:
        fh.write('{"kind": "step", "step": 5, "loss": 1.0')  # a killed run's torn last line
    assert report(str(run_dir / "metrics.jsonl")) == 0  # the run's own metrics file names the run
    page = (run_dir / "report.html").read_text()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()[:-1]]
    summary = next(r for r in records if r["kind"] == "summary")
    losses = [r["loss"] for r in records if r["kind"] == "step"]
    charts = data_of(page)["charts"]
    assert charts["loss"]["series"][0]["values"][1:] == [float(f"{v:.6g}") for v in losses]
    assert {s["label"] for s in charts["memory"]["series"]} >= {"RSS (end of step)", "peak RSS"}
    assert f"{summary['peak_rss_bytes'] / 2**30:.3f} GiB" in page
    assert "1 unreadable line(s) skipped" in page
    assert "process peak (tensors + RSS before model load)" in page
    step_time = f"{summary['predicted_step_time_s']:.3f} s"  # the cost model beside the measured median
    assert "step time (cost model, for ranking)" in page and step_time in page
    assert "strategy:" in page  # the config that ran


def test_a_long_runs_page_draws_a_step_per_bucket_keeping_the_memory_peak_and_every_eval(tmp_path):
    from memfit.pages.run import MAX_POINTS

    steps = 3 * MAX_POINTS + 7
    with (tmp_path / "metrics.jsonl").open("w") as fh:
        for i in range(1, steps + 1):
            rss = 5 * 2**30 if i == 12_345 else 2**30 + i  # one spike, in the middle of a bucket
            fh.write(json.dumps({"kind": "step", "step": i, "loss": 1 / i, "rss_bytes": rss, "peak_rss_bytes": rss}))
            fh.write("\n")
            if i % 1000 == 0:
                fh.write(json.dumps({"kind": "eval", "step": i, "eval_loss": 2 / i}) + "\n")
    assert report(str(tmp_path)) == 0
    page = (tmp_path / "report.html").read_text()
    chart = data_of(page)["charts"]["memory"]
    peak = next(s for s in chart["series"] if s["label"] == "peak RSS")["values"]
    assert max(peak) == 5.0 and 12_345 in chart["x"]  # the spike is drawn
    assert steps // 4 <= len(chart["x"]) <= MAX_POINTS + steps // 1000 + 2  # buckets of 4 steps
    assert {1000 * k for k in range(1, steps // 1000 + 1)} <= set(chart["x"]) and chart["x"][-1] == steps
    assert f"{steps:,} steps logged, one drawn per 4" in page


def test_the_bench_page_tabulates_every_cell_and_says_which_ran_out_of_memory(tmp_path):
    out = bench_dir(tmp_path)
    assert report(str(out)) == 0
    page = (out / "report.html").read_text()
    assert page.count("<tr>", page.index('id="cells"')) >= 2
    assert "OOM asking for 3.00 GiB" in page and "0.879" in page  # 900 MiB peak
    data = data_of(page)
    assert [c["name"] for c in data["cells"]] == [c["name"] for c in json.loads((out / "results.json").read_text())]
    assert data["charts"]["pareto"]["order"] == [0, 1]  # by peak; the OOM cell has no point
    assert data["charts"]["pareto"]["series"][1]["values"] == [512.0, 1280.0]  # both on the front


PLAN_WITHOUT_PEAKS = {
    **{k: 1 for k in ("model", "gpu", "gpu_memory_bytes", "gpus_per_node", "nodes", "seq_len", "global_batch")},
    "fitting": [{"phase_peaks_bytes": {}}],
    "pruned": [],
}


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: p / "missing", "does not exist"),
        (lambda p: p, "holds neither metrics.jsonl nor results.json"),
        (lambda p: (p / "notes.txt").write_text("hello") and p / "notes.txt", "neither a pickle nor JSON"),
        (lambda p: (p / "x.json").write_text('{"a": 1}') and p / "x.json", "is not the output of memfit plan --json"),
        (lambda p: (p / "y.json").write_text("{oops") and p / "y.json", "is not readable JSON"),
        (lambda p: (p / "d.json").write_text("[" * 100_000) and p / "d.json", "JSON (nested too deeply to read"),
        (lambda p: (p / "z.json").write_text(json.dumps(PLAN_WITHOUT_PEAKS)) and p / "z.json", "a candidate has no"),
    ],
)
def test_a_path_that_is_no_result_is_one_line_and_writes_nothing(tmp_path, capsys, make, message):
    path = make(tmp_path)
    before = set(tmp_path.rglob("*"))
    assert report(str(path)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert set(tmp_path.rglob("*")) == before


def test_snapshot_flags_on_another_kind_and_an_unwritable_out_are_one_line(tmp_path, capsys):
    out = bench_dir(tmp_path)
    assert report(str(out), "--simulate") == 2
    assert report(str(out), "--out", str(tmp_path / "no" / "such" / "dir.html")) == 2
    assert report(str(out), "--out", ".") == 2  # was a ValueError from pathlib ("'.' has an empty name")
    assert report(str(out), "--out", str(tmp_path)) == 2
    assert report(str(out), "--out", "/proc/memfit-report.html") == 2  # a directory that refuses files, root too
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 5 and "read a snapshot" in lines[0] and "does not exist" in lines[1]
    assert lines[2].endswith("cannot write '.': it is a directory; choose another path for the page")
    assert lines[3].endswith(f"cannot write '{tmp_path}': it is a directory; choose another path for the page")
    assert "cannot write '/proc/memfit-report.html': its directory refuses files" in lines[4]
    assert sorted(p.name for p in out.iterdir()) == ["results.json", "results.md"]  # nothing half-written


def test_segments_of_a_hand_built_snapshot_are_drawn_to_scale(tmp_path):
    from memfit.pages.snapshot import segment_map

    snap = {"segments": [segment(0x7F0000000000, [(3 << 20, "active_allocated", None), (1 << 20, "inactive", None)])]}
    html = segment_map(analyze(snap, 0))
    assert 'class="a" style="flex:75 1 0"' in html and 'class="f" style="flex:25 1 0"' in html


def test_a_gpu_runs_page_draws_allocated_reserved_and_fragmentation_beside_the_plan(tmp_path):
    """Records shaped as a GPU run writes them (readings.memory_record's keys, the allocator watch's reading)."""
    from memfit.pages.run import run_page

    gib = 1 << 30
    steps = [
        {"kind": "step", "step": s, "loss": 2.0 - 0.1 * s, "lr": 1e-4, "step_time_s": 0.4, "tokens_per_s": 1e4}
        | {"allocated_bytes": 13 * gib, "reserved_bytes": 20 * gib, "peak_allocated_bytes": 30 * gib + s}
        | {"peak_reserved_bytes": 33 * gib, "fragmentation_ratio": 0.5 + 0.01 * s}
        for s in range(1, 5)
    ]
    summary = {"kind": "summary", "peak_allocated_bytes": 30 * gib + 4, "predicted_peak_bytes": 31 * gib}
    summary |= {"peak_reserved_bytes": 33 * gib, "modelled_peak_reserved_bytes": 32 * gib}
    evals = [{"kind": "eval", "step": 0, "eval_loss": 2.5}, {"kind": "eval", "step": 4}]  # the second without a loss
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*evals, *steps, summary]))
    page = run_page(tmp_path).render()
    memory = data_of(page)["charts"]["memory"]
    assert memory["title"] == "memory (GPU)" and memory["y2_label"] == "fragmentation ratio"
    labels = [s["label"] for s in memory["series"]]
    assert labels == [
        "allocated (end of step)",
        "reserved (end of step)",
        "peak allocated",
        "peak reserved",
        "planner's predicted peak",
        "fragmentation ratio",
    ]
    assert memory["series"][-1]["values"] == [None, 0.51, 0.52, 0.53, 0.54]  # step 0: the first eval, no step
    assert data_of(page)["charts"]["loss"]["series"][1]["values"] == [2.5, None, None, None, None]
    versus = page[page.index('id="versus"') : page.index("</table>", page.index('id="versus"'))]
    assert "peak allocated" in versus and "+3.33" in versus  # 31 GiB predicted against 30 GiB measured
    assert "peak reserved (allocator model)" in versus and "-3.03" in versus
