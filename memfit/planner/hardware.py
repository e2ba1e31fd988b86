"""GPU presets for the planner: memory, bf16 support, peak dense bf16 rate, intra-node bandwidth.

Figures are the vendors' datasheet numbers (dense, no sparsity); ``link_GBps`` is the per-GPU
bandwidth of the intra-node fabric (NVLink / Infinity Fabric / PCIe) used for collectives; ``host_GBps``
the assumed host-device copy bandwidth each way (PCIe generation of the usual server: Gen5 for MI300X and
H100/H200 SXM, Gen3 for V100 and T4, Gen4 otherwise; an MI250X in Frontier-like nodes has 36 GB/s per GCD
over Infinity Fabric, not assumed); ``memory_GBps`` the device memory's bandwidth.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from memfit.errors import UserError, did_you_mean
from memfit.units import GIB, MIB


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_bytes: int
    bf16: bool
    peak_tflops: float  # dense bf16 (fp16 where there is no bf16)
    link_GBps: float
    vendor: str
    host_GBps: float = 25.0  # host<->device copies, each way: ~80% of PCIe x16 (Gen3 12, Gen4 25, Gen5 50 GB/s)
    fp32_slowdown: float = 4.0  # fp32 matmuls against the bf16 peak (TF32 on NVIDIA ~2x, MI200 fp32 matrix ~4x)
    memory_GBps: float = 2039.0  # device memory bandwidth (HBM, datasheet): casts, gradient sums and AdamW read it

    @property
    def is_cpu(self) -> bool:
        """The planned device is this machine's CPU (``memfit plan --device cpu``): one memory, no allocator."""
        return self.vendor == "cpu"


GPUS: dict[str, Gpu] = {
    g.name: g
    for g in (
        Gpu("mi210", 64 * GIB, True, 181.0, 100.0, "amd", memory_GBps=1638.0),
        Gpu("mi250x", 128 * GIB, True, 383.0, 200.0, "amd", memory_GBps=3277.0),
        Gpu("mi300x", 192 * GIB, True, 1307.0, 448.0, "amd", 50.0, memory_GBps=5300.0),
        Gpu("a100-40g", 40 * GIB, True, 312.0, 300.0, "nvidia", memory_GBps=1555.0),
        Gpu("a100-80g", 80 * GIB, True, 312.0, 300.0, "nvidia", memory_GBps=2039.0),
        Gpu("h100", 80 * GIB, True, 989.0, 450.0, "nvidia", 50.0, memory_GBps=3350.0),
        Gpu("h200", 141 * GIB, True, 989.0, 450.0, "nvidia", 50.0, memory_GBps=4800.0),
        Gpu("l40s", 48 * GIB, True, 362.0, 32.0, "nvidia", memory_GBps=864.0),
        Gpu("rtx4090", 24 * GIB, True, 165.0, 32.0, "nvidia", memory_GBps=1008.0),
        Gpu("v100-32g", 32 * GIB, False, 125.0, 150.0, "nvidia", 12.0, memory_GBps=900.0),
        Gpu("t4", 16 * GIB, False, 65.0, 16.0, "nvidia", 12.0, memory_GBps=320.0),
    )
}


def gpu_preset(name: str) -> Gpu:
    key = name.lower()
    if key not in GPUS:
        raise UserError(
            f"--gpu: unknown GPU '{name}'{did_you_mean(key, GPUS)}; known: {', '.join(GPUS)}, or give --gpu-mem 64GiB"
        )
    return GPUS[key]


def custom_gpu(memory_bytes: int, bf16: bool = True) -> Gpu:
    """A GPU known only by its memory (rates of an A100 assumed for ranking; stated in the output)."""
    a100 = GPUS["a100-80g"]
    return Gpu(
        f"custom-{memory_bytes / GIB:.4g}GiB" if memory_bytes >= GIB else f"custom-{memory_bytes / MIB:.4g}MiB",
        memory_bytes,
        bf16,
        a100.peak_tflops,
        a100.link_GBps,
        "unknown",
        a100.host_GBps,
        memory_GBps=a100.memory_GBps,
    )


_NAMED = (  # a device's marketing name (torch.cuda.get_device_properties(i).name) to its preset, first match wins
    (r"h200", "h200"),
    (r"h100", "h100"),
    (r"a100", "a100"),
    (r"mi300x", "mi300x"),
    (r"mi250x?", "mi250x"),
    (r"mi210", "mi210"),
    (r"l40s", "l40s"),
    (r"4090", "rtx4090"),
    (r"v100", "v100-32g"),
    (r"\bt4\b", "t4"),
)


def device_preset(name: str, memory_bytes: int, bf16: bool) -> Gpu:
    """The preset whose name the device's name carries (``NVIDIA H200`` -> h200, ``AMD Instinct MI210`` -> mi210;
    an A100 by its memory), with the device's own name, memory and bf16 support; else ``custom_gpu`` (A100 rates)."""
    for pattern, key in _NAMED:
        if re.search(pattern, name, re.IGNORECASE):
            if key == "a100":
                key = "a100-80g" if memory_bytes > 48 * GIB else "a100-40g"
            return replace(GPUS[key], name=name, memory_bytes=memory_bytes, bf16=bf16)
    return replace(custom_gpu(memory_bytes, bf16), name=name)


def cpu_device(memory_bytes: int) -> Gpu:
    """The CPU as ``memfit plan --device cpu`` plans for it: ``memory_bytes`` of host memory, no link (one process;
    the collectives of a trainer's gloo ranks are not charged, see ``cost.step_time_s``), and a rate for ranking only
    (1 TFLOP/s, fp32 as fast as bf16: a CPU without bf16 matrix units computes bf16 no faster; memory traffic not
    charged, see ``cost.memory_traffic_s``)."""
    return Gpu("cpu", memory_bytes, True, 1.0, 0.0, "cpu", 0.0, 1.0, memory_GBps=0.0)
