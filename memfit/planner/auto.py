"""``memfit train CONFIG --auto``: the plan of the run a config describes, on the device it is about to use, and the
winner as the ``key=value`` overrides that make the config run it.

What stays as the config says: the job (model, data and sequence length, the global batch, full fine-tune or LoRA
and the adapters' shape, the learning rate and everything else that is not a memory lever) and every lever given
as a ``key=value`` override on the command line. Every other lever of the ``Strategy`` vocabulary is searched,
whatever the YAML sets it to (the YAML's values are how the run would go without ``--auto``). One more pin follows
from the job: with ``optimizer.grad_clip > 0`` the step stays after backward (the step in backward cannot clip).

The device's memory: on a GPU its total memory (times ``allocator.memory_fraction``) and ``MemAvailable`` as the
host memory offloading may use; on a CPU the memory given (``--mem``) or available now, less this process's
resident memory (torch, transformers) as the runtime's share. On one GPU the winner's first two steps are replayed
through the caching-allocator model under the allocator settings in effect; a winner the replay sees run out of
memory gives way to the next row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from memfit.config.loader import parse_override
from memfit.config.schema import RunConfig
from memfit.config.strategy import levers
from memfit.errors import UserError
from memfit.models.planning import config_for_planning
from memfit.planner.hardware import cpu_device, device_preset
from memfit.planner.search import Candidate, Cluster, Pins, PlanResult, Workload, search, table_rows
from memfit.units import GIB, meminfo, parse_memory, process_rss_bytes, size_text, this_machine_memory

REPLAYED_ROWS = 3  # rows tried through the allocator model on one GPU before giving up


@dataclass(frozen=True)
class AutoChoice:
    result: PlanResult
    chosen: Candidate
    row: int  # 1-based, in the plan table
    overrides: list[str]  # ``section.key=value``: the config runs ``chosen`` with these
    passed_over: list[str]  # rows the allocator model's replay saw run out of memory, and why


def pinned_levers(overrides: list[str], cfg: RunConfig) -> dict[str, Any]:
    """The levers the command line fixes: ``key=value`` overrides naming a lever's config key (``auto`` pins
    nothing), and the step after backward where the job clips gradients.

    Raises:
        UserError: an override's value is not one of its lever's (naming the override).
    """
    by_key = {lever.config_key: name for name, lever in levers().items()}
    pins: dict[str, Any] = {}
    for text in overrides:
        section, key, value = parse_override(text)
        name = by_key.get(f"{section}.{key}")
        if name is None or name == "grad_accum_steps" or value == "auto":
            continue  # accumulation follows from the global batch and the micro-batch
        pins[name] = levers()[name].parse(value, f"override {text}")
    if cfg.optimizer.grad_clip > 0 and "optimizer_in_backward" not in pins:
        pins["optimizer_in_backward"] = False
    return pins


def cpu_cluster(memory_bytes: int, runtime_bytes: int) -> Cluster:
    return Cluster(cpu_device(memory_bytes), runtime_bytes=runtime_bytes)


def this_cpu(mem: str | None, flag: str = "--mem") -> Cluster:
    """This machine's CPU as one process plans for it: ``mem`` (e.g. ``8GiB``) or the memory available now, and
    this process's resident memory with torch and transformers' modeling code loaded as the runtime's share (a
    search from cached traces imports neither, so they are imported here).

    Raises:
        UserError: ``mem`` is not a size (naming ``flag``).
    """
    import torch  # noqa: F401 - the runtime a run holds, resident before the resident size is read
    import transformers.modeling_utils  # noqa: F401

    memory = parse_memory(mem, flag) if mem else meminfo().get("MemAvailable", this_machine_memory())
    return cpu_cluster(memory, process_rss_bytes())


def gpu_cluster(name: str, total_bytes: int, bf16: bool, per_node: int, nodes: int, host_bytes: int | None) -> Cluster:
    """The visible GPU as the planner sees it: its memory and bf16 support, and the rates of the preset its name
    carries (an A100's where none does, as ``--gpu-mem`` assumes)."""
    return Cluster(device_preset(name, total_bytes, bf16), per_node, nodes, host_bytes)


def global_batch_of(cfg: RunConfig, world_size: int) -> int:
    t = cfg.train
    return t.global_batch_size or world_size * t.micro_batch_size * t.grad_accum_steps


def auto_plan(cfg: RunConfig, overrides: list[str], cluster: Cluster, headroom: float = 0.05) -> PlanResult:
    """The search for ``cfg``'s job on ``cluster`` with the command line's pins.

    Raises:
        UserError: a bad pin, a batch that does not split over the ranks, or a sequence longer than the model's.
    """
    engine = "deepspeed" if cfg.distributed.engine == "deepspeed" else "fsdp2"
    w = Workload(
        config_for_planning(cfg.model.source, cfg.model.attn_implementation),
        cfg.model.source,
        cfg.data.seq_len,
        global_batch_of(cfg, cluster.world_size),
        cfg.lora if cfg.lora.enabled else None,
    )
    return search(w, cluster, Pins(pinned_levers(overrides, cfg), engine), headroom)


def choose(result: PlanResult, replay_oom: Callable[[Candidate], str | None] | None = None) -> AutoChoice:
    """The first row that fits (and, with ``replay_oom``, whose replay does not run out: it returns why, or None).

    Raises:
        UserError: nothing fits (the closest candidate and by how much it misses), or the replay refuses the
            first ``REPLAYED_ROWS`` rows.
    """
    rows = table_rows(result.fitting)
    if not rows:
        closest = result.pruned[0]
        raise UserError(
            f"--auto: nothing fits on {result.cluster.gpu.name} ({size_text(result.usable_bytes)} usable): the "
            f"closest candidate ({closest.strategy.label()}) misses by {closest.shortfall_bytes / GIB:.2f} GiB; "
            "shorten data.seq_len, lower the global batch, "
            + ("use LoRA, " if result.workload.lora is None else "")
            + "or give more memory"
        )
    passed_over = []
    for i, row in enumerate(rows[:REPLAYED_ROWS], 1):
        why = replay_oom(row.first) if replay_oom else None
        if why is None:
            return AutoChoice(result, row.first, i, row.first.strategy.overrides(), passed_over)
        passed_over.append(f"row {i} ({row.first.strategy.label()}): {why}")
    raise UserError(
        f"--auto: the caching-allocator model runs out of memory replaying the first {len(passed_over)} rows "
        f"({passed_over[0]}); set allocator settings (`memfit plan --explain 1 --simulate`) or give more memory"
    )
