"""Atomic run checkpoints, resume, and the final Hugging Face export.

A checkpoint is a directory ``checkpoints/step_NNNNNNN/`` holding
    trainable.safetensors   every trainable parameter (all weights, or only the LoRA adapters)
    optimizer.pt            optimizer + LR-scheduler state (tensors and numbers; loaded weights_only)
    rng.pt                  torch CPU/CUDA and Python RNG states (loaded weights_only)
    trainer_state.json      step, data position, tokens seen, loss-scaler state
    manifest.json           every other file's size and SHA-256 (of its first and last MiB above 64 MiB)
It is written under a temporary name and renamed into place, so a crash (even ``kill -9``) leaves
either a complete checkpoint or none; temporary leftovers are removed on the next start, and old
checkpoints are renamed away before they are deleted. A resume verifies the newest checkpoint against its
manifest and falls back to the newest one that verifies (``latest_intact``), saying so.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from memfit.config.loader import json_value
from memfit.errors import UserError
from memfit.safe_files import read_torch, refusal

_WRAPPED = "_checkpoint_wrapped_module."
_TMP_PREFIX = ".tmp-"


def clean_name(name: str) -> str:
    """A parameter name without activation-checkpoint wrapper components."""
    return name.replace(_WRAPPED, "")


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {clean_name(n): p.detach() for n, p in model.named_parameters() if p.requires_grad}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for f in path.iterdir():
        if f.is_dir():
            _fsync_tree(f)
            continue
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    _fsync_dir(path)


def temp_dir_for(target: Path) -> Path:
    """The temporary sibling a checkpoint or export is written into before it is renamed into place."""
    return target.parent / f"{_TMP_PREFIX}{target.name}"


def begin_atomic(target: Path) -> Path:
    """Create an empty temporary directory for ``target`` and return it."""
    tmp = temp_dir_for(target)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def commit_atomic(tmp: Path, target: Path, manifest: bool = False) -> None:
    """fsync everything in ``tmp`` (after recording its files in a manifest, for a checkpoint), then rename it
    to ``target`` (replacing an older one)."""
    if manifest:
        write_manifest(tmp)
    _fsync_tree(tmp)
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)
    _fsync_dir(target.parent)


def atomic_dir(target: Path, write, manifest: bool = False) -> None:
    """Call ``write(tmp_dir)``, then rename ``tmp_dir`` to ``target`` (replacing it) after fsync."""
    tmp = begin_atomic(target)
    try:
        write(tmp)
        commit_atomic(tmp, target, manifest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def remove_partial(root: Path) -> None:
    """Delete what a killed run left behind: temporary directories (a checkpoint being written or deleted)
    and checkpoint directories without their state file (from a deletion that was not renamed first)."""
    if root.is_dir():
        for p in root.glob(f"{_TMP_PREFIX}*"):
            shutil.rmtree(p, ignore_errors=True)
        for p in root.glob("step_*"):
            if p.is_dir() and not (p / "trainer_state.json").is_file():
                shutil.rmtree(p, ignore_errors=True)


@dataclass(frozen=True)
class TrainerState:
    step: int
    micro_batches: int
    tokens_seen: int
    scaler: dict[str, Any] | None = None
    world_size: int = 1
    engine: str = "single"

    def write(self, directory: Path) -> None:
        (directory / "trainer_state.json").write_text(json.dumps(self.__dict__))

    @classmethod
    def read(cls, directory: Path) -> "TrainerState":
        return cls(**json_value((directory / "trainer_state.json").read_text()))


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:07d}"


def save_checkpoint(root: Path, model, optimizer, scheduler, state: TrainerState, keep: int) -> Path:
    """Write one checkpoint atomically and keep only the ``keep`` most recent."""
    root.mkdir(parents=True, exist_ok=True)
    target = checkpoint_dir(root, state.step)

    def write(tmp: Path) -> None:
        tensors = {k: v.contiguous().cpu() for k, v in trainable_state(model).items()}
        save_file(tensors, tmp / "trainable.safetensors")
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp / "optimizer.pt")
        torch.save(rng_state(), tmp / "rng.pt")
        state.write(tmp)

    atomic_dir(target, write, manifest=True)
    rotate(root, keep)
    return target


MANIFEST = "manifest.json"
_WHOLE_DIGEST_BYTES = 64 << 20  # files up to this size are hashed whole; larger ones by their ends
_END_BYTES = 1 << 20
_NO_MANIFEST = f"{MANIFEST} is missing"


def _digest(path: Path, size: int) -> str:
    """SHA-256 of the file, or of its first and last MiB for files over 64 MiB (reading a 40 GB optimizer
    state twice per checkpoint would cost minutes; truncation and emptying are caught by the size)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= _WHOLE_DIGEST_BYTES:
            h.update(f.read())
        else:
            h.update(f.read(_END_BYTES))
            f.seek(size - _END_BYTES)
            h.update(f.read(_END_BYTES))
    return h.hexdigest()


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(directory: Path) -> None:
    """Record every file's size and digest in ``manifest.json``: what ``verify_checkpoint`` checks."""
    entries = {}
    for p in _files(directory):
        size = p.stat().st_size
        entries[p.relative_to(directory).as_posix()] = {"bytes": size, "sha256": _digest(p, size)}
    (directory / MANIFEST).write_text(json.dumps({"files": entries}))


