"""DeepSpeed ZeRO as an engine: the user's DeepSpeed JSON, reconciled with memfit's config.

The JSON is taken as the user wrote it (e.g. the article's stage 2 with ``contiguous_gradients``,
``overlap_comm: false``, ``bf16`` and ``gradient_accumulation_steps: 4``). Every setting memfit
also has — micro batch, accumulation, global batch, ZeRO stage, precision, clipping, AdamW's
hyper-parameters — must agree with memfit's value or be absent / ``"auto"`` (then memfit's value is
filled in); a disagreement is an error naming both. memfit builds the AdamW optimizer and drives the
warmup + cosine schedule itself, so a ``scheduler`` section is refused and an ``optimizer`` section
only checked. DeepSpeed is an optional extra: ``pip install 'memfit[deepspeed]'``.

On CPU DeepSpeed needs ``DS_ACCELERATOR=cpu`` (the launcher sets it); the process group is the
one memfit started (gloo on CPU, nccl/RCCL on GPUs).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from memfit.config.loader import json_value, read_utf8
from memfit.config.schema import RunConfig
from memfit.errors import UserError, not_a_file
from memfit.strategies.precision import Precision

SUPPORTED_STAGES = (1, 2, 3)


def require_deepspeed():
    try:
        import deepspeed
    except ImportError:
        raise UserError(
            "distributed.engine deepspeed: DeepSpeed is not installed; install the extra with "
            "pip install 'memfit[deepspeed]' (or use distributed.engine=fsdp2)"
        ) from None
    return deepspeed


def resolve_ds_path(value: str) -> Path:
    """A DeepSpeed JSON path, or the name of one shipped in memfit's configs (e.g. ds-zero2-article)."""
    path = Path(value).expanduser()
    if path.is_file():
        return path
    from importlib import resources

    shipped = Path(str(resources.files("memfit") / "configs" / f"{Path(value).stem}.json"))
    if shipped.is_file():
        return shipped
    raise UserError(f"distributed.deepspeed_config: '{value}' {not_a_file(value)}; give a DeepSpeed JSON file")


def setting(d: dict, dotted: str) -> Any:
    """The value at a dotted key of a DeepSpeed config (``zero_optimization.stage``); None where a part is missing."""
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d


