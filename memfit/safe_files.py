"""Reading checkpoint files without running code from them.

A checkpoint directory may come from anywhere (copied from a shared disk, a colleague, a download), and its
manifest's checksums only say the files are the ones written beside it. Every pickle memfit reads on resume goes
through a restricted loader:

- ``torch.save`` files (optimizer, scheduler, RNG states): ``torch.load(weights_only=True)``, its refusal one line;
- ``torch.distributed.checkpoint`` (FSDP2 / DDP / ZeRO-1 runs): its ``.metadata`` is a plain pickle that DCP's reader
  unpickles as it is, and its non-tensor entries (the optimizer's hyperparameters) are unpickled with
  ``weights_only=False``: ``check_dcp_metadata`` reads the first through an unpickler that knows DCP's own metadata
  classes only, and ``SafeLoadPlanner`` reads each entry weights-only before DCP does;
- DeepSpeed's files: ``deepspeed_engine.weights_only_loads`` (its checkpoint engine loads with ``weights_only=False``).

Several ranks first scan what they will load (``vet_checkpoint``), so that a refusal is one line, said by rank 0.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import BytesStorageMetadata, CheckpointException, DefaultLoadPlanner

from memfit.errors import UserError, first_line

UNREADABLE = (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, AttributeError, ImportError, OSError)
"""What a load of a file torch or memfit did not write raises (torch's weights-only refusal is an UnpicklingError)."""

DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
PLAIN_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by its name
    ("pathlib", "PosixPath"),  # the checkpoint's path in its StorageMeta
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


DS_CHECKPOINT_GLOBALS = (
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
"""The Python objects DeepSpeed's ZeRO checkpoints hold beside tensors and plain values (the stage, the loss
scaler, the fp32 partitions' fragment addresses): allowed to its weights-only loads, nothing else."""


def refusal(path: Path, e: BaseException) -> UserError:
    """The one line for a checkpoint file (``step_NNNNNNN/...``) that cannot be read safely or whole."""
    text = str(e).split("WeightsUnpickler error:")[-1].strip()  # torch's own advice before it: load unsafely
    reason = first_line(Exception(text.split(" was not an allowed global")[0]))  # ... and after it: allowlist it
    checkpoint = next((p for p in path.parents if p.name.startswith("step_")), path.parent)
    return UserError(
        f"checkpoint {checkpoint.name}: {path.relative_to(checkpoint)} cannot be read safely ({reason}); memfit loads "
        f"only tensors and plain values from a checkpoint, never code: move {checkpoint} away to resume from the "
        "checkpoint before it"
    )


def vet_checkpoint(checkpoint: Path, allowed: tuple[str, ...] = ()) -> None:
    """Every pickle under ``checkpoint`` scanned, none loaded: ``torch.save`` files may name only the globals
    ``torch.load(weights_only=True)`` allows and ``allowed``, DCP's ``.metadata`` only its own classes. Cheap (no
    tensor is read), so every rank runs it before a collective load, where one rank's refusal would leave the
    others waiting on it.

    Raises:
        UserError: the first file that needs more, or is not a torch file at all.
    """
    for path in sorted(p for p in checkpoint.rglob("*") if p.is_file()):
        if path.name == ".metadata":
            _vet_dcp_entries(path.parent, check_dcp_metadata(path.parent))
        elif path.suffix == ".pt":
            try:
                unsafe = sorted(set(torch.serialization.get_unsafe_globals_in_checkpoint(path)) - set(allowed))
            except UNREADABLE as e:
                raise refusal(path, e) from None
            if unsafe:
                raise refusal(path, pickle.UnpicklingError(f"Unsupported global: {', '.join(unsafe)}"))


def read_torch(path: Path, **kwargs: Any) -> Any:
    """``torch.load(path, weights_only=True, **kwargs)``, a refusal or a damaged file as one line.

    Raises:
        UserError: the file needs a Python object beyond tensors and plain values, or is not whole.
    """
    try:
        return torch.load(path, weights_only=True, **kwargs)
    except UNREADABLE as e:
        raise refusal(path, e) from None


class _DcpMetadataUnpickler(pickle.Unpickler):
    """DCP's metadata classes (data classes and enums of its own modules), dtypes and the few plain types a
    ``.metadata`` holds; anything else, a function above all, is refused."""

    def find_class(self, module: str, name: str) -> Any:
        found = super().find_class(module, name) if module in DCP_MODULES or module == "torch" else None
        own = isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum))
        if (module in DCP_MODULES and own) or (module == "torch" and isinstance(found, torch.dtype)):
            return found
        if (module, name) in PLAIN_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"Unsupported global: {module}.{name}")


def check_dcp_metadata(checkpoint: Path) -> Any:
    """The ``.metadata`` of a DCP checkpoint, refused where it needs more than DCP's own metadata to unpickle (before
    DCP's reader unpickles it without restriction).

    Raises:
        UserError: naming the file and the Python object it asked for.
    """
    path = checkpoint / ".metadata"
    try:
        return _DcpMetadataUnpickler(io.BytesIO(path.read_bytes())).load()
    except UNREADABLE as e:
        raise refusal(path, e) from None


def _weights_only(data: bytes, where: Path) -> None:
    """Refuse ``data`` (one ``torch.save`` payload) unless it loads weights-only."""
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except UNREADABLE as e:
        raise refusal(where, e) from None


def _vet_dcp_entries(checkpoint: Path, metadata: Any) -> None:
    """Each non-tensor entry of a DCP checkpoint (``metadata`` its ``.metadata``, checked) read weights-only from
    its ``.distcp`` file, as ``SafeLoadPlanner`` reads it during the load. Entries written through DCP's stream
    transforms (compression; memfit writes none) are left to the planner, which sees them decoded."""
    entries = getattr(metadata, "state_dict_metadata", None)
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise refusal(checkpoint / ".metadata", ValueError("not the metadata of a DCP checkpoint"))
    for index, info in storage.items():
        if not isinstance(entries.get(getattr(index, "fqn", None)), BytesStorageMetadata):
            continue
        if getattr(info, "transform_descriptors", None):
            continue
        path = checkpoint / str(getattr(info, "relative_path", ""))
        where = path / f"entry {index.fqn}"
        if path.resolve().parent != checkpoint.resolve() or not path.is_file():
            raise refusal(where, ValueError(f"no file {path.name} in the checkpoint"))
        with path.open("rb") as f:
            f.seek(int(info.offset))
            _weights_only(f.read(int(info.length)), where)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, each non-tensor entry first read weights-only: DCP unpickles them with
    ``weights_only=False``."""

    def __init__(self, checkpoint: Path) -> None:
        super().__init__()
        self.checkpoint = checkpoint  # named in a refusal

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        data = value.read()
        _weights_only(data, self.checkpoint / f"entry {read_item.dest_index.fqn}")
        super().load_bytes(read_item, io.BytesIO(data))


def load_dcp(state: dict[str, Any], checkpoint: Path) -> None:
    """``dcp.load(state, checkpoint_id=checkpoint)`` through ``check_dcp_metadata`` and ``SafeLoadPlanner``.

    Raises:
        UserError: a file or an entry that cannot be read safely (DCP wraps it in its CheckpointException).
    """
    check_dcp_metadata(checkpoint)
    try:
        dcp.load(state, checkpoint_id=checkpoint, planner=SafeLoadPlanner(checkpoint))
    except CheckpointException as e:
        for failure in e.failures.values():
            cause = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(cause, UserError):
                raise cause from None
        raise
