"""What this platform is and whether its memory settings will do what they say.

Reports the torch build (CUDA, ROCm/HIP or CPU), devices (memory, architecture: ``gcnArchName`` on
ROCm, compute capability on CUDA, the NUMA node each sits on), bf16/fp16/TF32 support, collective backends,
optional extras, the NUMA nodes (``memfit.telemetry.numa``), and
the allocator settings from the environment, parsed and checked for this build; and it recognises the
invented knobs of the source article, naming the real equivalent.
"""

from __future__ import annotations

import importlib.util
import os
import platform
from typing import Any

import torch

from memfit.allocator import conf as alloc_conf
from memfit.telemetry.numa import gpu_numa_node, numa_nodes

EXTRAS = {"deepspeed": "deepspeed", "amdsmi": "amdsmi", "nvidia-ml-py": "pynvml"}


def _tf32(props, hip: str | None) -> bool:
    if hip:  # ROCm: xf32 through hipBLASLt on MI300 (gfx94x); MI200 (gfx90a) has none
        return getattr(props, "gcnArchName", "").startswith("gfx94")
    return props.major >= 8


def devices(hip: str | None) -> list[dict[str, Any]]:
    out = []
    if not torch.cuda.is_available():
        return out
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append(
            {
                "index": i,
                "name": p.name,
                "memory_bytes": p.total_memory,
                "arch": getattr(p, "gcnArchName", "") if hip else f"sm_{p.major}{p.minor}",
                "bf16": torch.cuda.is_bf16_supported(including_emulation=False)
                if i == torch.cuda.current_device()
                else None,
                "fp16": True,
                "tf32": _tf32(p, hip),
                "numa_node": gpu_numa_node(p),
            }
        )
    return out


_THIS_BUILD: Any = object()


PROBE_BLOCKS, PROBE_MIB = 4, 20
_PROBE = f"""
import json, torch
held = [torch.empty({PROBE_MIB} << 20, dtype=torch.uint8, device="cuda") for _ in range({PROBE_BLOCKS})]
torch.cuda.synchronize()
segments = [s for s in torch.cuda.memory_snapshot() if s.get("device", 0) == torch.cuda.current_device()]
keys = ("total_size", "segment_type", "is_expandable")
print(json.dumps([{{k: s.get(k) for k in keys}} for s in segments]))
"""


def probe_expandable(timeout_s: float = 120.0) -> list[dict[str, Any]] | None:
    """The device's segments after a fresh process, started with ``expandable_segments:True``, allocated
    PROBE_BLOCKS blocks of PROBE_MIB MiB (``memory_snapshot()``; read by ``judge_expandable_probe``); None when
    the probe could not run."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in alloc_conf.ENV_VARS}
    env["PYTORCH_HIP_ALLOC_CONF" if torch.version.hip else "PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=timeout_s
        )
        return json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else None
    except (subprocess.TimeoutExpired, ValueError, IndexError, OSError):
        return None


def judge_expandable_probe(segments: list[dict[str, Any]]) -> tuple[bool | None, str]:
    """Whether the probe's allocations went into one expandable segment (taken) or one segment each (ignored)."""
    large = [s for s in segments if s.get("segment_type") != "small"]
    what = f"{PROBE_BLOCKS} allocations of {PROBE_MIB} MiB"
    if any(s.get("is_expandable") for s in large) or (
        len(large) == 1 and int(large[0].get("total_size") or 0) >= PROBE_BLOCKS * PROBE_MIB << 20
    ):
        return True, f"live probe: {what} share one expandable segment"
    if len(large) >= PROBE_BLOCKS:
        return False, f"live probe: {what} took {len(large)} segments, none expandable: the setting was ignored"
    return None, f"live probe inconclusive ({len(large)} large segments for {what})"


