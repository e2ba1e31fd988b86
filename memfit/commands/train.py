"""``memfit train [CONFIG] [key=value ...]``: one process, a torchrun launch (``--nproc-per-node``), or one
rank that torchrun started."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from memfit.config.loader import config_help, dump_config, load_config
from memfit.config.schema import RunConfig
from memfit.config.shipped import resolve_config_path, split_train_args
from memfit.distributed.launch import LaunchSpec, check_counts, launch
from memfit.distributed.runtime import launched_ranks
from memfit.errors import UserError
from memfit.telemetry.metrics_file import read_metrics
from memfit.train.supervisor import is_child, supervise
from memfit.units import GIB, meminfo, this_machine_memory

if TYPE_CHECKING:
    from memfit.planner.auto import AutoChoice

# The trainer, the planner and what they import (transformers, PEFT, DeepSpeed) are imported where a run or a plan
# happens: a torchrun launcher or a supervisor only starts processes, and starts them seconds sooner without them.

AUTO_ROWS_SHOWN = 5


def more_than_here(mem: str, planned_bytes: int, have_bytes: int) -> str | None:
    """The note for ``--auto --mem`` above this machine's memory (``have_bytes``; 0: unknown): what it plans for may
    not fit where it runs."""
    if 0 < have_bytes < planned_bytes:
        return (
            f"note: --mem {mem} is more than this machine's {have_bytes / GIB:.1f} GiB: a candidate planned to fit "
            "in it may not fit here"
        )
    return None


def run(ns) -> int:
    if ns.help_config:
        print(config_help())
        return 0
    check_counts(ns.nproc_per_node, ns.nnodes, ns.node_rank)
    if ns.nproc_per_node is None and ns.nnodes == 1:  # one process, no torchrun: its flags would go unread
        if ns.numa_binding is not None:
            raise UserError("--numa-binding binds torchrun's ranks: give --nproc-per-node too")
        if ns.rdzv_endpoint is not None:
            raise UserError("--rdzv-endpoint is where torchrun's ranks meet: give --nproc-per-node (and --nnodes) too")
    config_arg, overrides = split_train_args(ns.args)
    config_path = resolve_config_path(config_arg)
    cfg = load_config(config_path, overrides)
    if ns.print_config:
        print(dump_config(cfg), end="")
        return 0
    choice = None
    if ns.auto:
        choice = auto_choice(cfg, overrides, ns)
        overrides = [*overrides, *choice.overrides]  # later overrides win: the plan's levers, then the config's
        cfg = load_config(config_path, overrides)
    elif ns.mem:
        raise UserError("--mem is the memory --auto plans a CPU run for; add --auto")
    if (cfg.train.on_oom == "next" or cfg.train.restart_on) and not is_child() and launched_ranks() <= 1:
        return supervise(
            [str(config_path), *_launch_flags(ns)],
            overrides,
            lambda more: load_config(config_path, more),
            (ns.nproc_per_node or 1) * ns.nnodes,
            print,
        )
    if ns.nproc_per_node is not None or ns.nnodes > 1:
        spec = LaunchSpec(ns.nproc_per_node or 1, ns.nnodes, ns.node_rank, ns.rdzv_endpoint, ns.numa_binding)
        from memfit.train.levers import check_before_launch

        check_before_launch(cfg, spec.world_size)  # said once here, not once by every rank
        code = launch(spec, cfg, config_path, overrides)
        if choice is not None and ns.node_rank == 0:
            write_auto_plan(Path(cfg.output.dir), choice)
        return code
    from memfit.train.loop import Trainer
    from memfit.train.rank import run_rank

    if launched_ranks() > 1:  # a rank started by torchrun
        run_rank(cfg)
    trainer = Trainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.close()
        if choice is not None:
            write_auto_plan(trainer.run.root, choice)
    return 0


def _launch_flags(ns) -> list[str]:
    """The torchrun flags of this command line, for a child ``memfit train`` to launch the same ranks."""
    flags = [] if ns.nproc_per_node is None else ["--nproc-per-node", str(ns.nproc_per_node)]
    if ns.nnodes > 1:
        flags += ["--nnodes", str(ns.nnodes), "--node-rank", str(ns.node_rank)]
    flags += ["--rdzv-endpoint", ns.rdzv_endpoint] if ns.rdzv_endpoint else []
    return flags + (["--numa-binding", ns.numa_binding] if ns.numa_binding else [])


def auto_choice(cfg: RunConfig, overrides: list[str], ns) -> AutoChoice:
    """``--auto``: the plan for this config on the device it is about to use, printed, and its winner.

    Raises:
        UserError: a resumed run, ``--mem`` on a GPU, several CPU ranks, or nothing that fits.
    """
    import torch
    from rich.console import Console

    from memfit.device import device_name, resolve_device, supports_bf16
    from memfit.planner.auto import auto_plan, choose, gpu_cluster, this_cpu
    from memfit.planner.report import render_table
    from memfit.train.fit_check import replay_planned_steps

    if cfg.train.resume:
        raise UserError(
            "--auto plans a new run; resume this one without --auto (its config.yaml holds the levers it chose)"
        )
    device = resolve_device(cfg.train.device)
    per_node, nodes = ns.nproc_per_node or 1, ns.nnodes
    if device.type == "cpu":
        if per_node * nodes > 1:
            raise UserError(f"--auto on a CPU plans one process (got {per_node} x {nodes}); drop --nproc-per-node")
        cluster = this_cpu(ns.mem)
        if ns.mem and (said := more_than_here(ns.mem, cluster.gpu.memory_bytes, this_machine_memory())):
            print(said)
    else:
        if ns.mem:
            raise UserError("--mem is a CPU run's memory; on a GPU --auto plans for the device's own")
        total = torch.cuda.get_device_properties(device).total_memory
        cluster = gpu_cluster(
            device_name(device),
            int(total * (cfg.allocator.memory_fraction or 1.0)),
            supports_bf16(device),
            per_node,
            nodes,
            meminfo().get("MemAvailable"),
        )
    result = auto_plan(cfg, overrides, cluster)
    console = Console() if sys.stdout.isatty() else Console(width=190)
    render_table(result, console, AUTO_ROWS_SHOWN)
    replay_oom = None
    if device.type == "cuda" and cluster.world_size == 1 and cfg.train.allocator_model:

        def replay_oom(c) -> str | None:
            r = replay_planned_steps(cfg, c.strategy, result.workload.model_config, total)
            return f"peak reserved {r.peak_reserved_bytes / GIB:.2f} GiB, out of memory" if r.oom else None

    choice = choose(result, replay_oom)
    for line in choice.passed_over:
        console.print(f"--auto: passed over {line}", highlight=False)
    console.print(f"--auto: training row {choice.row}: {choice.chosen.strategy.label()}", highlight=False)
    return choice


def write_auto_plan(root: Path, choice: AutoChoice) -> None:
    """The plan ``--auto`` chose from, beside the run's config.yaml (which holds the chosen levers), with the
    chosen row's predicted step time beside the run's measured median (printed too, once the run has one)."""
    from memfit.planner.report import plan_dict

    if not (root / "config.yaml").is_file():
        return  # the run never started
    records = read_metrics(root / "metrics.jsonl") if (root / "metrics.jsonl").is_file() else []
    summaries = [r for r in records if r.get("kind") == "summary"]
    measured = summaries[-1].get("median_step_time_s") if summaries else None
    predicted = choice.chosen.step_time_s
    plan = plan_dict(choice.result) | {
        "chosen_row": choice.row,
        "overrides": choice.overrides,
        "predicted_step_time_s": predicted,
        "measured_median_step_time_s": measured,
    }
    if measured:
        where = "a ranking rate of 1 TFLOP/s, not a CPU's" if choice.result.cluster.gpu.is_cpu else "the cost model"
        print(
            f"--auto: step time predicted {predicted:.3g} s ({where}), measured median {measured:.3g} s "
            f"({measured / predicted:.2f}x the prediction)"
        )
    tmp = root / ".auto-plan.json.tmp"
    tmp.write_text(json.dumps(plan, indent=1) + "\n")
    os.replace(tmp, root / "auto-plan.json")
