"""Presenting a plan: the rich table, ``--json``, ``--explain``, and the configs it writes."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from memfit.config.schema import LoraConfig
from memfit.config.strategy import OPTIMIZER_IMPLEMENTATIONS, Strategy, levers
from memfit.errors import write_output
from memfit.planner.categories import PHASES, Category
from memfit.planner.cost import assumptions
from memfit.planner.limits import MAX_MICRO_BATCH, SEQ_STEP, Limit
from memfit.planner.search import ALLOCATOR_MARGIN, CONTEXT_BYTES, Candidate, PlanResult, Row, table_rows
from memfit.units import GIB

CLOSEST_SHOWN = 3  # candidates listed under "closest that do not fit"
Limits = dict[Strategy, dict[str, Limit]]  # --max-seq-len / --max-micro-batch per candidate (``planner.limits``)


def _g(n: int) -> str:
    return f"{n / GIB:.2f}"


def lora_label(lora: LoraConfig | None) -> str:
    """`` + LoRA`` for the default adapters (every projection, alpha 2 x rank), else their rank, targets
    and alpha."""
    if lora is None:
        return ""
    default = LoraConfig()
    targets = (lora.target_modules, lora.target_parameters) == (default.target_modules, default.target_parameters)
    beside = f" ({lora.trained_beside()})" if lora.trained_beside() else ""
    if targets and lora.alpha == 2.0 * lora.rank:
        return f" + LoRA{beside}"
    adapted = ",".join([*lora.target_modules, *lora.target_parameters])
    return f" + LoRA r={lora.rank} on {adapted} (alpha {lora.alpha:g}){beside}"


def _lora_dict(lora: LoraConfig) -> dict[str, Any]:
    adapted = {"target_modules": list(lora.target_modules)}
    if lora.target_parameters:
        adapted["target_parameters"] = list(lora.target_parameters)
    if lora.modules_to_save:
        adapted["modules_to_save"] = list(lora.modules_to_save)
    if lora.trainable_tokens:
        adapted["trainable_tokens"] = list(lora.trainable_tokens)
    return {"rank": lora.rank, "alpha": lora.alpha, **adapted}


def candidate_dict(c: Candidate, limits: Limits | None = None) -> dict[str, Any]:
    found = (limits or {}).get(c.strategy, {})
    return {
        **c.strategy.as_dict(),
        "peak_bytes": c.memory.peak_bytes,
        "peak_phase": c.memory.peak_phase,
        "host_peak_bytes": c.memory.host_peak_bytes,
        "host_node_bytes": c.host_node_bytes,
        "peak_by_category_bytes": c.memory.peak.as_dict(),
        "phase_peaks_bytes": {p: b.as_dict() for p, b in c.memory.phase_peaks.items()},
        "predicted_reserved_bytes": c.reserved_bytes,
        "usable_bytes": c.usable_bytes,
        "fits": c.fits,
        "estimated_step_time_s": c.step_time_s,
        "comm_bytes_per_step": c.comm_bytes,
        **{name: {"value": lim.value, "at_ceiling": lim.at_ceiling} for name, lim in found.items()},
    }


def plan_dict(r: PlanResult, limits: Limits | None = None) -> dict[str, Any]:
    w, cl = r.workload, r.cluster
    return {
        "model": w.model_name,
        "seq_len": w.seq_len,
        "global_batch": w.global_batch,
        "lora": w.lora is not None,
        **({"lora_config": _lora_dict(w.lora)} if w.lora else {}),
        "gpu": cl.gpu.name,
        "gpu_memory_bytes": cl.gpu.memory_bytes,
        "gpus_per_node": cl.gpus_per_node,
        "nodes": cl.nodes,
        "host_mem_bytes": cl.host_mem_bytes,
        "runtime_bytes": cl.runtime_bytes if cl.gpu.is_cpu else None,
        "headroom": r.headroom,
        "allocator_margin": ALLOCATOR_MARGIN,
        "context_bytes": CONTEXT_BYTES,
        "assumptions": _assumptions(r),
        "traces": r.traces,
        "cached_traces": r.cached_traces,
        "untried": r.untried,
        "fitting": [candidate_dict(c, limits) for c in r.fitting],
        "pruned": [dict(candidate_dict(c, limits), reason=c.why_not()) for c in r.pruned],
    }


def _assumptions(r: PlanResult) -> str:
    """The step-time model's assumptions, with the host's where any candidate offloads."""
    cl, every = r.cluster, (*r.fitting, *r.pruned)
    activations = any(c.strategy.activation_offload for c in every)
    optimizer = any(c.strategy.optimizer_offload for c in every)
    host = cl.gpu.host_GBps if activations or optimizer else None
    return assumptions(
        cl.gpu.peak_tflops,
        cl.gpu.link_GBps,
        cl.nodes,
        host,
        activations,
        optimizer,
        cl.gpu.fp32_slowdown,
        cl.gpu.memory_GBps,
    )


def _reserved_note(r: PlanResult) -> str:
    cl = r.cluster
    if cl.gpu.is_cpu:
        return (
            f"*reserved = peak (tensors, exact bytes) + {cl.runtime_bytes / GIB:.2f} GiB runtime resident (this "
            f"process with torch and transformers loaded); usable = {(1 - r.headroom):.0%} of the memory. With room "
            "for 3x its peak a run keeps freed memory between steps, and its resident set grows past this "
            "(allocator.host_keep_freed, docs/train.md)"
        )
    return (
        f"*reserved = peak x {1 + ALLOCATOR_MARGIN:g} + {CONTEXT_BYTES >> 20} MiB context; usable = "
        f"{(1 - r.headroom):.0%} of the GPU"
    )


def _offloaded(s) -> str:
    """The table's offload column: what the candidate keeps in host memory."""
    return "+".join(n for n, on in (("activ", s.activation_offload), ("optim", s.optimizer_offload)) if on) or "-"


