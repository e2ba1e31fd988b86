"""Real HTTP endpoints on loopback, scraped and parsed with prometheus_client's text parser."""

import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from support.scrape import scrape
from support.tiny import REPO

from memfit.telemetry.prometheus import DeviceMemoryCollector, TrainerMetrics, metrics_url, serve_exporter
from memfit.train.loop import Trainer


def test_trainer_metrics_endpoint_serves_every_gauge():
    m = TrainerMetrics()
    port = m.serve(0)
    try:
        m.update(
            {
                "loss": 2.5,
                "step": 7,
                "tokens_per_s": 1234.5,
                "peak_allocated_bytes": 1 << 30,
                "fragmentation_ratio": 0.42,
                "fragmentation_at_peak": 0.17,
            }
        )
        got = scrape(port)
        assert got["memfit_loss"][0].value == 2.5 and got["memfit_step"][0].value == 7
        assert got["memfit_tokens_per_second"][0].value == 1234.5
        assert got["memfit_peak_allocated_bytes"][0].value == 1 << 30
        assert got["memfit_fragmentation_ratio"][0].value == 0.42
        assert got["memfit_fragmentation_at_peak_ratio"][0].value == 0.17
        assert {
            "memfit_reserved_bytes",
            "memfit_alloc_retries",
            "memfit_ooms",
            "memfit_step_time_seconds",
            "memfit_largest_free_block_bytes",
            "memfit_active_bytes",
        } <= set(got)
        home = urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10).read().decode()
        assert home == "memfit metrics: /metrics\n"
        with pytest.raises(urllib.error.HTTPError, match="404"):  # a scrape job's mistyped path is not answered
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metric", timeout=10)
        head = urllib.request.urlopen(
            urllib.request.Request(f"http://127.0.0.1:{port}/metrics", method="HEAD"), timeout=10
        )
        assert head.status == 200 and int(head.headers["Content-Length"]) > 1000 and head.read() == b""
        assert head.headers["Content-Type"].startswith("text/plain")
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/metric", method="HEAD"), timeout=10)
    finally:
        m.close()


def test_trainer_binds_loopback_and_exports_its_steps(tiny_cfg):
    trainer = Trainer(tiny_cfg("train.metrics_port=0", "train.max_steps=3"))
    try:
        result = trainer.fit()
        got = scrape(trainer.metrics_port)
        assert got["memfit_step"][0].value == 3
        assert got["memfit_loss"][0].value == pytest.approx(result.steps[-1]["loss"])
        assert got["memfit_process_rss_bytes"][0].value > 0
        assert trainer.metrics._server.server_address[0] == "127.0.0.1"
    finally:
        trainer.close()


def test_exporter_falls_back_to_host_memory_here():
    server, backend = serve_exporter(0)
    try:
        assert backend == DeviceMemoryCollector._pick()
        got = scrape(server.server_port)
        totals = got["memfit_device_memory_total_bytes"]
        assert totals and all(s.value > 0 for s in totals)
        used = got["memfit_device_memory_used_bytes"]
        assert all(0 < u.value <= t.value for u, t in zip(used, totals))
        if backend == "host":
            assert totals[0].labels == {"device": "host", "name": "host-memory", "source": "host"}
    finally:
        server.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.integration
def test_memfit_exporter_command_serves_until_stopped():
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "memfit.cli", "exporter", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 60
        while True:
            try:
                got = scrape(port)
                break
            except OSError:
                assert proc.poll() is None and time.time() < deadline, (
                    proc.stderr.read() if proc.poll() is not None else "timeout"
                )
                time.sleep(0.2)
        assert "memfit_device_memory_total_bytes" in got
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_address_printed_for_an_ipv6_bind_is_one_a_scraper_can_use():
    """``--host ::1`` printed ``http://::1:PORT/metrics``, which no client parses; the literal goes in brackets."""
    assert metrics_url("127.0.0.1", 9400) == "http://127.0.0.1:9400/metrics"
    metrics = TrainerMetrics()
    try:
        port = metrics.serve(0, "::1")
    except OSError as e:
        pytest.skip(f"no IPv6 loopback here: {e}")
    try:
        metrics.update({"loss": 1.5})
        with urllib.request.urlopen(metrics_url("::1", port), timeout=30) as r:
            assert "memfit_" in r.read().decode()
    finally:
        metrics.close()


def test_grafana_dashboard_uses_only_metrics_we_serve():
    import json
    import re

    from memfit.telemetry.prometheus import TRAINER_METRICS, UTILISATION

    dash = json.loads((REPO / "deploy/grafana/memfit-dashboard.json").read_text())
    served = {name for name, _ in (*TRAINER_METRICS.values(), *UTILISATION.values())} | {
        "memfit_device_memory_used_bytes",
        "memfit_device_memory_total_bytes",
    }
    used = {m for p in dash["panels"] for t in p["targets"] for m in re.findall(r"memfit_[a-z_]+", t["expr"])}
    assert used and used <= served, used - served


@pytest.mark.parametrize("server", ["trainer", "exporter"])
def test_two_hundred_concurrent_scrapes_all_answer(server):
    """200 scrapes released at once on loopback (socketserver's backlog of 5 made a quarter of them wait out SYN
    retries past any scrape timeout): every one answers with the metrics, well within a scrape timeout."""
    if server == "trainer":
        metrics = TrainerMetrics()
        port, stop = metrics.serve(0), metrics.close
    else:
        httpd, _ = serve_exporter(0)
        port = httpd.server_port

        def stop():
            httpd.shutdown()
            httpd.server_close()

    released = threading.Barrier(200)

    def one(_):
        released.wait()
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()

    try:
        with ThreadPoolExecutor(200) as pool:
            bodies = list(pool.map(one, range(200)))
    finally:
        stop()
    name = "memfit_step" if server == "trainer" else "memfit_exporter_rss_bytes"
    assert len(bodies) == 200 and all(name in body for body in bodies)
