"""memfit report's pages in a real browser: each kind renders without errors or network requests, shows its key
numbers in the DOM, and answers hover, click and sort; untrusted snapshot text stays text."""

import json
from pathlib import Path

import pytest
from support.browser import Opened, chromium_or_skip
from support.pages import HOSTILE, bench_dir, hostile_snapshot
from support.tiny import FIXTURES

from memfit.allocator.snapshot import analyze, load_snapshot
from memfit.cli import main
from memfit.train.loop import Trainer

H200 = FIXTURES / "h200-llama2-7b-lora-ffn-bf16pure-step3.pickle.gz"


@pytest.fixture(scope="module")
def browser():
    exe = chromium_or_skip()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=__import__("support.browser").browser.FLAGS)
        yield b
        b.close()


def write(*args: str) -> None:
    assert main(["report", *args]) == 0


def test_the_snapshot_page_shows_the_numbers_every_segment_and_the_frames_under_the_cursor(browser, tmp_path):
    out = tmp_path / "snapshot.html"
    write(str(H200), "--simulate", "--capacity", "141GiB", "--out", str(out))
    opened = Opened(browser, out)
    page = opened.page
    reserved = analyze(load_snapshot(H200), 0).reserved_bytes
    assert f"{reserved / 2**30:.3f} GiB" in page.inner_text("#numbers")
    assert page.locator(".seg").count() == 2 * 529
    assert page.locator(".uplot").count() == 2  # the timeline and the what-if curves
    hover = opened.hover_middle("timeline")
    assert "trace entry" in hover and page.locator("#timeline-hover ol.frames li").count() > 0
    assert "expandable_segments:True" in page.inner_text("#whatif")
    opened.screenshot("report-snapshot", tmp_path)
    opened.screenshot("report-snapshot-timeline", tmp_path, "#timeline-section")
    opened.assert_clean()


def test_markup_in_a_snapshot_is_shown_as_text_and_never_runs(browser, tmp_path):
    out = tmp_path / "hostile.html"
    write(str(hostile_snapshot(tmp_path)), "--out", str(out))
    opened = Opened(browser, out)
    assert HOSTILE in opened.hover_middle("timeline")
    assert opened.page.evaluate("document.scripts.length") == 2  # the data block and memfit's script, no more
    assert opened.page.locator("img").count() == 0
    opened.assert_clean()


def test_the_plan_page_sorts_and_breaks_down_the_row_clicked(browser, tmp_path):
    out = tmp_path / "plan.html"
    args = ["plan", "--model", "tiny", "--gpu-mem", "2GiB", "--seq-len", "128", "--global-batch", "4", "--lora"]
    assert main([*args, "--precision", "fp32", "--html", str(out)]) == 0
    opened = Opened(browser, out)
    page = opened.page
    rows = page.locator("#candidates tbody tr")
    assert (
        rows.count()
        == page.evaluate("JSON.parse(document.getElementById('memfit-data').textContent).candidates.length")
        > 1
    )
    assert page.locator("#breakdown table.plain tr").count() == 1 + 4  # header and the four phases
    page.locator("#candidates th", has_text="peak").first.click()
    peaks = [
        float(t)
        for t in page.locator("#candidates tbody tr td:nth-child(" + str(_column(page, "peak")) + ")").all_inner_texts()
    ]
    assert peaks == sorted(peaks)
    second = rows.nth(1)
    second.click()
    chosen = json.loads(
        page.evaluate(
            "JSON.stringify(JSON.parse(document.getElementById('memfit-data').textContent).candidates["
            + second.get_attribute("data-row")
            + "].label)"
        )
    )
    assert chosen in page.inner_text("#breakdown")
    opened.screenshot("report-plan", tmp_path)
    opened.assert_clean()


def _column(page, name: str) -> int:
    headers = page.locator("#candidates th").all_inner_texts()
    return [h.strip() for h in headers].index(name) + 1


def test_the_run_page_draws_loss_throughput_and_memory(browser, tiny_cfg, tmp_path):
    cfg = tiny_cfg("train.max_steps=4", "train.eval_every=2")
    Trainer(cfg).fit()
    run_dir = Path(cfg.output.dir)
    write(str(run_dir))
    opened = Opened(browser, run_dir / "report.html")
    page = opened.page
    assert page.locator(".uplot").count() == 3
    assert "step" in opened.hover_middle("loss")
    summary = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    assert f"{summary['peak_rss_bytes'] / 2**30:.3f} GiB" in page.inner_text("#summary")
    opened.screenshot("report-run", tmp_path)
    opened.assert_clean()


def test_the_bench_page_draws_memory_per_cell_and_the_pareto_front(browser, tmp_path):
    out = bench_dir(tmp_path)
    write(str(out))
    opened = Opened(browser, out / "report.html")
    page = opened.page
    assert page.locator("#cells tbody tr").count() == 3 and "oom" in page.inner_text("#cells")
    assert page.locator(".uplot").count() == 2
    opened.screenshot("report-bench", tmp_path)  # the table and the memory chart, before the hover scrolls
    assert "tokens/s" in opened.hover_middle("pareto")
    opened.assert_clean()