def _limits_note(r: PlanResult, limits: Limits) -> str:
    found = {name for per in limits.values() for name in per}
    notes = []
    if "max_micro_batch" in found:
        notes.append(
            f"max mb = the largest micro-batch that still fits, its accumulation unchanged ({MAX_MICRO_BATCH}+: "
            "the search's ceiling)"
        )
    if "max_seq_len" in found:
        notes.append(
            f"max seq = the longest sequence that still fits, in steps of {SEQ_STEP} tokens "
            f"({r.workload.model_config.max_position_embeddings}+: the model's max_position_embeddings)"
        )
    return "".join(f" {n[0].upper()}{n[1:]}." for n in notes)


def render_table(r: PlanResult, console: Console, top: int, limits: Limits | None = None) -> None:
    limits = limits or {}
    extra = [n for n in ("max_micro_batch", "max_seq_len") if any(n in per for per in limits.values())]
    w, cl = r.workload, r.cluster
    title = (
        f"{w.model_name}{lora_label(w.lora)}, seq {w.seq_len}, global batch {w.global_batch} on "
        f"{cl.gpus_per_node * cl.nodes} x {cl.gpu.name} ({cl.gpu.memory_bytes / GIB:g} GiB); per-rank GiB"
    )
    t = Table(title=title)
    for col in (
        "#",
        "AC",
        "precision",
        "CE chunks",
        "offload",
        "ZeRO",
        "mb x acc",
        "AdamW",
        "in bwd",
        "params",
        "grads",
        "optim",
        "activ",
        "temps",
        "peak",
        "host",
        "reserved*",
        "free",
        "step time",
        *(EXTRA_COLUMNS[n] for n in extra),
    ):
        t.add_column(col, justify="right" if col not in ("AC", "precision", "AdamW", "offload", "in bwd") else "left")
    best = r.best.step_time_s if r.best else 1.0
    rows = table_rows(r.fitting)
    for i, row in enumerate(rows[:top], 1):
        c = row.first
        p, s = c.memory.peak, c.strategy

        def each(text: Callable[[Strategy], str], row: Row = row) -> str:  # the row's members' settings, once each
            return "/".join(dict.fromkeys(text(m.strategy) for m in row.candidates))

        t.add_row(
            str(i),
            each(lambda s: str(s.activation_checkpointing)),
            each(lambda s: s.precision + (f" {s.quantize_base.upper()}" if s.quantize_base != "none" else "")),
            each(lambda s: str(s.loss_chunks or "-")),
            each(_offloaded),
            each(lambda s: str(s.zero_stage)),
            each(lambda s: f"{s.micro_batch_size}x{s.grad_accum_steps}"),
            _adamw(row),
            each(lambda s: "yes" if s.optimizer_in_backward else "-"),
            _g(p[Category.PARAMS]),
            _g(p[Category.GRADS]),
            _g(p[Category.OPTIMIZER]),
            _g(p[Category.ACTIVATIONS]),
            _g(p[Category.TEMPORARIES]),
            _g(c.memory.peak_bytes),
            _g(c.memory.host_peak_bytes),
            _g(c.reserved_bytes),
            _g(c.headroom_bytes),
            f"{c.step_time_s / best:.2f}x",
            *(limits[s][n].label() if n in limits.get(s, {}) else "" for n in extra),
        )
    console.print(t)
    console.print(
        f"{len(r.fitting)} of {len(r.fitting) + len(r.pruned)} candidates fit"
        + (
            f" in {len(rows)} rows (a/b, AdamW any: alike in predicted memory and time)"
            if len(rows) < len(r.fitting)
            else ""
        )
        + f" ({r.traces} traces"
        + (f", {r.cached_traces} of them from the trace cache" if r.cached_traces else "")
        + (
            f"; {r.untried} with a fallback (offloading, the step in backward, low-bit AdamW states, an NF4 base) "
            "not tried: each only where no candidate as fast fits without it and no predicted relative shows it "
            "cannot fit, activation offloading only where no other does"
            if r.untried
            else ""
        )
        + "). "
        + _reserved_note(r)
        + "; host = host memory per rank at its peak"
        + (f", at most {cl.host_mem_bytes / GIB:.2f} GiB per node (--host-mem)" if cl.host_mem_bytes else "")
        + f". Relative step time: {_assumptions(r)}."
        + _limits_note(r, limits),
        highlight=False,
    )
    if r.pruned:
        console.print("closest that do not fit:", highlight=False)
        for c in closest(r):
            seq = limits.get(c.strategy, {}).get("max_seq_len")
            shorter = (
                ""
                if seq is None
                else (f"; it fits at seq {seq.value}" if seq.value else f"; it fits at no seq (steps of {SEQ_STEP})")
            )
            console.print(f"  {c.strategy.label()}: {c.why_not()}{shorter}", highlight=False)


