"""Prometheus endpoints: the trainer's own ``memfit_*`` metrics, and ``memfit exporter``'s per-device
memory and utilisation for a node (amdsmi on AMD, nvidia-ml-py on NVIDIA, else torch's view of the GPUs (memory
only), else the host's memory, so it runs anywhere). Both bind 127.0.0.1 unless told otherwise."""

from __future__ import annotations

import errno
import importlib.util
import socket
import threading
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Gauge, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily

from memfit.units import meminfo, process_rss_bytes

# step-record key -> (metric name, help)
TRAINER_METRICS = {
    "rank": ("memfit_rank", "global rank of the process serving these metrics (0 on one process)"),
    "allocated_bytes": ("memfit_allocated_bytes", "bytes in active allocator blocks now"),
    "reserved_bytes": ("memfit_reserved_bytes", "bytes the caching allocator holds now"),
    "peak_allocated_bytes": ("memfit_peak_allocated_bytes", "peak allocated bytes during the last step"),
    "peak_reserved_bytes": ("memfit_peak_reserved_bytes", "peak reserved bytes during the last step"),
    "peak_active_bytes": ("memfit_active_bytes", "peak active bytes (allocated + awaiting free) in the last step"),
    "fragmentation_ratio": ("memfit_fragmentation_ratio", "1 - largest free block / external free"),
    "largest_free_block_bytes": ("memfit_largest_free_block_bytes", "largest inactive block"),
    "fragmentation_at_peak": (
        "memfit_fragmentation_at_peak_ratio",
        "fragmentation at the peak of the step whose allocator trace was recorded (train.snapshot_at_step)",
    ),
    "alloc_retries": ("memfit_alloc_retries", "allocations that needed the cache freed first (cumulative)"),
    "ooms": ("memfit_ooms", "out-of-memory errors raised by the allocator (cumulative)"),
    "step_time_s": ("memfit_step_time_seconds", "wall time of the last optimizer step"),
    "tokens_per_s": ("memfit_tokens_per_second", "input tokens per second in the last step"),
    "gpu_compute_utilization": (
        "memfit_gpu_compute_utilization_ratio",
        "this rank's GPU: fraction of the driver's last sample period a kernel ran (torch.cuda.utilization: NVML "
        "utilization.gpu, amdsmi gfx_activity), read at the end of the last step",
    ),
    "gpu_memory_bandwidth_utilization": (
        "memfit_gpu_memory_bandwidth_utilization_ratio",
        "this rank's GPU: fraction of the last sample period device memory was read or written "
        "(torch.cuda.memory_usage: NVML utilization.memory, amdsmi umc_activity), read at the end of the last step",
    ),
    "supervised_tokens_per_s": (
        "memfit_supervised_tokens_per_second",
        "tokens that take a loss per second in the last step (this rank's times the world size)",
    ),
    "loss": ("memfit_loss", "training loss of the last step"),
    "restarts": ("memfit_restarts", "fresh-process restarts of this run so far (train.restart_on, train.on_oom)"),
    "step": ("memfit_step", "optimizer steps done"),
    "rss_bytes": ("memfit_process_rss_bytes", "resident set size of the trainer process (CPU runs)"),
}

KERNEL_METRICS = {
    "self_time_s": (
        "memfit_kernel_self_seconds",
        "self time of the top kernels (CPU ops on a CPU) in the last profiled step (train.kernel_profile_every)",
    ),
    "share": ("memfit_kernel_step_share_ratio", "the kernel's self time as a fraction of the profiled step's time"),
}
"""Labelled by kernel name: the last profile's top ``TOP_KERNELS`` and ``other``."""


LISTEN_BACKLOG = 1024
"""Connections the kernel queues while the server accepts: socketserver's default of 5 made 99 of 200 concurrent
scrapes wait out SYN retries (30-60 s); the kernel caps it at ``net.core.somaxconn``."""


class _ScrapeServer(ThreadingMixIn, WSGIServer):
    """A thread per scrape (as prometheus_client's own server), with a listen backlog for hundreds at once."""

    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # a scrape per second would flood the training display
        pass


