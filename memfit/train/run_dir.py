"""The run directory: its recorded config, metrics file and checkpoints, and the rules for reusing one.

config.yaml     the full config that ran (compared on restart)
metrics.jsonl   one JSON record per logged step / eval / summary
checkpoints/    atomic checkpoints (see ``checkpoint.py``)
export/         the final model or adapter in Hugging Face format
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
from pathlib import Path
from typing import Any

import yaml

from memfit.config.loader import config_to_dict, dump_config
from memfit.config.schema import RunConfig
from memfit.errors import UserError
from memfit.train.checkpoint import checkpoint_step, latest_intact, list_checkpoints, remove_partial
from memfit.train.disk import check_creatable

_IGNORED_ON_COMPARE = {("train", "resume"), ("output", "dir")}
"""Never part of a run's identity: whether it resumes, and where its directory is or how its path is typed
(the directory holding ``config.yaml`` is the run's, however it was reached)."""

MAY_CHANGE_ON_RESUME = {
    ("train", key)
    for key in (
        "max_steps",
        "eval_every",
        "eval_batches",
        "log_every",
        "checkpoint_every",
        "keep_checkpoints",
        "threads",
        "frag_every",
        "record_memory_history",
        "snapshot_at_step",
        "profile_step",
        "metrics_port",
        "metrics_host",
        "plan_check",
        "allocator_model",
        "on_oom",
        "oom_retries",
        "restart_on",
        "max_restarts",
    )
} | {("data", "num_workers"), ("data", "pin_memory"), ("data", "prefetch_factor")}
MAY_CHANGE_ON_RESUME |= {("distributed", "timeout_s"), ("output", "export")}
MAY_CHANGE_ON_RESUME |= {("optimizer", "implementation"), ("optimizer", "offload")}
MAY_CHANGE_ON_RESUME |= {("strategy", key) for key in ("activation_checkpointing", "loss_chunks", "activation_offload")}
MAY_CHANGE_ON_RESUME |= {
    ("allocator", key)
    for key in (
        "expandable_segments",
        "max_split_size_mb",
        "garbage_collection_threshold",
        "memory_fraction",
        "empty_cache_every",
        "prewarm_gib",
        "allow_unsafe",
        "host_keep_freed",
    )
}
"""Settings that do not change what the run computes (ports, cadences, workers, how long it trains, what is
recomputed in backward or held on the host, the loss computed in chunks, the optimizer step's kernels and whether
it steps on the host (its state dict is the same either way; a DeepSpeed run's offload is its JSON's, whose path is
compared), how the caching allocator and the host's malloc keep memory): a resume may change them, and each change is
printed.
``train.max_steps`` trains a run on past its end, with the LR schedule stretched from the next step."""


BATCH_SPLIT = {("train", "micro_batch_size"), ("train", "grad_accum_steps"), ("train", "global_batch_size")}
"""How the global batch is split into micro-batches and accumulation: may change on resume while the global batch
stays the same (after an out-of-memory exit, a smaller micro-batch with more accumulation computes the same steps)."""


def global_batch(train: dict[str, Any], world_size: int) -> int | None:
    """Sequences per optimizer step that a config's ``train`` section asks for on ``world_size`` ranks."""
    if train.get("global_batch_size") is not None:
        return train["global_batch_size"]
    try:
        return world_size * int(train["micro_batch_size"]) * int(train.get("grad_accum_steps") or 1)
    except (KeyError, TypeError, ValueError):
        return None


def _differences(old: dict[str, Any], new: dict[str, Any], ignored=frozenset()) -> list[str]:
    """``section.key: old there, new here`` for each setting that differs. A setting ``old`` lacks (a run started
    by a memfit that predates it) counts as its default, which is how that ``config.yaml`` loads."""
    defaults, diffs = config_to_dict(RunConfig()), []
    for section, values in new.items():
        for key, value in values.items():
            if (section, key) in _IGNORED_ON_COMPARE or (section, key) in ignored:
                continue
            before = old.get(section, {}).get(key, defaults[section][key])
            if before != value:
                diffs.append(f"{section}.{key}: {before!r} there, {value!r} here")
    return diffs


@dataclasses.dataclass
class RunDir:
    root: Path

    @property
    def config_path(self) -> Path:
        return self.root / "config.yaml"

    @property
    def metrics_path(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def export(self) -> Path:
        return self.root / "export"

    def latest_checkpoint(self) -> Path | None:
        found = list_checkpoints(self.checkpoints)
        return found[-1] if found else None


LOCK_NAME = ".memfit.lock"
"""In a run directory while a process trains in it: an exclusive ``flock`` (released by the kernel if the process
dies) and the holder's pid, for the message another start gets."""
_HELD: dict[Path, int] = {}  # run directories this process holds: its Trainers may take one in turn (tests, resumes)


def hold(root: Path, flag: str = "output.dir", what: str = "memfit run") -> None:
    """Hold the directory ``root`` (which exists; a run's ``output.dir``, or ``memfit bench``'s ``--out``) for this
    process until ``release``.

    Raises:
        UserError: another live process holds it (two starts into one ``output.dir`` would delete each other's
            checkpoints in the making; two benches into one ``--out`` would run each other's cells).
    """
    root = root.resolve()
    if root in _HELD:
        return
    path = root / LOCK_NAME
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise UserError(
                f"{flag} '{root}' is in use by another {what} (pid {pid}); wait for it to end or choose another {flag}"
            ) from None
        if path.exists() and path.stat().st_ino == os.fstat(fd).st_ino:
            break
        os.close(fd)  # its last holder removed the file between our open and our lock: take the new one
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _HELD[root] = fd


def release(root: Path) -> None:
    """Let the run directory go."""
    fd = _HELD.pop(root.resolve(), None)
    if fd is not None:
        (root / LOCK_NAME).unlink(missing_ok=True)
        os.close(fd)  # and with it the lock


def prepare_run_dir(cfg: RunConfig, world_size: int = 1) -> tuple[RunDir, Path | None, list[str]]:
    """Check ``output.dir`` may hold this run; return it, the checkpoint to resume from (if any) and notes for
    the user (settings changed on resume, damaged checkpoints passed over).

    Raises:
        UserError: the directory holds another run, holds this run's checkpoints without
            ``train.resume=true``, holds checkpoints none of which is intact, or holds files that are not a
            memfit run.
    """
    run = RunDir(Path(cfg.output.dir))
    where = f"output.dir '{cfg.output.dir}'"
    if run.root.exists() and not run.root.is_dir():
        raise UserError(f"{where} is a file; choose a directory path")
    check_creatable(run.root, "output.dir")
    if run.root.is_dir() and any(p.name != LOCK_NAME for p in run.root.iterdir()) and not run.config_path.is_file():
        raise UserError(f"{where} is not empty and is not a memfit run (no config.yaml); choose another output.dir")
    taken = run.root.is_dir() and run.root.resolve() not in _HELD
    if taken:
        hold(run.root)  # before anything in it is read or changed (a new directory is held once made: write_config)
    try:
        return _check_run_dir(cfg, run, where, world_size)
    except UserError:
        if taken:
            release(run.root)
        raise


def _check_run_dir(cfg: RunConfig, run: RunDir, where: str, world_size: int) -> tuple[RunDir, Path | None, list[str]]:
    if run.config_path.is_file():
        try:
            old = yaml.safe_load(run.config_path.read_text()) or {}
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise UserError(f"{where}: its config.yaml is unreadable ({type(e).__name__}); choose another output.dir")
        new = config_to_dict(cfg)
        latest = run.latest_checkpoint()
        continuing = cfg.train.resume or latest is None  # without a checkpoint, a start again loses nothing
        resumable = MAY_CHANGE_ON_RESUME
        if global_batch(old.get("train", {}), world_size) == global_batch(new["train"], world_size):
            resumable = resumable | BATCH_SPLIT
        diffs = _differences(old, new, resumable if continuing else frozenset())
        if diffs and not continuing and not _differences(old, new, resumable):  # a resume would take these changes
            raise UserError(
                f"{where} already holds this run up to {latest.name}; pass train.resume=true to continue it with "
                f"{diffs[0]}{'; ...' if len(diffs) > 1 else ''}, or choose another output.dir"
            )
        if diffs:
            raise UserError(
                f"{where} holds a different run ({diffs[0]}{'; ...' if len(diffs) > 1 else ''}); choose another "
                "output.dir (deleting that directory deletes its checkpoints)"
            )
        if latest is not None and not cfg.train.resume:
            raise UserError(
                f"{where} already holds this run up to {latest.name}; pass train.resume=true to continue "
                "it, or choose another output.dir"
            )
        remove_partial(run.checkpoints)
        changed = "changed on resume" if latest is not None else "changed since this run last started"
        notes = [f"{changed}: {d}" for d in _differences(old, new)]
        if latest is None:
            return run, None, notes
        intact, damaged = latest_intact(run.checkpoints)
        if intact is None:
            raise UserError(
                f"{where}: no checkpoint is intact ({'; '.join(damaged)}); nothing to resume from: choose "
                "another output.dir"
            )
        notes += [f"{line}: resuming from {intact.name}" for line in damaged]
        if checkpoint_step(intact) > cfg.train.max_steps:
            raise UserError(
                f"{where} is at step {checkpoint_step(intact)} ({intact.name}), past train.max_steps "
                f"{cfg.train.max_steps}: raise train.max_steps to train on"
            )
        return run, intact, notes
    return run, None, []


def write_config(run: RunDir, cfg: RunConfig) -> None:
    run.root.mkdir(parents=True, exist_ok=True)
    hold(run.root)  # a new run's directory (an existing one is held since prepare_run_dir)
    tmp = run.config_path.with_suffix(".yaml.tmp")
    tmp.write_text(dump_config(cfg))
    os.replace(tmp, run.config_path)
