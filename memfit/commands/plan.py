"""``memfit plan``: turn command-line inputs (and an optional train config / DeepSpeed JSON) into a
workload, a cluster and pins; search; print; write the winner."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from memfit.allocator.whatif import as_trace, compare, replay_allocations
from memfit.commands.frag import render_whatif
from memfit.config.loader import load_config
from memfit.config.schema import EMBEDDED_MODEL, LoraConfig, parse_ac_policy
from memfit.errors import UserError
from memfit.models.load import config_for_planning
from memfit.models.presets import PRESETS
from memfit.planner.hardware import custom_gpu, gpu_preset
from memfit.planner.report import (
    plan_dict,
    render_explain,
    render_table,
    write_deepspeed,
    write_train_config,
)
from memfit.planner.search import (
    CONTEXT_BYTES,
    OPTIMIZER_CHOICES,
    Cluster,
    Pins,
    Workload,
    search,
    step_allocations,
)
from memfit.units import GIB, parse_memory

CONCRETE_PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-pure")


@dataclass
class Inputs:
    model: str | None = None
    seq_len: int | None = None
    global_batch: int | None = None
    lora: LoraConfig | None = None
    ac: str | None = None
    precision: str | None = None
    zero: int | None = None
    micro_batch: int | None = None
    grad_accum: int | None = None
    optimizer: str | None = None
    engine: str = "fsdp2"


def _from_train_config(path: str, inp: Inputs) -> None:

    cfg = load_config(path)
    inp.model = cfg.model.source
    inp.seq_len = cfg.data.seq_len
    inp.lora = cfg.lora if cfg.lora.enabled else None
    inp.ac = cfg.strategy.activation_checkpointing
    inp.precision = None if cfg.strategy.precision == "auto" else cfg.strategy.precision
    inp.micro_batch = cfg.train.micro_batch_size
    inp.grad_accum = cfg.train.grad_accum_steps
    inp.optimizer = None if cfg.optimizer.implementation == "auto" else cfg.optimizer.implementation


def _from_deepspeed(path: str, inp: Inputs) -> None:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--deepspeed: '{path}' does not exist")
    try:
        ds = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"--deepspeed {path}:{e.lineno}: not valid JSON ({e.msg})") from None
    stage = ds.get("zero_optimization", {}).get("stage")
    if stage is not None:
        inp.zero = int(stage)
    if ds.get("bf16", {}).get("enabled"):
        inp.precision = "bf16-mixed"
    elif ds.get("fp16", {}).get("enabled"):
        inp.precision = "fp16-mixed"
    for key, attr in (("train_micro_batch_size_per_gpu", "micro_batch"), ("gradient_accumulation_steps", "grad_accum")):
        value = ds.get(key)
        if value is not None and value != "auto":
            setattr(inp, attr, int(value))
    inp.engine = "deepspeed"


def _inputs(ns) -> Inputs:
    inp = Inputs()
    if ns.config:
        _from_train_config(ns.config, inp)
    if ns.deepspeed:
        _from_deepspeed(ns.deepspeed, inp)
    for attr in ("model", "seq_len", "global_batch", "ac", "precision", "zero", "micro_batch", "optimizer"):
        if getattr(ns, attr) is not None:
            setattr(inp, attr, getattr(ns, attr))
    if ns.engine != "fsdp2":
        inp.engine = ns.engine
    if ns.lora:
        inp.lora = LoraConfig(enabled=True, rank=ns.lora_rank, alpha=2.0 * ns.lora_rank)
    if inp.model is None:
        raise UserError("memfit plan needs --model (a preset such as llama2-7b, a checkpoint directory) or --config")
    if inp.ac is not None:
        parse_ac_policy(inp.ac)
    if inp.precision is not None and inp.precision not in CONCRETE_PRECISIONS:
        raise UserError(f"--precision must be one of {' | '.join(CONCRETE_PRECISIONS)} (got '{inp.precision}')")
    if inp.optimizer is not None and inp.optimizer not in OPTIMIZER_CHOICES:
        raise UserError(f"--optimizer must be one of {' | '.join(OPTIMIZER_CHOICES)} (got '{inp.optimizer}')")
    return inp


def _train_source(model: str) -> str:
    """``model.source`` for the written train config: paths made absolute, bare presets as random:."""

    if model in PRESETS:
        return f"random:{model}"
    if model.startswith("random:") or model == EMBEDDED_MODEL:
        return model
    path = Path(model).resolve()
    return str(path.parent if path.name.endswith(".json") else path)


def _step_events(w: Workload, c) -> list[tuple[int, int]]:
    """The candidate's first two full-depth steps as allocations and releases (``plan.step_allocations``)."""

    return step_allocations(w.model_config, w.seq_len, c.micro_batch, c.grad_accum, c.ac, c.precision, c.optimizer, w.lora)


