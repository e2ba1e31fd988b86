"""NUMA: the topology doctor shows, read from a recorded sysfs tree (a two-socket server), and torchrun's
--numa-binding passed on or refused in one line."""

from types import SimpleNamespace

import pytest

from memfit.cli import main
from memfit.commands.doctor import numa_line
from memfit.config.loader import load_config
from memfit.distributed.launch import LaunchSpec, check_numa_binding, torchrun_args, torchrun_numa_modes
from memfit.errors import UserError
from memfit.telemetry.numa import gpu_numa_node, numa_nodes, pci_address, pci_numa_node


@pytest.fixture
def two_sockets(tmp_path):
    """sysfs of a two-node server: node 0 with CPUs 0-31,64-95 and 512 GiB, node 1 with 32-63,96-127 and 512 GiB;
    a GPU at 0000:41:00.0 on node 0, one at 0000:c1:00.0 on node 1, a NIC with no affinity (-1)."""
    nodes = tmp_path / "devices" / "system" / "node"
    for i, cpus in enumerate(("0-31,64-95", "32-63,96-127")):
        d = nodes / f"node{i}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
        (d / "meminfo").write_text(f"Node {i} MemTotal:       536870912 kB\nNode {i} MemFree:        1000 kB\n")
    (nodes / "possible").write_text("0-1\n")
    for address, node in (("0000:41:00.0", "0"), ("0000:c1:00.0", "1"), ("0000:05:00.0", "-1")):
        dev = tmp_path / "bus" / "pci" / "devices" / address
        dev.mkdir(parents=True)
        (dev / "numa_node").write_text(node + "\n")
    return tmp_path


def test_nodes_and_the_node_of_each_gpu_from_sysfs(two_sockets):
    nodes = numa_nodes(two_sockets)
    assert [(n.index, n.cpus, n.memory_bytes) for n in nodes] == [
        (0, "0-31,64-95", 512 << 30),
        (1, "32-63,96-127", 512 << 30),
    ]
    assert pci_address(0, 0xC1, 0) == "0000:c1:00.0"
    assert pci_numa_node("0000:41:00.0", two_sockets) == 0 and pci_numa_node("0000:C1:00.0", two_sockets) == 1
    assert pci_numa_node("0000:05:00.0", two_sockets) is None  # -1: no affinity
    assert pci_numa_node("0000:99:00.0", two_sockets) is None  # no such device
    gpu = SimpleNamespace(pci_domain_id=0, pci_bus_id=0xC1, pci_device_id=0)
    assert gpu_numa_node(gpu, two_sockets) == 1
    assert gpu_numa_node(SimpleNamespace(), two_sockets) is None  # a build that does not report PCI ids
    line = numa_line([n.as_dict() for n in nodes])
    assert line == "2 node(s): node 0: CPUs 0-31,64-95, 512 GiB; node 1: CPUs 32-63,96-127, 512 GiB"
    assert numa_nodes(two_sockets / "nowhere") == [] and "no NUMA information" in numa_line([])


def test_numa_binding_is_passed_to_torchrun_or_refused_in_one_line(tmp_path):
    cfg = load_config(None, [f"output.dir={tmp_path}", "train.device=cuda"])
    args = torchrun_args(LaunchSpec(8, numa_binding="node"), cfg, tmp_path / "c.yaml", [])
    assert args[args.index("--numa-binding") + 1] == "node"
    assert "--numa-binding" not in torchrun_args(LaunchSpec(8), cfg, tmp_path / "c.yaml", [])
    modes = ("node", "socket", "exclusive", "core-complex")
    check_numa_binding("socket", "cuda", modes)
    with pytest.raises(UserError, match=r"--numa-binding must be node \| socket \| exclusive \| core-complex"):
        check_numa_binding("nodes", "cuda", modes)
    with pytest.raises(UserError, match="torchrun has no --numa-binding; bind by hand with `numactl"):
        check_numa_binding("node", "cuda", ())
    with pytest.raises(UserError, match="this run has no GPU"):
        check_numa_binding("node", "cpu", modes)
    assert torchrun_numa_modes() is None or "node" in torchrun_numa_modes()  # this torch's, whichever it is


def test_numa_binding_errors_on_the_command_line(capsys):
    assert main(["train", "tiny-cpu", "--numa-binding", "node"]) == 2
    assert "give --nproc-per-node too" in capsys.readouterr().err
    assert main(["train", "tiny-cpu", "--numa-binding", "node", "--nproc-per-node", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "this run has no GPU" in err and len(err.splitlines()) == 1
