"""Parse and check caching-allocator settings strings (``PYTORCH_CUDA_ALLOC_CONF`` and friends).

The grammar is PyTorch's: comma-separated ``key:value`` pairs (``c10/cuda/CUDAAllocatorConfig.cpp``).
``check`` turns a string into settings plus errors (what PyTorch would reject or misread) and warnings
(what it accepts but ignores on this platform).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from memfit.errors import UserError, did_you_mean

KNOWN_KEYS = (
    "backend",
    "max_split_size_mb",
    "roundup_power2_divisions",
    "garbage_collection_threshold",
    "expandable_segments",
    "release_lock_on_cudamalloc",
    "release_lock_on_hipmalloc",
    "pinned_use_cuda_host_register",
    "pinned_use_hip_host_register",
    "pinned_num_register_threads",
    "pinned_use_background_threads",
    "per_process_memory_fraction",
)
BACKENDS = ("native", "cudaMallocAsync", "hipMallocAsync")
ENV_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")


@dataclass
class AllocConf:
    settings: dict[str, str] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def rocm_version(hip: str | None) -> tuple[int, int] | None:
    """``torch.version.hip`` such as ``6.2.41133-dd7f95766`` -> (6, 2); None on CUDA/CPU builds."""
    if not hip:
        return None
    m = re.match(r"(\d+)\.(\d+)", hip)
    return (int(m.group(1)), int(m.group(2))) if m else None


def torch_release(version: str | None) -> tuple[int, int] | None:
    """``torch.__version__`` such as ``2.11.0+rocm7.1`` or ``2.12.0.dev20260401`` -> (2, 11); None when unknown."""
    m = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def check_version_flags(hip: str | None, torch_version: str | None) -> None:
    """Refuse a ``--hip-version`` or ``--torch-version`` that names no release (judged as unknown, it was ignored).

    Raises:
        UserError: naming the flag and the value.
    """
    if hip is not None and rocm_version(hip) is None:
        raise UserError(f"--hip-version must look like 6.2 or 6.2.41133 (got {hip!r})")
    if torch_version is not None and torch_release(torch_version) is None:
        raise UserError(f"--torch-version must look like 2.11 or 2.12.0+rocm7.1 (got {torch_version!r})")


def expandable_takes_effect(hip: str | None, torch_version: str | None) -> tuple[bool | None, str]:
    """Whether ``expandable_segments:True`` takes effect on a build: (True | False | None where it depends on how
    the build was made, why). CUDA builds have had it since PyTorch 2.1. On ROCm it follows PyTorch's history:

    - before 2.11: not in ROCm builds (the allocator ignores the setting);
    - 2.11: PyTorch's 2.11 branch predates the reland on main (pytorch #173330, reverted, relanded as #177974 on
      2026-03-20); AMD's ``release/2.11`` builds carry it (ROCm/pytorch #3106). Which one is installed is not
      visible in the version string: ``memfit doctor`` on the GPU probes it;
    - 2.12 on: taken on ROCm >= 7.0 (``ROCM_VERSION < 70000`` gate, pytorch #179930; the gate it replaced,
      #179781's ``TORCH_HIP_VERSION < 702``, disabled it below 7.2 in nightlies of 2026-04-09 only).
    """
    if not hip:
        return True, ""
    rocm, release = rocm_version(hip), torch_release(torch_version)
    on = f"ROCm {rocm[0]}.{rocm[1]}" if rocm else f"ROCm {hip}"
    if release is None:
        return None, f"expandable_segments on {on} depends on the PyTorch release (2.12+ with ROCm >= 7.0)"
    if release < (2, 11):
        version = f"{release[0]}.{release[1]}"
        return False, f"expandable_segments is ignored by ROCm builds of PyTorch {version} (needs 2.11+)"
    if release == (2, 11):
        return None, (
            f"expandable_segments on PyTorch 2.11 with {on} depends on the build: AMD's release/2.11 builds take it "
            "(ROCm/pytorch #3106), PyTorch's own predate it; memfit doctor on the GPU probes it"
        )
    if rocm is None or rocm < (7, 0):
        return False, f"expandable_segments is ignored on {on} (PyTorch 2.12+ takes it on ROCm >= 7.0, pytorch #179930)"
    return True, ""


UNSAFE_ON_ROCM = (
    "max_split_size_mb with expandable_segments:True on ROCm made reserved memory climb to the device limit "
    "(pytorch #123548, reproduced on torch 2.12/2.13 with ROCm 7.2 and 7.14) and was reported to read back zeros from "
    "a live allocation (ROCm #6603); drop max_split_size_mb"
)


def unsafe_combination(settings: dict[str, str], hip: str | None) -> str | None:
    """Why a set of allocator settings is unsafe on this build (``UNSAFE_ON_ROCM``), or None."""
    both = settings.get("expandable_segments", "").lower() == "true" and "max_split_size_mb" in settings
    return UNSAFE_ON_ROCM if both and hip else None


def _is_bool(v: str) -> bool:
    return v in ("True", "False", "true", "false")


def _check_value(key: str, value: str, conf: AllocConf) -> None:
    if key == "backend" and value not in BACKENDS:
        conf.errors.append(f"backend must be one of {', '.join(BACKENDS)} (got '{value}')")
    elif key == "max_split_size_mb":
        if not value.isdigit() or int(value) <= 20:
            conf.errors.append(f"max_split_size_mb must be an integer > 20 (MB) (got '{value}')")
    elif key == "garbage_collection_threshold":
        try:
            ok = 0.0 < float(value) < 1.0
        except ValueError:
            ok = False
        if not ok:
            conf.errors.append(f"garbage_collection_threshold must be a number in (0, 1) (got '{value}')")
    elif key == "per_process_memory_fraction":
        try:
            ok = 0.0 < float(value) <= 1.0
        except ValueError:
            ok = False
        if not ok:
            conf.errors.append(f"per_process_memory_fraction must be in (0, 1] (got '{value}')")
    elif key == "roundup_power2_divisions":
        entries = value.strip("[]").split(",") if value.startswith("[") else [value]
        for entry in entries:
            n = entry.split(":")[-1] if ":" in entry else entry
            if not n.isdigit() or (int(n) & (int(n) - 1)) != 0:
                conf.errors.append(
                    f"roundup_power2_divisions must be a power of two or a [size:divisions,...] list (got '{value}')"
                )
                break
    elif key in (
        "expandable_segments",
        "release_lock_on_cudamalloc",
        "release_lock_on_hipmalloc",
        "pinned_use_cuda_host_register",
        "pinned_use_hip_host_register",
        "pinned_use_background_threads",
    ):
        if not _is_bool(value):
            conf.errors.append(f"{key} must be True or False (got '{value}')")
    elif key == "pinned_num_register_threads" and not value.isdigit():
        conf.errors.append(f"pinned_num_register_threads must be an integer (got '{value}')")


def split_pairs(text: str) -> list[str]:
    """The ``key:value`` items of a settings string; a bracketed list (roundup_power2_divisions) stays whole."""
    return [p.strip() for p in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", text) if p.strip()]


def parse(text: str) -> AllocConf:
    """Split and validate one settings string (no platform knowledge)."""
    conf = AllocConf()
    for raw in split_pairs(text):
        key, sep, value = raw.partition(":")
        key, value = key.strip(), value.strip()
        if not sep or not value:
            conf.errors.append(f"'{raw}' must look like key:value")
            continue
        if key not in KNOWN_KEYS:
            conf.errors.append(f"unknown key '{key}'{did_you_mean(key, KNOWN_KEYS)}")
            continue
        conf.settings[key] = value
        _check_value(key, value, conf)
    return conf


def check(text: str, hip: str | None, memory_fraction_set: bool = False, torch_version: str | None = None) -> AllocConf:
    """Validate ``text`` for a build (``hip`` = ``torch.version.hip``, None for CUDA/CPU; ``torch_version`` =
    ``torch.__version__``) and warn about settings the platform ignores or that are unsafe on it."""
    conf = parse(text)
    s, rocm = conf.settings, rocm_version(hip)
    if s.get("expandable_segments", "").lower() == "true":
        takes, why = expandable_takes_effect(hip, torch_version)
        if not takes:
            conf.warnings.append(why)
    unsafe = unsafe_combination(s, hip)
    if unsafe:
        conf.warnings.append(unsafe)
    if "garbage_collection_threshold" in s and not (memory_fraction_set or "per_process_memory_fraction" in s):
        conf.warnings.append(
            "garbage_collection_threshold only acts when a memory fraction is set "
            "(torch.cuda.set_per_process_memory_fraction / memfit allocator.memory_fraction)"
        )
    if s.get("backend") == "cudaMallocAsync" and rocm is not None:
        conf.warnings.append("backend cudaMallocAsync on a ROCm build: use hipMallocAsync")
    if "expandable_segments" in s and s.get("backend", "native") != "native":
        conf.warnings.append("expandable_segments applies to the native backend only")
    return conf


INVENTED_KNOBS = {
    "PYTORCH_ROCM_ALLOCATOR": "not read by PyTorch; use PYTORCH_HIP_ALLOC_CONF (backend:native or hipMallocAsync, "
    "expandable_segments, max_split_size_mb, garbage_collection_threshold)",
    "HSA_AMD_SDMA_MAX_WG_SIZE": "not a ROCm variable; HSA_ENABLE_SDMA=0/1 toggles the SDMA copy engines",
    "HSA_QUEUE_PRIORITY": "not a ROCm variable; set stream priority with torch.cuda.Stream(priority=-1)",
    "PYTORCH_ROC_ALLOW_TF32": "not read by PyTorch; use torch.backends.cuda.matmul.allow_tf32 / "
    "torch.set_float32_matmul_precision (MI210 has no TF32)",
    "ROCM_ENABLE_FLASH_SDP": "not read by PyTorch; use torch.backends.cuda.enable_flash_sdp / "
    "torch.nn.attention.sdpa_kernel "
    "(on ROCm also torch.backends.cuda.preferred_rocm_fa_library)",
}