def report(
    env: dict[str, str] | None = None,
    hip: Any = _THIS_BUILD,
    cuda: Any = _THIS_BUILD,
    torch_version: Any = _THIS_BUILD,
    probe: Any = _THIS_BUILD,
) -> dict[str, Any]:
    """Everything doctor knows, as plain data.

    Args:
        env: environment to inspect (default: this process's).
        hip, cuda, torch_version: ``torch.version.hip`` / ``.cuda`` / ``torch.__version__`` of the build to judge
            settings for (default: this build's); tests pass recorded values of ROCm builds here.
        probe: the segments ``probe_expandable`` read (default: probed when a GPU is visible; tests pass
            recorded ones).
    """
    env = dict(os.environ) if env is None else env
    hip = torch.version.hip if hip is _THIS_BUILD else hip
    torch_version = torch.__version__ if torch_version is _THIS_BUILD else torch_version
    if probe is _THIS_BUILD:
        probe = probe_expandable() if torch.cuda.is_available() else None
    cuda = torch.version.cuda if cuda is _THIS_BUILD else cuda
    build = f"ROCm/HIP {hip}" if hip else (f"CUDA {cuda}" if cuda else "CPU only")
    problems: list[str] = []
    warnings: list[str] = []
    allocator: dict[str, Any] = {}
    for var in alloc_conf.ENV_VARS:
        if var not in env:
            continue
        if var == "PYTORCH_HIP_ALLOC_CONF" and not hip:
            warnings.append(f"{var} is set but this is not a ROCm build: it is not read; use PYTORCH_CUDA_ALLOC_CONF")
        conf = alloc_conf.check(env[var], hip, torch_version=torch_version)
        allocator[var] = {
            "value": env[var],
            "settings": conf.settings,
            "errors": conf.errors,
            "warnings": conf.warnings,
        }
        problems += [f"{var}: {e}" for e in conf.errors]
        warnings += [f"{var}: {w}" for w in conf.warnings]
    shadowed = [v for v in alloc_conf.ENV_VARS[1:] if v in env and "PYTORCH_ALLOC_CONF" in env]
    if shadowed:
        warnings.append(
            f"{' and '.join(shadowed)} not read: PYTORCH_ALLOC_CONF is set and PyTorch reads only it; "
            "put every allocator setting there"
        )
    takes, why = alloc_conf.expandable_takes_effect(hip, torch_version)
    expandable: dict[str, Any] = {"expected": takes, "why": why or None, "probed": None}
    if probe is not None:
        probed, seen = judge_expandable_probe(probe)
        expandable.update(probed=probed, probe=seen)
        if probed is not None and takes is not None and probed != takes:
            warnings.append(f"expandable_segments: {seen}, unlike what this build's versions say ({why or 'taken'})")
    asked = any(
        alloc_conf.parse(env[v]).settings.get("expandable_segments", "").lower() == "true"
        for v in alloc_conf.ENV_VARS
        if v in env
    )
    if asked and expandable["probed"] is False:
        warnings.append(f"expandable_segments:True is set but {expandable['probe']}")
    if allocator and not torch.cuda.is_available():
        warnings.append("allocator settings are set but there is no GPU: they have no effect on CPU")
    for knob, real in alloc_conf.INVENTED_KNOBS.items():
        if knob in env:
            warnings.append(f"{knob} is set: {real}")
    return {
        "torch": torch.__version__,
        "build": build,
        "hip": hip,
        "cuda": cuda if not hip else None,
        "python": platform.python_version(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "devices": devices(hip),
        "collectives": {
            "nccl" if not hip else "rccl (nccl)": torch.distributed.is_nccl_available(),
            "gloo": torch.distributed.is_gloo_available(),
        },
        "extras": {name: importlib.util.find_spec(mod) is not None for name, mod in EXTRAS.items()},
        "numa_nodes": [n.as_dict() for n in numa_nodes()],
        "allocator": allocator,
        "expandable_segments": expandable,
        "warnings": warnings,
        "problems": problems,
    }
