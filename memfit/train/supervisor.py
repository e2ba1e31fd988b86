"""``train.on_oom = next`` and ``train.restart_on``: a run that goes on in fresh processes.

With either set, the ``memfit train`` process becomes a supervisor: it runs the training in a child process
(``memfit train`` again, so every run starts with a clean allocator) and starts another from the run's checkpoint
(``train.resume=true``) when one ends for a restart (exit 5: ``train.restart_on`` held at a step's end, the child
wrote its checkpoint and a ``restart`` record; at most ``train.max_restarts``, after which the run goes on in its
process) or out of memory (exit 3, its run directory as it was: the last complete checkpoint kept). After an
out-of-memory exit the next child runs the next configuration that keeps the global batch:

1. a smaller micro-batch with more accumulation (the largest divisor of the per-rank batch at most half the
   current micro-batch; not where the optimizer steps in backward, which cannot accumulate);
2. then stronger activation checkpointing: none -> ffn -> full (every_k:N -> full);
3. then the allocator settings the what-if replay of the planned steps recommends, where they differ from those in
   effect (one GPU: the child that ran out of memory writes the advice into its ``oom`` record).

All three leave what the run computes unchanged (the same global batch; recomputation is exact), so in fp32 the loss
sequence continues as an uninterrupted run of the new configuration would (tested). At most
``train.oom_retries`` restarts; each switch is printed when it happens and written to ``metrics.jsonl`` as an
``on_oom`` record (step, what failed, what changed) when the last child ends, with an ``on_oom_summary`` record.

SIGTERM and Ctrl-C reach the child, which writes its checkpoint and stops as any run does; the supervisor then
ends with its exit code.

Known limitations: the allocator advice replays the planned steps, not the run's own recorded trace; on a CPU or
with several ranks there is none, so the ladder ends at full checkpointing; a child that fails otherwise ends the
supervision with its exit code.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from memfit.config.schema import RunConfig, grad_accum_steps
from memfit.errors import EXIT_OUT_OF_MEMORY, EXIT_RESTART
from memfit.telemetry.metrics_file import append_record, read_metrics
from memfit.units import GIB

CHILD_ENV = "MEMFIT_ON_OOM_CHILD"  # set in the children: they run the training, and stop on an OOM
FORWARDED = (signal.SIGTERM, signal.SIGINT)
STRONGER = {"none": "ffn", "ffn": "full"}  # checkpointing, one step stronger (every_k:N -> full)


RESTARTS_ENV = "MEMFIT_RESTARTS"  # set in the children: fresh-process restarts of the run before this one


def is_child() -> bool:
    return os.environ.get(CHILD_ENV) == "1"


def restarts_so_far() -> int:
    """Fresh-process restarts of this run before this process (``train.restart_on`` and ``train.on_oom``)."""
    value = os.environ.get(RESTARTS_ENV, "0")
    return int(value) if value.isdigit() else 0


def next_after_oom(cfg: RunConfig, world_size: int) -> tuple[list[str], str] | None:
    """The overrides that make ``cfg`` the next configuration to try after it ran out of memory, and what they
    change in words; None where the ladder has no step left."""
    t = cfg.train
    accum = grad_accum_steps(cfg, world_size)
    per_rank = t.micro_batch_size * accum
    smaller = [b for b in range(1, t.micro_batch_size // 2 + 1) if per_rank % b == 0]
    if smaller and not cfg.optimizer.in_backward:
        b = smaller[-1]
        return (
            [f"train.micro_batch_size={b}", f"train.grad_accum_steps={per_rank // b}"],
            f"micro-batch {t.micro_batch_size} x accum {accum} -> {b} x {per_rank // b}",
        )
    policy = cfg.strategy.activation_checkpointing
    if policy.kind != "full":
        stronger = STRONGER.get(policy.kind, "full")
        return [f"strategy.activation_checkpointing={stronger}"], f"activation checkpointing {policy} -> {stronger}"
    return None


def _last(metrics: Path, kind: str) -> dict | None:
    if not metrics.is_file():
        return None
    found = [r for r in read_metrics(metrics) if r.get("kind") == kind]
    return found[-1] if found else None


def _saving(advice: dict) -> str:
    now, then = advice.get("now_peak_reserved_bytes"), advice["peak_reserved_bytes"]
    of = f" of {advice['replayed']}" if advice.get("replayed") else ""
    return f": peak reserved {now / GIB:.2f} -> {then / GIB:.2f} GiB in the replay{of}" if now else ""


def allocator_overrides(metrics: Path, say: Callable[[str], None]) -> list[str]:
    """The allocator settings the last ``restart`` record advises (the what-if replay of the run's recorded trace or
    of its planned steps, one GPU), said in one line; [] where it advises none."""
    advice = (_last(metrics, "restart") or {}).get("allocator")
    if not advice or not advice.get("overrides"):
        return []
    say(f"restart: with allocator settings {advice['settings']}{_saving(advice)}")
    return list(advice["overrides"])


def allocator_rung(oom: dict, overrides: list[str]) -> tuple[list[str], str] | None:
    """The ladder's third step: the allocator settings an ``oom`` record advises, and what they change in words;
    None where it advises none or the run has them already."""
    advice = oom.get("allocator") or {}
    extra = [o for o in advice.get("overrides", []) if o not in overrides]
    return (extra, f"allocator settings {advice['settings']}{_saving(advice)}") if extra else None


def _run_child(argv: list[str], env: dict[str, str]) -> int:
    """Run one child to its end, in a process group of its own; SIGTERM and SIGINT sent to the supervisor (a
    terminal's Ctrl-C included) are passed on to it once (it checkpoints and stops), so no child outlives its
    supervisor."""
    child = subprocess.Popen(argv, env=env, preexec_fn=os.setpgrp)
    forward = {s: signal.signal(s, lambda received, _frame: child.send_signal(received)) for s in FORWARDED}
    try:
        return child.wait()
    finally:
        for s, previous in forward.items():
            signal.signal(s, previous)


def supervise(
    child_args: list[str],
    overrides: list[str],
    load: Callable[[list[str]], RunConfig],
    world_size: int,
    say: Callable[[str], None],
) -> int:
    """Run ``memfit train <child_args> <overrides>`` in child processes until one ends other than out of memory,
    moving down the ladder after each OOM (``next_after_oom``); the last child's exit code.

    Args:
        child_args: the config argument and launch flags, as the child takes them (no ``--auto``).
        overrides: ``key=value`` overrides of the first child; each restart appends its own.
        load: the config these overrides make (``load_config`` of the same config file).
    """
    cfg = load(overrides)
    if cfg.train.restart_on and cfg.train.max_restarts == 0:  # no restart allowed: the condition is never acted on
        overrides = [*overrides, "train.restart_on=null"]
        cfg = load(overrides)
    metrics = Path(cfg.output.dir) / "metrics.jsonl"
    switches: list[dict] = []
    restarts = 0
    env = os.environ | {CHILD_ENV: "1"}
    try:
        while True:
            env[RESTARTS_ENV] = str(restarts + len(switches))
            code = _run_child([sys.executable, "-m", "memfit.cli", "train", *child_args, *overrides], env)
            if code == EXIT_RESTART:
                restarts += 1
                resume = [] if "train.resume=true" in overrides else ["train.resume=true"]
                if restarts >= cfg.train.max_restarts:
                    say(f"restart: {restarts} restart(s) used (train.max_restarts); the run goes on in one process")
                    resume.append("train.restart_on=null")
                overrides = [*overrides, *resume, *allocator_overrides(metrics, say)]
                cfg = load(overrides)
                continue
            if code != EXIT_OUT_OF_MEMORY:
                return code
            oom = _last(metrics, "oom") or {}
            step = oom.get("step")
            if len(switches) >= cfg.train.oom_retries:
                say(f"on_oom: out of memory again at step {step}; {len(switches)} restart(s) used (train.oom_retries)")
                return code
            ladder = next_after_oom(cfg, world_size) or allocator_rung(oom, overrides)
            if ladder is None:
                say(
                    f"on_oom: out of memory at step {step} with micro-batch 1, full checkpointing and no other "
                    "allocator settings advised; nothing left"
                )
                return code
            extra, change = ladder
            asked = oom.get("requested_bytes")
            failed = f"an allocation of {asked / GIB:.2f} GiB failed" if asked else "out of memory"
            switches.append(
                {"kind": "on_oom", "step": step, "retry": len(switches) + 1, "failed": failed, "change": change}
                | {"overrides": extra}
            )
            say(f"on_oom: step {step}: {failed}; restarting from the last checkpoint with {change}")
            overrides = [*overrides, *extra] + ([] if "train.resume=true" in overrides else ["train.resume=true"])
            cfg = load(overrides)
    finally:
        if restarts:
            say(f"restart: the run restarted {restarts} time(s) in a fresh process")
        if switches and metrics.parent.is_dir():
            for record in switches:
                append_record(metrics, record)
            append_record(
                metrics,
                {"kind": "on_oom_summary", "restarts": len(switches), "changes": [s["change"] for s in switches]},
            )
            say(
                f"on_oom: {len(switches)} restart(s): "
                + "; ".join(f"step {s['step']}: {s['change']}" for s in switches)
            )