def verify_checkpoint(path: Path) -> str | None:
    """Why the checkpoint at ``path`` cannot be trusted (a file missing, resized or changed since it was
    written, an unreadable state file), or None when it is intact."""
    try:
        recorded = json_value((path / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return _NO_MANIFEST
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return f"{MANIFEST} is unreadable"
    for name, entry in recorded.items():
        p = path / name
        if not p.is_file():
            return f"{name} is missing"
        size = p.stat().st_size
        if size != entry.get("bytes"):
            return f"{name} has {size} bytes, {entry.get('bytes')} were written"
        if _digest(p, size) != entry.get("sha256"):
            return f"{name} changed since it was written"
    return None


def latest_intact(root: Path) -> tuple[Path | None, list[str]]:
    """The newest checkpoint under ``root`` that verifies, and a line for each newer one that does not."""
    skipped = []
    for path in reversed(list_checkpoints(root)):
        why = verify_checkpoint(path)
        if why is None:
            return path, skipped
        if why == _NO_MANIFEST:  # written before checkpoints carried one: trusted as before
            return path, skipped + [f"{path.name} has no {MANIFEST} (an older memfit wrote it): not verified"]
        skipped.append(f"{path.name} is damaged ({why})")
    return None, skipped


def rotate(root: Path, keep: int) -> None:
    """Delete all but the ``keep`` newest checkpoints, each renamed to a temporary name first, so a kill
    mid-deletion leaves a temporary directory (removed on the next start), never a half-deleted checkpoint."""
    for old in list_checkpoints(root)[:-keep]:
        doomed = temp_dir_for(old)
        shutil.rmtree(doomed, ignore_errors=True)
        os.replace(old, doomed)
        shutil.rmtree(doomed)


def checkpoint_step(path: Path) -> int | None:
    """The optimizer step a checkpoint directory's name says (``step_0000012`` -> 12); None for another name."""
    digits = path.name.removeprefix("step_")
    return int(digits) if path.name.startswith("step_") and digits.isdigit() else None


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first (by step: a directory renamed by hand to another name is not one)."""
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step_*") if checkpoint_step(p) is not None and (p / "trainer_state.json").is_file()]
    return sorted(found, key=checkpoint_step)


def load_checkpoint(path: Path, model, optimizer, scheduler, device: torch.device) -> TrainerState:
    """Restore model weights, optimizer, scheduler and RNG from ``path`` (no pickle code execution)."""
    try:
        tensors = load_file(path / "trainable.safetensors")
    except (SafetensorError, OSError) as e:
        raise refusal(path / "trainable.safetensors", e) from None
    params = {clean_name(n): p for n, p in model.named_parameters() if p.requires_grad}
    missing = set(params) - set(tensors)
    if missing:
        raise UserError(
            f"checkpoint {path} lacks {len(missing)} trainable tensors (e.g. {sorted(missing)[0]}); it "
            "belongs to another configuration"
        )
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(tensors[name])
    # an offloaded optimizer's state goes straight to the host: never whole on the device it was moved off
    where = getattr(optimizer, "state_device", device)
    opt = read_torch(path / "optimizer.pt", map_location=where)
    optimizer.load_state_dict(opt["optimizer"])
    scheduler.load_state_dict(opt["scheduler"])
    set_rng_state(read_torch(path / "rng.pt"))
    return TrainerState.read(path)