def closest(r: PlanResult) -> list[Candidate]:
    """The candidates that miss by the least, one per row of alike ones (``table_rows``)."""
    return [row.first for row in table_rows(r.pruned)[:CLOSEST_SHOWN]]


def _adamw(row: Row) -> str:
    """The AdamW column of a row: ``any`` where every implementation of its AdamW predicts alike."""
    labels = list(dict.fromkeys(c.strategy.adamw_label() for c in row.candidates))
    if {c.strategy.optimizer for c in row.candidates} == set(OPTIMIZER_IMPLEMENTATIONS) and len(labels) == len(
        OPTIMIZER_IMPLEMENTATIONS
    ):
        return "any" + ("@host" if row.first.strategy.optimizer_offload else "")
    return "/".join(labels)


EXTRA_COLUMNS = {"max_micro_batch": "max mb", "max_seq_len": "max seq"}


def render_explain(c: Candidate, console: Console, replayed: tuple[int, int] | None = None) -> None:
    t = Table(title=f"per phase peak, GiB per rank: {c.strategy.label()}")
    t.add_column("phase")
    for cat in Category:
        t.add_column(cat.value, justify="right")
    t.add_column("total", justify="right")
    for phase in PHASES:
        if phase in c.memory.phase_peaks:
            b = c.memory.phase_peaks[phase]
            mark = " (peak)" if phase == c.memory.peak_phase else ""
            t.add_row(phase + mark, *(_g(b[cat]) for cat in Category), _g(b.total_bytes))
    console.print(t)
    if replayed is not None:
        reserved, allocated = replayed
        console.print(
            "allocator model, first two steps (up to 2 micro-batches each) replayed on one device (ZeRO "
            "not applied): peak reserved "
            f"{_g(reserved)} GiB for a peak allocated {_g(allocated)} GiB ({reserved / max(1, allocated) - 1:+.1%}); "
            f"the table's margin model assumes +{ALLOCATOR_MARGIN:.0%}",
            highlight=False,
        )


