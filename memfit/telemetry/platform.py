"""What this platform is and whether its memory settings will do what they say.

Reports the torch build (CUDA, ROCm/HIP or CPU), devices (memory, architecture: ``gcnArchName`` on
ROCm, compute capability on CUDA), bf16/fp16/TF32 support, collective backends, optional extras, and
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
            }
        )
    return out


_THIS_BUILD: Any = object()


def report(env: dict[str, str] | None = None, hip: Any = _THIS_BUILD, cuda: Any = _THIS_BUILD) -> dict[str, Any]:
    """Everything doctor knows, as plain data.

    Args:
        env: environment to inspect (default: this process's).
        hip, cuda: ``torch.version.hip`` / ``.cuda`` of the build to judge settings for (default:
            this build's); tests pass recorded values of ROCm builds here.
    """
    env = dict(os.environ) if env is None else env
    hip = torch.version.hip if hip is _THIS_BUILD else hip
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
        conf = alloc_conf.check(env[var], hip)
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
        "allocator": allocator,
        "warnings": warnings,
        "problems": problems,
    }