def _put(d: dict, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        d = d.setdefault(part, {})
    d[last] = value


def _agree(ds: dict, dotted: str, ours: Any, our_name: str, path: Path, verb: str = "is") -> None:
    """Fill ``dotted`` with ``ours`` where the JSON leaves it out or says ``auto``; refuse a different value, both
    written as JSON (``true``, not ``True``): ``{dotted} is {theirs} but {our_name} {verb} {ours}``."""
    theirs = setting(ds, dotted)
    if theirs is None or theirs == "auto":
        _put(ds, dotted, ours)
    elif theirs != ours and not (
        isinstance(ours, float)
        and isinstance(theirs, (int, float))
        and abs(theirs - ours) <= 1e-12 * max(1.0, abs(ours))
    ):
        raise UserError(
            f"{path}: {dotted} is {json.dumps(theirs)} but {our_name} {verb} {json.dumps(ours)}; make them agree (or "
            "drop it from the JSON)"
        )


OFFLOAD_DEVICES = ("none", "cpu", "nvme")  # DeepSpeed's OffloadDeviceEnum
DEPRECATED_OFFLOAD = {"offload_optimizer": "cpu_offload", "offload_param": "cpu_offload_param"}
"""The booleans DeepSpeed still reads in place of each offload section (device cpu where true)."""


def offloaded(ds: dict, where: str) -> tuple[bool, bool]:
    """Whether a DeepSpeed config offloads (the optimizer state, the parameters) to host memory:
    ``zero_optimization.offload_optimizer.device`` / ``offload_param.device`` ``cpu``, or the deprecated
    ``cpu_offload`` / ``cpu_offload_param`` true, as DeepSpeed reads them.

    Raises:
        UserError: for NVMe offloading, which memfit neither plans nor measures; a device DeepSpeed does not know;
            a deprecated boolean beside its section (DeepSpeed refuses the pair); a partial optimizer offload
            (``ratio`` below 1), which memfit plans as whole.
    """
    out = []
    for key, old in DEPRECATED_OFFLOAD.items():
        legacy = setting(ds, f"zero_optimization.{old}")
        if legacy is not None and setting(ds, f"zero_optimization.{key}") is not None:
            raise UserError(
                f"{where}: zero_optimization.{old} (deprecated) and zero_optimization.{key} together, which "
                f"DeepSpeed refuses; keep {key} alone"
            )
        if legacy is not None and not isinstance(legacy, bool):
            raise UserError(f"{where}: zero_optimization.{old} must be true or false (got {json.dumps(legacy)})")
        device = ("cpu" if legacy else "none") if legacy is not None else setting(ds, f"zero_optimization.{key}.device")
        if device is not None and device not in OFFLOAD_DEVICES:
            raise UserError(
                f"{where}: zero_optimization.{key}.device is {json.dumps(device)}; DeepSpeed takes "
                + " | ".join(OFFLOAD_DEVICES)
                + " (memfit plans cpu)"
            )
        if device == "nvme":
            raise UserError(f"{where}: zero_optimization.{key}.device nvme: memfit plans host memory only; use cpu")
        out.append(device == "cpu")
    ratio = setting(ds, "zero_optimization.offload_optimizer.ratio")
    if out[0] and ratio is not None and ratio != 1:
        raise UserError(
            f"{where}: zero_optimization.offload_optimizer.ratio {json.dumps(ratio)}: memfit plans and measures the "
            "whole optimizer state offloaded; set it to 1.0 or remove it"
        )
    return out[0], out[1]


def param_offload_ignored(stages: list[int]) -> str:
    """What a JSON's ``offload_param`` does below ZeRO-3 (at ``stages``): nothing (DeepSpeed hands it to stage 3's
    optimizer only), said where a plan or a run reads it, since the user asked for it."""
    where = f"stage {stages[0]}" if len(stages) == 1 else f"stages {', '.join(map(str, stages[:-1]))} and {stages[-1]}"
    return (
        f"zero_optimization.offload_param moves parameters at ZeRO-3 only; at {where} DeepSpeed ignores it and "
        "the parameters stay on the device (planned so)"
    )


def modern_offload_keys(ds: dict) -> None:
    """Each deprecated offload boolean in ``ds`` replaced by the section DeepSpeed reads it as (after ``offloaded``
    has checked them), so that memfit can fill the section in without DeepSpeed refusing the pair."""
    zero = ds.get("zero_optimization")
    for key, old in DEPRECATED_OFFLOAD.items():
        if isinstance(zero, dict) and zero.pop(old, None):
            zero[key] = {"device": "cpu"}


OBJECT_KEYS = (
    "zero_optimization",
    "zero_optimization.offload_optimizer",
    "zero_optimization.offload_param",
    "bf16",
    "fp16",
    "optimizer",
    "optimizer.params",
)
INTEGER_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")


def check_layout(ds: dict, where: str) -> None:
    """Refuse a DeepSpeed config whose sections memfit reads are not JSON objects, or whose batch sizes are neither
    whole numbers nor "auto", before anything reads them.

    Raises:
        UserError: naming the key, what it holds and what it must be.
    """
    for key in OBJECT_KEYS:
        value = setting(ds, key)
        if value is not None and not isinstance(value, dict):
            raise UserError(f"{where}: {key} must be a JSON object (got {json.dumps(value)})")
    for key in INTEGER_KEYS:
        value = setting(ds, key)
        if value not in (None, "auto") and not _whole(value):
            raise UserError(f'{where}: {key} must be a whole number >= 1 or "auto" (got {json.dumps(value)})')


def _whole(value: Any) -> bool:
    """A whole number >= 1 (JSON's true is not one)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def read_ds(path: Path) -> dict[str, Any]:
    """The user's DeepSpeed JSON as a dict, its layout checked (``check_layout``).

    Raises:
        UserError: unreadable JSON, not an object, or a section of the wrong type.
    """
    try:
        ds = json_value(read_utf8(path, "distributed.deepspeed_config", "save it as UTF-8 JSON"))
    except json.JSONDecodeError as e:
        raise UserError(f"distributed.deepspeed_config: cannot read '{path}' as JSON ({e})") from None
    if not isinstance(ds, dict):
        raise UserError(f"distributed.deepspeed_config: '{path}' must hold a JSON object")
    check_layout(ds, str(path))
    return ds


def reconcile(path: Path, cfg: RunConfig, precision: Precision, world_size: int, accum: int) -> dict[str, Any]:
    """The DeepSpeed config to run: the user's JSON with memfit's values filled in where absent.

    ``optimizer.offload=true`` offloads the optimizer to the CPU where the JSON does not say (and a JSON that
    offloads offloads, whatever memfit's config says).

    Raises:
        UserError: unreadable JSON, a value that disagrees with memfit's config (naming both), a
            ``scheduler`` section, or a ZeRO stage this engine does not run.
    """
    ds = copy.deepcopy(read_ds(path))
    t, o = cfg.train, cfg.optimizer
    optimizer_off, _ = offloaded(ds, str(path))  # and refused here where memfit cannot run it
    modern_offload_keys(ds)
    if o.offload and not optimizer_off:
        _agree(ds, "zero_optimization.offload_optimizer.device", "cpu", "optimizer.offload true", path, "means")
    _agree(ds, "train_micro_batch_size_per_gpu", t.micro_batch_size, "train.micro_batch_size", path)
    _agree(ds, "gradient_accumulation_steps", accum, "train.grad_accum_steps (derived)", path)
    _agree(
        ds, "train_batch_size", world_size * t.micro_batch_size * accum, "world size x micro-batch x accumulation", path
    )
    _agree(ds, "zero_optimization.stage", cfg.distributed.zero_stage, "distributed.zero_stage", path)
    _agree(ds, "gradient_clipping", o.grad_clip, "optimizer.grad_clip", path)
    if precision.name == "bf16-pure":
        raise UserError(
            "strategy.precision bf16-pure: DeepSpeed keeps fp32 master weights; use bf16-mixed with engine deepspeed"
        )
    ours = f"strategy.precision {precision.name}"
    _agree(ds, "bf16.enabled", precision.name == "bf16-mixed", ours, path, "means")
    _agree(ds, "fp16.enabled", precision.name == "fp16-mixed", ours, path, "means")
    if "scheduler" in ds:
        raise UserError(
            f"{path}: has a 'scheduler' section ({setting(ds, 'scheduler.type')}) but memfit drives the LR with "
            f"optimizer.warmup_steps={o.warmup_steps} and a cosine decay; remove the section"
        )
    if "optimizer" in ds:
        kind = str(setting(ds, "optimizer.type") or "").lower()
        if kind not in ("adam", "adamw"):
            raise UserError(
                f"{path}: optimizer.type is {kind!r} but memfit trains with AdamW; use AdamW or remove the section"
            )
        _agree(ds, "optimizer.params.lr", o.lr, "optimizer.lr", path)
        _agree(ds, "optimizer.params.betas", [o.beta1, o.beta2], "optimizer.beta1/beta2", path)
        _agree(ds, "optimizer.params.eps", o.eps, "optimizer.eps", path)
        _agree(ds, "optimizer.params.weight_decay", o.weight_decay, "optimizer.weight_decay", path)
        del ds["optimizer"]  # checked; memfit passes the same AdamW as a client optimizer
    stage = ds["zero_optimization"]["stage"]
    if stage not in SUPPORTED_STAGES:
        raise UserError(
            f"{path}: zero_optimization.stage {stage}: memfit runs DeepSpeed ZeRO 1, 2 and 3; "
            "for plain data parallelism use distributed.engine=fsdp2 distributed.zero_stage=0 (DDP)"
        )
    ds.setdefault("zero_allow_untested_optimizer", True)  # torch's AdamW as the client optimizer
    if offloaded(ds, str(path))[0]:  # ... stepping DeepSpeed's host partitions (not its C++ CPU Adam, built apart)
        ds.setdefault("zero_force_ds_cpu_optimizer", False)
    ds.setdefault("steps_per_print", 10**9)
    return ds


@contextlib.contextmanager
def _collectives_over_gloo():
    """On CPU, DeepSpeed's communication backend over the gloo group memfit started, without its shared-memory
    all-reduce extension: that is a C++ build on a run's first use (per installation; minutes on a 2-core VM), and its
    bf16 kernel needs AVX-512 (without it the kernel faults and the other ranks hang on its flags, as DeepSpeed's
    own comment says). DeepSpeed has no setting for it: its module-level builder answers "none" meanwhile."""
    try:  # the submodule (the package's own attribute ``torch`` is the torch library)
        comm = importlib.import_module("deepspeed.comm.torch")
    except ImportError:
        comm = None
    if os.environ.get("DS_ACCELERATOR") != "cpu" or not hasattr(comm, "build_shm_op"):
        yield
        return
    built, comm.build_shm_op = comm.build_shm_op, lambda: None
    try:
        yield
    finally:
        comm.build_shm_op = built


def initialize(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ds_config: dict[str, Any]):
    """``deepspeed.initialize`` on memfit's model and AdamW; returns the engine."""
    deepspeed = require_deepspeed()
    # DeepSpeed's own calls of a collective that newer torch deprecates: nothing a user can change, once per rank
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.* is deprecated", category=FutureWarning)
    with _collectives_over_gloo():
        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=ds_config, dist_init_required=False
        )
    return engine


def gathered(module: torch.nn.Module):
    """Context in which every rank holds ``module``'s full parameters: DeepSpeed ZeRO-3 partitions
    them (``ds_tensor``) between forward passes; a no-op for any other model. Collective: all ranks enter."""
    params = [p for p in module.parameters() if hasattr(p, "ds_tensor")]
    if not params:
        return contextlib.nullcontext()
    return require_deepspeed().zero.GatheredParameters(params, modifier_rank=None)


def ds_writer(engine):
    def write(tmp: Path) -> None:
        engine.save_checkpoint(str(tmp), tag="deepspeed", save_latest=False)

    return write


@contextlib.contextmanager
def weights_only_loads(engine):
    """DeepSpeed's checkpoint engine, while a checkpoint is read, loading each file weights-only (its own loader
    unpickles with ``weights_only=False``: any code a file carries would run), with ``DS_CHECKPOINT_GLOBALS``."""
    from memfit.safe_files import DS_CHECKPOINT_GLOBALS, read_torch

    allowed = []
    for dotted in DS_CHECKPOINT_GLOBALS:
        module, name = dotted.rsplit(".", 1)
        allowed.append(getattr(importlib.import_module(module), name))
    checkpoint_engine = engine.checkpoint_engine
    unsafe, own = checkpoint_engine.load, "load" in vars(checkpoint_engine)

    def load(path, map_location=None):
        with torch.serialization.safe_globals(allowed):
            return read_torch(Path(path), map_location=map_location)

    checkpoint_engine.load = load
    try:
        yield
    finally:
        if own:
            checkpoint_engine.load = unsafe
        else:  # the class's method again
            del checkpoint_engine.load


def ds_reader(engine):
    def read(path: Path) -> None:
        # DeepSpeed reads its own files with its own loader, each file weights-only
        with weights_only_loads(engine):
            loaded, _ = engine.load_checkpoint(
                str(path), tag="deepspeed", load_optimizer_states=True, load_lr_scheduler_states=False
            )
        if loaded is None:
            raise UserError(f"checkpoint {path}: DeepSpeed could not load its files; the directory is damaged")

    return read