def listen_error(e: OSError, host: str, port: int, host_key: str, port_key: str) -> str:
    """The one line for a server that cannot listen: the host's fault (no such name or not an address here) or the
    port's (taken, privileged)."""
    if isinstance(e, socket.gaierror) or e.errno == errno.EADDRNOTAVAIL:
        return f"{host_key} {host}: not an address of this machine ({e.strerror}); use 127.0.0.1, or 0.0.0.0 for all"
    return f"{port_key} {port}: cannot listen on {host} ({e.strerror}); pick a free port, or 0 for any"


def _at_metrics(app):
    """``app`` at /metrics (Prometheus's default path); / names it, any other path is 404 (prometheus_client's app
    answers every path, so a scrape job with a mistyped path got the metrics as if it were right). HEAD answers as GET
    does, without the body (prometheus_client's app answers it 405)."""

    def routed(environ, start_response):
        if environ.get("REQUEST_METHOD") == "HEAD":
            # GET's status and headers without its body (curl -I, health checks)
            answered = []
            body = b"".join(routed(dict(environ, REQUEST_METHOD="GET"), lambda *a: answered.append(a)))
            status, headers = answered[0][:2]
            if not any(k.lower() == "content-length" for k, _ in headers):
                headers = [*headers, ("Content-Length", str(len(body)))]
            start_response(status, headers)
            return []
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return app(environ, start_response)
        status, body = (
            ("200 OK", b"memfit metrics: /metrics\n")
            if path == "/"
            else ("404 Not Found", b"not found; memfit serves /metrics\n")
        )
        start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
        return [body]

    return routed


def metrics_url(host: str, port: int) -> str:
    """Where a scraper finds the metrics served on ``host``: an IPv6 literal goes in brackets (RFC 3986)."""
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"


def serve_registry(registry: CollectorRegistry, port: int, host: str = "127.0.0.1") -> WSGIServer:
    """Serve ``registry`` at ``http://host:port/metrics`` from a daemon thread; returns the server (its
    ``server_port`` is the bound port, for port 0; ``shutdown()`` then ``server_close()`` stop it)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    server_class = type("ScrapeServer", (_ScrapeServer,), {"address_family": family})
    server = make_server(host, port, _at_metrics(make_wsgi_app(registry)), server_class, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name=f"metrics:{server.server_port}", daemon=True).start()
    return server


class TrainerMetrics:
    """Gauges the trainer updates from each step record, served over HTTP on request."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.gauges = {key: Gauge(name, doc, registry=self.registry) for key, (name, doc) in TRAINER_METRICS.items()}
        self.kernels = {
            key: Gauge(name, doc, ["kernel"], registry=self.registry) for key, (name, doc) in KERNEL_METRICS.items()
        }
        self._server = None

    def update(self, record: dict[str, Any]) -> None:
        for key, gauge in self.gauges.items():
            if key in record and record[key] is not None:
                gauge.set(float(record[key]))
        if "kernels" in record:  # the last profile's top kernels only: the label set stays bounded
            for key, gauge in self.kernels.items():
                gauge.clear()
                for k in record["kernels"]:
                    gauge.labels(kernel=k["name"]).set(k[key])

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Start the endpoint in a background thread; returns the bound port (useful with port 0)."""
        self._server = serve_registry(self.registry, port, host)
        return self._server.server_port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


@dataclass(frozen=True)
class DeviceReading:
    """One device at scrape time. Utilisations are fractions of the last sample period (0..1), None where the
    source does not say (then no sample is served, never a zero)."""

    label: str
    name: str
    total_bytes: int
    used_bytes: int
    compute: float | None = None  # NVML utilization.gpu | amdsmi gfx_activity
    memory_bandwidth: float | None = None  # NVML utilization.memory | amdsmi umc_activity


def _percent(value: Any) -> float | None:
    """A percentage as a fraction; None for what a source gives where it has no value ('N/A', out of range)."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v / 100 if 0 <= v <= 100 else None


UTILISATION = {
    "compute": (
        "memfit_device_compute_utilization_ratio",
        "fraction of the last sample period the device's compute engines were busy (NVML utilization.gpu, as "
        "DCGM_FI_DEV_GPU_UTIL / 100; amdsmi gfx_activity, as the AMD exporter's gpu_gfx_activity / 100)",
    ),
    "memory_bandwidth": (
        "memfit_device_memory_bandwidth_utilization_ratio",
        "fraction of the last sample period device memory was being read or written (NVML utilization.memory, as "
        "DCGM_FI_DEV_MEM_COPY_UTIL / 100; amdsmi umc_activity, the memory controllers, as gpu_umc_activity / 100)",
    ),
}


