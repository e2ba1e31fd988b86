"""Device utilisation from the driver packages, tested with recorded answers (no GPU here): the exporter serves
compute and memory-bandwidth utilisation per device from amdsmi or NVML, a value a device does not give is absent
(never zero), and the trainer's step record reads the same through torch.cuda for its own device."""

import importlib.machinery
import types

import pytest
import torch
from support.scrape import scrape

from memfit.telemetry import readings
from memfit.telemetry.prometheus import serve_exporter

GIB = 1 << 30


def _module(name: str, **attrs) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__spec__ = importlib.machinery.ModuleSpec(name, None)
    m.__dict__.update(attrs)
    return m


def _amdsmi(activities: list):
    """amdsmi as ROCm 6.x answers: handles, VRAM in bytes, activity in percent ('N/A' where a device has none)."""

    class AmdSmiException(Exception):
        pass

    def activity(h):
        if isinstance(activities[h], Exception):
            raise AmdSmiException("AMDSMI_STATUS_NOT_SUPPORTED")
        return activities[h]

    return _module(
        "amdsmi",
        AmdSmiException=AmdSmiException,
        AmdSmiMemoryType=types.SimpleNamespace(VRAM=0),
        amdsmi_init=lambda: None,
        amdsmi_shut_down=lambda: None,
        amdsmi_get_processor_handles=lambda: list(range(len(activities))),
        amdsmi_get_gpu_memory_total=lambda h, kind: 64 * GIB,
        amdsmi_get_gpu_memory_usage=lambda h, kind: (h + 1) * GIB,
        amdsmi_get_gpu_activity=activity,
    )


def _pynvml(rates: list):
    class NVMLError(Exception):
        pass

    def utilization(h):
        if rates[h] is None:
            raise NVMLError("Not Supported")
        gpu, memory = rates[h]
        return types.SimpleNamespace(gpu=gpu, memory=memory)

    return _module(
        "pynvml",
        NVMLError=NVMLError,
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: len(rates),
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=141 * GIB, used=(h + 2) * GIB),
        nvmlDeviceGetName=lambda h: b"NVIDIA H200",
        nvmlDeviceGetUtilizationRates=utilization,
    )


def _served(monkeypatch, name: str, module: types.ModuleType) -> dict:
    monkeypatch.setitem(__import__("sys").modules, name, module)
    if name == "pynvml":  # the exporter prefers amdsmi where both are installed
        monkeypatch.setattr(importlib.util, "find_spec", _hide("amdsmi", importlib.util.find_spec))
    server, backend = serve_exporter(0)
    try:
        assert backend == {"amdsmi": "amdsmi", "pynvml": "nvml"}[name]
        return scrape(server.server_port)
    finally:
        server.shutdown()


def _hide(hidden: str, find_spec):
    return lambda name, *a: None if name == hidden else find_spec(name, *a)


def _by_device(samples) -> dict[str, float]:
    return {s.labels["device"]: s.value for s in samples}


def test_amdsmi_gfx_and_umc_activity_are_served_and_a_missing_value_is_absent(monkeypatch):
    activities = [
        {"gfx_activity": 91, "umc_activity": 37, "mm_activity": 0},
        {"gfx_activity": "N/A", "umc_activity": 12, "mm_activity": "N/A"},  # amdsmi's spelling of no value
        RuntimeError(),  # the call itself not supported
    ]
    got = _served(monkeypatch, "amdsmi", _amdsmi(activities))
    compute = _by_device(got["memfit_device_compute_utilization_ratio"])
    bandwidth = _by_device(got["memfit_device_memory_bandwidth_utilization_ratio"])
    assert compute == {"0": pytest.approx(0.91)}
    assert bandwidth == {"0": pytest.approx(0.37), "1": pytest.approx(0.12)}
    assert _by_device(got["memfit_device_memory_used_bytes"]) == {"0": GIB, "1": 2 * GIB, "2": 3 * GIB}


def test_nvml_utilization_rates_are_served_and_an_unsupported_device_is_absent(monkeypatch):
    got = _served(monkeypatch, "pynvml", _pynvml([(88, 41), None, (0, 0)]))
    compute = _by_device(got["memfit_device_compute_utilization_ratio"])
    bandwidth = _by_device(got["memfit_device_memory_bandwidth_utilization_ratio"])
    assert compute == {"0": pytest.approx(0.88), "2": 0.0} and bandwidth == {"0": pytest.approx(0.41), "2": 0.0}
    assert {s.labels["name"] for s in got["memfit_device_memory_total_bytes"]} == {"NVIDIA H200"}


def test_the_step_record_reads_utilization_through_torch_and_leaves_out_what_it_cannot(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "utilization", lambda device=None: 73)
    monkeypatch.setattr(torch.cuda, "memory_usage", lambda device=None: 25)
    assert readings.device_utilization(cuda) == {
        "gpu_compute_utilization": pytest.approx(0.73),
        "gpu_memory_bandwidth_utilization": pytest.approx(0.25),
    }

    def no_driver(device=None):
        raise ModuleNotFoundError("pynvml does not seem to be installed or it can't be imported.")

    monkeypatch.setattr(torch.cuda, "memory_usage", no_driver)
    assert readings.device_utilization(cuda) == {"gpu_compute_utilization": pytest.approx(0.73)}
