"""Parse and check caching-allocator settings strings (``PYTORCH_CUDA_ALLOC_CONF`` and friends).

The grammar is PyTorch's: comma-separated ``key:value`` pairs (``c10/cuda/CUDAAllocatorConfig.cpp``).
``check`` turns a string into settings plus errors (what PyTorch would reject or misread) and warnings
(what it accepts but ignores on this platform).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from memfit.errors import did_you_mean

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


def check(text: str, hip: str | None, memory_fraction_set: bool = False) -> AllocConf:
    """Validate ``text`` for a build (``hip`` = ``torch.version.hip``, None for CUDA/CPU) and warn
    about settings the platform ignores."""
    conf = parse(text)
    s, rocm = conf.settings, rocm_version(hip)
    if s.get("expandable_segments", "").lower() == "true" and rocm is not None and rocm < (7, 0):
        conf.warnings.append(
            f"expandable_segments:True is ignored on ROCm {rocm[0]}.{rocm[1]} (needs ROCm >= 7.0 and a recent PyTorch)"
        )
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