PACKED_DATA = "shakespeare-chat"
"""What a written config packs where the plan had no data of its own (``memfit.train.plays``)."""


def write_train_config(
    c: Candidate,
    r: PlanResult,
    source: str,
    path: Path,
    engine: str = "fsdp2",
    deepspeed_json: str | None = None,
    data_source: str | None = None,
) -> None:
    """The winner as a ``memfit train`` YAML. ``data_source``: the ``--config``'s data; without one, train's default
    (text blocks), or for packed rows, which pack chat records, memfit's offline chat set, said in the header."""
    w, s = r.workload, c.strategy
    data = data_source or (PACKED_DATA if s.packing else None)
    cfg: dict = {
        "model": {"source": source},
        "data": {
            **({"source": data} if data else {}),
            "seq_len": w.seq_len,
            **({"packing": True} if s.packing else {}),
        },
        "strategy": {  # every lever of the strategy section, as the vocabulary lists them
            lever.config_key.split(".")[1]: s.as_dict()[name]
            for name, lever in levers().items()
            if lever.config_key.startswith("strategy.")
        },
        "lora": {
            "enabled": w.lora is not None,
            **(_lora_dict(w.lora) if w.lora else {}),
            **({"quantize_base": s.quantize_base} if w.lora else {}),
        },
        "optimizer": {"name": s.optimizer_name, "implementation": s.optimizer, "in_backward": s.optimizer_in_backward}
        | ({"grad_clip": 0.0} if s.optimizer_in_backward else {}),
        "train": {
            "device": "cuda",
            "micro_batch_size": s.micro_batch_size,
            "grad_accum_steps": s.grad_accum_steps,
            "global_batch_size": w.global_batch,
        },
    }
    header = (
        f"# written by memfit plan: {c.strategy.label()}\n# predicted per-rank peak {_g(c.memory.peak_bytes)} GiB, "
        f"reserved {_g(c.reserved_bytes)} GiB of {_g(c.usable_bytes)} GiB usable on {r.cluster.gpu.name}\n"
    )
    if s.packing and not data_source:
        header += (
            f"# packed rows pack chat records: data.source {PACKED_DATA} is memfit's offline set; give your .jsonl\n"
        )
    if r.cluster.world_size > 1:
        cfg["distributed"] = {"engine": engine, "zero_stage": s.zero_stage}
        if engine == "deepspeed":
            cfg["distributed"]["deepspeed_config"] = deepspeed_json or "ds.json"
        nodes = r.cluster.world_size // r.cluster.gpus_per_node
        launch = f"--nproc-per-node {r.cluster.gpus_per_node}"
        if nodes > 1:
            launch += f" --nnodes {nodes} --node-rank <this node> --rdzv-endpoint <node 0>:29400"
        header += (
            f"# planned for {r.cluster.world_size} GPUs with ZeRO-{s.zero_stage}: memfit train {path.name} {launch}\n"
        )
    write_output(path, header + yaml.safe_dump(cfg, sort_keys=False), "choose another path for --write-config")


def write_deepspeed(c: Candidate, path: Path) -> None:
    s = c.strategy
    ds = {
        "train_micro_batch_size_per_gpu": s.micro_batch_size,
        "gradient_accumulation_steps": s.grad_accum_steps,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": s.zero_stage, "contiguous_gradients": True, "overlap_comm": False},
        "bf16": {"enabled": s.precision.startswith("bf16")},
        "fp16": {"enabled": s.precision == "fp16-mixed"},
    }
    if s.optimizer_offload:
        ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    write_output(path, json.dumps(ds, indent=2) + "\n", "choose another path for --write-deepspeed")
