"""The run summary is data (computed once, written as the summary record) and its tables are rendered from it."""

from rich.console import Console

from memfit.telemetry.display import summary_tables
from memfit.telemetry.readings import StateBytes
from memfit.telemetry.summary import summarize

STATES = StateBytes(
    params_bytes=4000, trainable_params_bytes=40, grads_bytes=40, optimizer_bytes=88, params=1000, trainable_params=10
)


def _step(step: int, **extra) -> dict:
    return {"kind": "step", "step": step, "step_time_s": 0.5 * step, "tokens_per_s": 100.0 * step, **extra}


def test_a_cpu_summary_holds_rss_and_leaves_gpu_fields_out():
    steps = [_step(1, peak_rss_bytes=3 << 30), _step(2, peak_rss_bytes=2 << 30), _step(3, peak_rss_bytes=1 << 30)]
    evals = [{"step": 0, "eval_loss": 4.0}, {"step": 3, "eval_loss": 3.5}]
    s = summarize(steps, evals, STATES, baseline_rss_bytes=1 << 29, device_label="cpu", predicted_peak_bytes=1 << 30)
    rec = s.record()
    assert rec["kind"] == "summary" and rec["steps"] == 3 and rec["median_step_time_s"] == 1.0
    assert rec["peak_rss_bytes"] == 3 << 30 and rec["baseline_rss_bytes"] == 1 << 29
    assert (rec["first_eval_loss"], rec["last_eval_loss"]) == (4.0, 3.5)
    assert rec["optimizer_bytes"] == 88 and rec["predicted_peak_bytes"] == 1 << 30
    assert "peak_allocated_bytes" not in rec and "world_size" not in rec and "rank_peak_bytes" not in rec
    console = Console(width=200, record=True)
    for table in summary_tables(s):
        console.print(table)
    text = console.export_text()
    assert "peak RSS during steps" in text and "3.000" in text and "4.0000 → 3.5000" in text


def test_a_gpu_summary_compares_prediction_and_model_with_the_allocator_and_keeps_rank_peaks():
    mem = {"peak_allocated_bytes": [10 << 30, 12 << 30], "peak_reserved_bytes": [11 << 30, 13 << 30]}
    steps = [
        _step(
            1,
            peak_allocated_bytes=12 << 30,
            peak_reserved_bytes=13 << 30,
            alloc_retries=0,
            fragmentation_ratio=0.2,
            rank_memory=mem,
        ),
        _step(
            2,
            peak_allocated_bytes=12 << 30,
            peak_reserved_bytes=14 << 30,
            alloc_retries=1,
            fragmentation_ratio=0.4,
            fragmentation_at_peak=0.3,
            rank_memory=mem,
        ),
    ]
    s = summarize(steps, [], STATES, 0, "cuda", predicted_peak_bytes=12 << 30, modelled_reserved_bytes=14 << 30)
    rec = s.record()
    assert (rec["peak_allocated_bytes"], rec["peak_reserved_bytes"], rec["alloc_retries"]) == (12 << 30, 14 << 30, 1)
    assert rec["max_fragmentation_ratio"] == 0.4 and rec["fragmentation_at_peak"] == 0.3
    assert rec["modelled_peak_reserved_bytes"] == 14 << 30
    assert rec["rank_peak_bytes"] == [10 << 30, 12 << 30] and rec["peak_allocated_bytes_min_rank"] == 10 << 30
    console = Console(width=200, record=True)
    for table in summary_tables(s):
        console.print(table)
    text = console.export_text()
    assert "+0.0% vs allocated" in text and "+0.0% vs reserved" in text and "highest of 2 readings" in text
