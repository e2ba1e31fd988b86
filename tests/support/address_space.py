"""Address-space caps (RLIMIT_AS) for the tests that run a real CPU out-of-memory: set above what a fresh memfit
process maps once torch is imported, which depends on the torch build. The caps were found on the CPU build, whose
process maps 0.77 GiB there; a CUDA build of torch maps its libraries too (3.3 GiB with torch 2.11+cu130 on a machine
without a GPU), and a fixed cap then stops the process before its first step, out of memory or not."""

import functools
import subprocess
import sys

CPU_BUILD_BASELINE = 785 << 20
"""What a fresh Python maps after importing memfit's trainer with the CPU build of torch 2.13 (0.767 GiB)."""


@functools.cache
def baseline_bytes() -> int:
    """Address space a fresh Python maps once it has imported memfit's trainer and CLI, with this torch."""
    code = "import memfit.cli, memfit.train.loop; from memfit.units import statm_bytes; print(statm_bytes()[0])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    return int(done.stdout.split()[-1])


def address_space_cap(on_the_cpu_build: int) -> int:
    """``on_the_cpu_build`` (a cap found with the CPU build) moved by what this torch maps beyond that build."""
    return on_the_cpu_build + max(0, baseline_bytes() - CPU_BUILD_BASELINE)
