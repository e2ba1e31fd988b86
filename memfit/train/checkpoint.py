"""Atomic run checkpoints, resume, and the final Hugging Face export.

A checkpoint is a directory ``checkpoints/step_NNNNNNN/`` holding
    trainable.safetensors   every trainable parameter (all weights, or only the LoRA adapters)
    optimizer.pt            optimizer + LR-scheduler state (tensors and numbers; loaded weights_only)
    rng.pt                  torch CPU/CUDA and Python RNG states (loaded weights_only)
    trainer_state.json      step, data position, tokens seen, loss-scaler state
It is written under a temporary name and renamed into place, so a crash (even ``kill -9``) leaves
either a complete checkpoint or none; temporary leftovers are removed on the next start.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from memfit.errors import UserError

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


def commit_atomic(tmp: Path, target: Path) -> None:
    """fsync everything in ``tmp``, then rename it to ``target`` (replacing an older one)."""
    _fsync_tree(tmp)
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)
    _fsync_dir(target.parent)


def atomic_dir(target: Path, write) -> None:
    """Call ``write(tmp_dir)``, then rename ``tmp_dir`` to ``target`` (replacing it) after fsync."""
    tmp = begin_atomic(target)
    try:
        write(tmp)
        commit_atomic(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def remove_partial(root: Path) -> None:
    """Delete temporary directories a killed run left behind."""
    if root.is_dir():
        for p in root.glob(f"{_TMP_PREFIX}*"):
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
        return cls(**json.loads((directory / "trainer_state.json").read_text()))


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

    atomic_dir(target, write)
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old)
    return target


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if (p / "trainer_state.json").is_file())


def load_checkpoint(path: Path, model, optimizer, scheduler, device: torch.device) -> TrainerState:
    """Restore model weights, optimizer, scheduler and RNG from ``path`` (no pickle code execution)."""
    tensors = load_file(path / "trainable.safetensors")
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
    opt = torch.load(path / "optimizer.pt", map_location=device, weights_only=True)
    optimizer.load_state_dict(opt["optimizer"])
    scheduler.load_state_dict(opt["scheduler"])
    set_rng_state(torch.load(path / "rng.pt", weights_only=True))
    return TrainerState.read(path)