class DeviceMemoryCollector:
    """Collects per-device memory and utilisation at scrape time from the best source available."""

    def __init__(self) -> None:
        self.backend = self._pick()

    @staticmethod
    def _pick() -> str:
        if importlib.util.find_spec("amdsmi") is not None:
            return "amdsmi"
        if importlib.util.find_spec("pynvml") is not None:
            return "nvml"
        import torch

        return "torch" if torch.cuda.is_available() else "host"

    def _devices(self) -> list[DeviceReading]:
        if self.backend == "amdsmi":
            import amdsmi

            amdsmi.amdsmi_init()
            try:
                out = []
                for i, h in enumerate(amdsmi.amdsmi_get_processor_handles()):
                    total = amdsmi.amdsmi_get_gpu_memory_total(h, amdsmi.AmdSmiMemoryType.VRAM)
                    used = amdsmi.amdsmi_get_gpu_memory_usage(h, amdsmi.AmdSmiMemoryType.VRAM)
                    try:
                        activity = amdsmi.amdsmi_get_gpu_activity(h)
                    except amdsmi.AmdSmiException:
                        activity = {}
                    compute, bandwidth = _percent(activity.get("gfx_activity")), _percent(activity.get("umc_activity"))
                    out.append(DeviceReading(str(i), "amd-gpu", int(total), int(used), compute, bandwidth))
                return out
            finally:
                amdsmi.amdsmi_shut_down()
        if self.backend == "nvml":
            import pynvml

            pynvml.nvmlInit()
            try:
                out = []
                for i in range(pynvml.nvmlDeviceGetCount()):
                    h = pynvml.nvmlDeviceGetHandleByIndex(i)
                    info = pynvml.nvmlDeviceGetMemoryInfo(h)
                    name = pynvml.nvmlDeviceGetName(h)
                    try:
                        rates = pynvml.nvmlDeviceGetUtilizationRates(h)
                        compute, bandwidth = _percent(rates.gpu), _percent(rates.memory)
                    except pynvml.NVMLError:  # not supported on this device (some vGPUs, MIG instances)
                        compute = bandwidth = None
                    name = name.decode() if isinstance(name, bytes) else name
                    out.append(DeviceReading(str(i), name, int(info.total), int(info.used), compute, bandwidth))
                return out
            finally:
                pynvml.nvmlShutdown()
        if self.backend == "torch":
            import torch

            out = []
            for i in range(torch.cuda.device_count()):
                free, total = torch.cuda.mem_get_info(i)
                out.append(DeviceReading(str(i), torch.cuda.get_device_name(i), int(total), int(total - free)))
            return out
        info = meminfo()
        return [DeviceReading("host", "host-memory", info["MemTotal"], info["MemTotal"] - info["MemAvailable"])]

    def collect(self):
        labels = ["device", "name", "source"]
        total = GaugeMetricFamily("memfit_device_memory_total_bytes", "device memory capacity", labels=labels)
        used = GaugeMetricFamily(
            "memfit_device_memory_used_bytes", "device memory in use (all processes)", labels=labels
        )
        busy = {key: GaugeMetricFamily(name, doc, labels=labels) for key, (name, doc) in UTILISATION.items()}
        for d in self._devices():
            total.add_metric([d.label, d.name, self.backend], d.total_bytes)
            used.add_metric([d.label, d.name, self.backend], d.used_bytes)
            for key, family in busy.items():
                if getattr(d, key) is not None:
                    family.add_metric([d.label, d.name, self.backend], getattr(d, key))
        yield total
        yield used
        yield from busy.values()
        rss = GaugeMetricFamily("memfit_exporter_rss_bytes", "resident memory of the exporter itself")
        rss.add_metric([], process_rss_bytes())
        yield rss


def serve_exporter(port: int, host: str = "127.0.0.1") -> tuple[Any, str]:
    """Start ``memfit exporter``'s endpoint; returns (server, backend)."""
    registry = CollectorRegistry()
    collector = DeviceMemoryCollector()
    registry.register(collector)
    return serve_registry(registry, port, host), collector.backend


__all__ = ["DeviceMemoryCollector", "TrainerMetrics", "serve_exporter"]