def _simulate(events: list[tuple[int, int]], c, gpu, hip: str | None, console) -> None:
    """The step's trace under several allocator settings, in the GPU's memory less the runtime context
    where the trace is what one rank holds (ZeRO-0), without a limit otherwise."""

    capacity = gpu.memory_bytes - CONTEXT_BYTES if c.zero == 0 else 1 << 62
    results, best = compare(as_trace(events), capacity, hip)
    where = (f"in {gpu.name}'s {gpu.memory_bytes / GIB:.0f} GiB less {CONTEXT_BYTES >> 20} MiB of runtime context"
             if c.zero == 0 else "without a capacity limit (ZeRO not applied)")
    render_whatif(results, best, hip, console, f"what-if: the two traced steps' {len(events)} allocator events {where}",
                  rocm=hip is not None or gpu.vendor == "amd")
    if hip is None and gpu.vendor == "amd":
        console.print("note: expandable_segments needs ROCm >= 7.0; give --hip-version to judge it", highlight=False)


def run(ns) -> int:
    inp = _inputs(ns)
    if ns.gpu and ns.gpu_mem:
        raise UserError("give --gpu or --gpu-mem, not both")
    if ns.simulate and ns.explain is None:
        raise UserError("--simulate replays one candidate's step: give --explain N too (N = its row in the table)")
    if not ns.gpu and not ns.gpu_mem:
        raise UserError("memfit plan needs --gpu (e.g. mi210, h100) or --gpu-mem (e.g. 64GiB)")
    gpu = gpu_preset(ns.gpu) if ns.gpu else custom_gpu(parse_memory(ns.gpu_mem))
    if ns.gpus_per_node < 1 or ns.nodes < 1:
        raise UserError(f"--gpus-per-node and --nodes must be >= 1 (got {ns.gpus_per_node}, {ns.nodes})")
    if not 0 <= ns.headroom < 1:
        raise UserError(f"--headroom must be in [0, 1) (got {ns.headroom})")
    cluster = Cluster(gpu, ns.gpus_per_node, ns.nodes)
    if inp.global_batch is None:
        per_gpu = (inp.micro_batch or 4) * (inp.grad_accum or 1)
        inp.global_batch = per_gpu * cluster.world_size
    seq_len = inp.seq_len or 2048
    if seq_len <= 0 or inp.global_batch <= 0:
        raise UserError(f"--seq-len and --global-batch must be > 0 (got {seq_len}, {inp.global_batch})")
    workload = Workload(config_for_planning(inp.model), inp.model, seq_len, inp.global_batch, inp.lora)
    pins = Pins(inp.ac, inp.precision, inp.zero, inp.micro_batch, inp.optimizer, inp.engine)
    result = search(workload, cluster, pins, ns.headroom)
    console = Console() if sys.stdout.isatty() else Console(width=150)  # tables stay whole in logs and pipes
    if ns.json:
        print(json.dumps(plan_dict(result)))
    else:
        render_table(result, console, ns.top)
    if result.best is None:
        closest = result.pruned[0]
        over = closest.reserved_bytes - closest.usable_bytes
        raise UserError(
            f"nothing fits on {gpu.name}: the closest candidate (AC {closest.ac}, {closest.precision}, ZeRO-{closest.zero}, "
            f"micro-batch {closest.micro_batch}, AdamW {closest.optimizer}) is {over / GIB:.2f} GiB over; "
            "try LoRA, more GPUs with ZeRO, or a shorter --seq-len"
        )
    if ns.explain is not None:
        if not 1 <= ns.explain <= len(result.fitting):
            raise UserError(f"--explain {ns.explain}: there are {len(result.fitting)} fitting candidates")
        chosen = result.fitting[ns.explain - 1]

        events = _step_events(workload, chosen)
        model = replay_allocations(events)
        render_explain(chosen, console, (model.peak_reserved, model.peak_allocated))
        if ns.simulate:
            _simulate(events, chosen, gpu, ns.hip_version, console)
    if ns.write_config:
        write_train_config(result.best, result, _train_source(inp.model), Path(ns.write_config), ns.engine,
                           ns.write_deepspeed)
        console.print(f"wrote {ns.write_config}", highlight=False)
    if ns.write_deepspeed:
        write_deepspeed(result.best, Path(ns.write_deepspeed))
        console.print(f"wrote {ns.write_deepspeed}", highlight=False)
    return 0
