"""The machine's NUMA topology, read from sysfs: the nodes (their CPUs and memory) and the node each GPU's PCI
device sits on, for ``memfit doctor`` and ``memfit train --numa-binding``.

Linux only (``/sys/devices/system/node``, ``/sys/bus/pci/devices/<address>/numa_node``); elsewhere, or where the
kernel does not say, the answers are empty or None, never guessed. A device's ``numa_node`` of -1 means the
firmware gives it no affinity (common on single-socket machines and in VMs).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

SYSFS = Path("/sys")


@dataclass(frozen=True)
class NumaNode:
    index: int
    cpus: str  # the kernel's cpulist, e.g. "0-31,64-95"
    memory_bytes: int | None  # MemTotal of the node, None where unreadable

    def as_dict(self) -> dict:
        return {"index": self.index, "cpus": self.cpus, "memory_bytes": self.memory_bytes}


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def numa_nodes(sysfs: Path = SYSFS) -> list[NumaNode]:
    """The online NUMA nodes with their CPUs and memory (empty where sysfs has no node directory)."""
    root = sysfs / "devices" / "system" / "node"
    indices = sorted(int(p.name[4:]) for p in root.glob("node*") if p.name[4:].isdigit())
    out = []
    for i in indices:
        node = root / f"node{i}"
        meminfo = _read(node / "meminfo") or ""
        total = re.search(r"MemTotal:\s+(\d+)\s*kB", meminfo)
        out.append(NumaNode(i, _read(node / "cpulist") or "", int(total.group(1)) * 1024 if total else None))
    return out


def pci_address(domain: int, bus: int, device: int) -> str:
    """The sysfs name of a PCI device's function 0, e.g. ``0000:41:00.0``."""
    return f"{domain:04x}:{bus:02x}:{device:02x}.0"


def pci_numa_node(address: str, sysfs: Path = SYSFS) -> int | None:
    """The NUMA node a PCI device sits on; None where the kernel gives it none (-1) or the device is unknown."""
    text = _read(sysfs / "bus" / "pci" / "devices" / address.lower() / "numa_node")
    if text is None or not re.fullmatch(r"-?\d+", text):
        return None
    node = int(text)
    return node if node >= 0 else None


def gpu_numa_node(props, sysfs: Path = SYSFS) -> int | None:
    """The NUMA node of a visible GPU from its device properties (``torch.cuda.get_device_properties``: the PCI
    domain, bus and device ids CUDA and ROCm builds both report); None where they are not reported."""
    ids = [getattr(props, f"pci_{k}_id", None) for k in ("domain", "bus", "device")]
    if any(v is None for v in ids):
        return None
    return pci_numa_node(pci_address(*ids), sysfs)
