"""``memfit plan``: turn command-line inputs (and an optional train config / DeepSpeed JSON) into a
workload, a cluster and pins; search; print; write the winner."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from memfit.allocator.whatif import as_trace, compare, replay_allocations
from memfit.commands.frag import check_replay_options, render_whatif
from memfit.commands.plan_cache import Answered
from memfit.config.loader import json_value, load_config, read_utf8
from memfit.config.schema import EMBEDDED_MODEL, LoraConfig
from memfit.config.shipped import resolve_config_path
from memfit.config.strategy import Strategy, levers
from memfit.errors import UserError, check_output, not_a_file
from memfit.models.planning import (
    EXPERTS_LOOP_NOTE,
    asks_experts_loop,
    attention_note,
    config_for_planning,
    planning_config_file,
)
from memfit.models.presets import PRESETS
from memfit.planner.auto import this_cpu
from memfit.planner.hardware import custom_gpu, gpu_preset
from memfit.planner.limits import Limit, max_micro_batches, max_seq_lens
from memfit.planner.predict import trace_workers
from memfit.planner.report import (
    closest,
    plan_dict,
    render_explain,
    render_table,
    write_deepspeed,
    write_train_config,
)
from memfit.planner.search import (
    CONTEXT_BYTES,
    Candidate,
    Cluster,
    Pins,
    Workload,
    search,
    step_allocations,
    table_rows,
)
from memfit.units import GIB, parse_memory, this_machine_memory


@dataclass
class PlanRequest:
    """What the user asked ``memfit plan`` for, from a train config, a DeepSpeed JSON and the flags (in that
    order, later ones winning). ``pins`` maps a ``Strategy`` lever to (value, where it came from)."""

    model: str | None = None
    seq_len: int | None = None
    global_batch: int | None = None
    lora: LoraConfig | None = None
    grad_accum: int | None = None  # only sizes the default global batch; the search derives its own
    engine: str = "fsdp2"
    offload_params: bool = False  # a DeepSpeed JSON's offload_param
    data_source: str | None = None  # a train config's data.source, for --write-config
    pins: dict[str, tuple[Any, str]] = field(default_factory=dict)

    def typed_pins(self) -> dict[str, Any]:
        table = levers()
        return {name: table[name].parse(value, where) for name, (value, where) in self.pins.items()}


def _from_train_config(path: str, req: PlanRequest) -> None:
    cfg = load_config(resolve_config_path(path))  # a YAML file or a shipped config's name, as memfit train takes
    req.model = cfg.model.source
    req.seq_len = cfg.data.seq_len
    req.lora = cfg.lora if cfg.lora.enabled else None
    req.grad_accum = cfg.train.grad_accum_steps
    req.data_source = cfg.data.source
    where = f"--config {path}: "
    req.pins["activation_checkpointing"] = (
        cfg.strategy.activation_checkpointing,
        where + "strategy.activation_checkpointing",
    )
    req.pins["micro_batch_size"] = (cfg.train.micro_batch_size, where + "train.micro_batch_size")
    req.pins["packing"] = (cfg.data.packs(), where + "data.packing")
    if cfg.strategy.precision != "auto":
        req.pins["precision"] = (cfg.strategy.precision, where + "strategy.precision")
    if cfg.optimizer.implementation != "auto":
        req.pins["optimizer"] = (cfg.optimizer.implementation, where + "optimizer.implementation")
    for name, lever in levers().items():  # the other strategy-section levers, as the config sets them
        section, key = lever.config_key.split(".")
        value = getattr(cfg.strategy, key, "auto")
        if section == "strategy" and name not in req.pins and value != "auto":
            req.pins[name] = (value, where + lever.config_key)
    req.pins["optimizer_in_backward"] = (cfg.optimizer.in_backward, where + "optimizer.in_backward")
    req.pins["optimizer_name"] = (cfg.optimizer.name, where + "optimizer.name")
    req.pins["optimizer_offload"] = (cfg.optimizer.offload, where + "optimizer.offload")


def _from_deepspeed(path: str, req: PlanRequest) -> None:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--deepspeed: '{path}' {not_a_file(p)}; give a DeepSpeed JSON file")
    try:
        ds = json_value(read_utf8(p, "--deepspeed", "save it as UTF-8 JSON"))
    except json.JSONDecodeError as e:
        raise UserError(f"--deepspeed {path}:{e.lineno}: not valid JSON ({e.msg})") from None
    where = f"--deepspeed {path}: "
    if not isinstance(ds, dict):
        raise UserError(f"{where}the top level must be a JSON object (got {type(ds).__name__})")
    # torch and DeepSpeed's checks: only with --deepspeed
    from memfit.distributed.deepspeed_engine import check_layout, offloaded, setting

    check_layout(ds, f"--deepspeed {path}")
    stage = setting(ds, "zero_optimization.stage")
    if stage is not None:
        req.pins["zero_stage"] = (stage, where + "zero_optimization.stage")
    if setting(ds, "bf16.enabled"):
        req.pins["precision"] = ("bf16-mixed", where + "bf16.enabled")
    elif setting(ds, "fp16.enabled"):
        req.pins["precision"] = ("fp16-mixed", where + "fp16.enabled")
    micro = ds.get("train_micro_batch_size_per_gpu")
    if micro is not None and micro != "auto":
        req.pins["micro_batch_size"] = (micro, where + "train_micro_batch_size_per_gpu")
    accum = ds.get("gradient_accumulation_steps")
    if accum is not None and accum != "auto":
        req.grad_accum = accum
    optimizer_off, req.offload_params = offloaded(ds, f"--deepspeed {path}")
    if optimizer_off:
        req.pins["optimizer_offload"] = (True, where + "zero_optimization.offload_optimizer")
    req.engine = "deepspeed"


def _names(listed: str) -> list[str]:
    """A comma-separated flag's names."""
    return [t.strip() for t in listed.split(",") if t.strip()]


def _token_ids(listed: str) -> list[int]:
    """``--lora-trainable-tokens``: comma-separated token ids."""
    names = _names(listed)
    bad = next((n for n in names if not n.isdigit()), None)
    if bad is not None or not names:
        raise UserError(
            f"--lora-trainable-tokens takes comma-separated token ids (integers >= 0), e.g. 128000,128009 "
            f"(got '{bad if bad is not None else listed}')"
        )
    return [int(n) for n in names]


def plan_request(ns) -> PlanRequest:
    """The request the flags, ``--config`` and ``--deepspeed`` describe, with every pin parsed.

    Raises:
        UserError: naming the flag or file key of the first bad value.
    """
    req = PlanRequest()
    if ns.config is not None:
        _from_train_config(ns.config, req)
    if ns.deepspeed is not None:
        _from_deepspeed(ns.deepspeed, req)
    for attr in ("model", "seq_len", "global_batch"):
        if getattr(ns, attr) is not None:
            setattr(req, attr, getattr(ns, attr))
    for name, lever in levers().items():
        value = getattr(ns, lever.flag[2:].replace("-", "_"), None) if lever.flag else None
        if value is not None:
            req.pins[name] = (value, lever.flag)
    if ns.engine != "fsdp2":
        req.engine = ns.engine
    if ns.lora:
        rank = 16 if ns.lora_rank is None else ns.lora_rank
        lora = LoraConfig(enabled=True, rank=rank, alpha=2.0 * rank)
        if ns.lora_alpha is not None:
            lora.alpha = ns.lora_alpha
        if ns.lora_targets is not None:
            lora.target_modules = _names(ns.lora_targets)
        if ns.lora_parameters is not None:
            lora.target_parameters = _names(ns.lora_parameters)
            if not lora.target_parameters:
                raise UserError(
                    "--lora-parameters must name at least one weight, e.g. experts.gate_up_proj,experts.down_proj "
                    f"(got '{ns.lora_parameters}')"
                )
        if ns.lora_modules_to_save is not None:
            lora.modules_to_save = _names(ns.lora_modules_to_save)
        if ns.lora_trainable_tokens is not None:
            lora.trainable_tokens = _token_ids(ns.lora_trainable_tokens)
        if lora.rank < 1:
            raise UserError(f"--lora-rank must be >= 1 (got {lora.rank})")
        if not lora.target_modules and not lora.target_parameters:
            raise UserError(
                f"--lora-targets must name at least one module, e.g. q_proj,v_proj (got '{ns.lora_targets}')"
            )
        if not (math.isfinite(lora.alpha) and lora.alpha > 0):
            raise UserError(
                f"--lora-alpha must be a finite number > 0: the adapters' scale is alpha / rank (got {lora.alpha})"
            )
        req.lora = lora
    else:
        given = [
            f
            for f in (
                "--lora-rank",
                "--lora-targets",
                "--lora-parameters",
                "--lora-alpha",
                "--lora-modules-to-save",
                "--lora-trainable-tokens",
            )
            if getattr(ns, f[2:].replace("-", "_")) is not None
        ]
        if given:
            raise UserError(
                f"{', '.join(given)} describe{'s' if len(given) == 1 else ''} LoRA adapters: give --lora too"
            )
    if req.model is None:
        raise UserError("memfit plan needs --model (a preset such as llama2-7b, a checkpoint directory) or --config")
    req.typed_pins()  # every pin checked before any model is read
    return req


def _train_source(model: str) -> str:
    """``model.source`` for the written train config: paths made absolute, bare presets as random:."""

    if model in PRESETS:
        return f"random:{model}"
    if model.startswith("random:") or model == EMBEDDED_MODEL:
        return model
    path = Path(model).resolve()
    return str(path.parent if path.name.endswith(".json") else path)


def _step_events(w: Workload, c: Candidate) -> list[tuple[int, int]]:
    """The candidate's first two full-depth steps as allocations and releases (``search.step_allocations``)."""
    return step_allocations(w.model_config, w.seq_len, c.strategy, w.lora)


def _simulate(
    events: list[tuple[int, int]], c: Candidate, gpu, hip: str | None, console, torch_version: str | None
) -> None:
    """The step's trace under several allocator settings, in the GPU's memory less the runtime context
    where the trace is what one rank holds (ZeRO-0), without a limit otherwise."""

    capacity = gpu.memory_bytes - CONTEXT_BYTES if c.strategy.zero_stage == 0 else 1 << 62
    results, best = compare(as_trace(events), capacity, hip, torch_version=torch_version)
    where = (
        f"in {gpu.name}'s {gpu.memory_bytes / GIB:.0f} GiB less {CONTEXT_BYTES >> 20} MiB of runtime context"
        if c.strategy.zero_stage == 0
        else "without a capacity limit (ZeRO not applied)"
    )
    render_whatif(
        results,
        best,
        hip,
        console,
        f"what-if: the two traced steps' {len(events)} allocator events {where}",
        rocm=hip is not None or gpu.vendor == "amd",
        torch_version=torch_version,
    )
    if hip is None and gpu.vendor == "amd":
        console.print(
            "note: whether expandable_segments takes effect on ROCm depends on the ROCm version and the PyTorch "
            "release; give --hip-version (and --torch-version) to judge it",
            highlight=False,
        )


def _say_param_offload_ignored(result, deepspeed: str, console) -> None:
    """The note for a ``--deepspeed`` JSON's ``offload_param`` where candidates below ZeRO-3 ignore it."""
    below3 = sorted({c.strategy.zero_stage for c in result.fitting + result.pruned if c.strategy.zero_stage < 3})
    if below3:
        from memfit.distributed.deepspeed_engine import param_offload_ignored

        console.print(
            f"note: --deepspeed {deepspeed}: {param_offload_ignored(below3)}", highlight=False, soft_wrap=True
        )


def _with_pinning_files(message: str, pins: dict[str, tuple[Any, str]]) -> str:
    """``message`` with the ``--config``/``--deepspeed`` file that pinned each config key it names: a refusal of
    pins that do not combine says which file to edit, not only the key."""
    named = [
        where
        for _, where in pins.values()
        if where.startswith(("--config ", "--deepspeed ")) and where.rsplit(": ", 1)[-1] in message
    ]
    return message + (f" (pinned by {'; '.join(named)})" if named else "")


def _cpu_cluster(ns) -> Cluster:
    """This machine's CPU as ``--device cpu`` plans for it: ``--mem`` or the memory available now, and the
    resident memory of this process (torch and transformers imported) as the runtime's share.

    Raises:
        UserError: for GPU flags given with it, or more than one rank.
    """
    if ns.gpu or ns.gpu_mem or ns.host_mem:
        raise UserError("--device cpu plans this machine's memory: give --mem, not --gpu / --gpu-mem / --host-mem")
    if ns.gpus_per_node != 1 or ns.nodes != 1:
        raise UserError(f"--device cpu plans one process (got {ns.gpus_per_node} x {ns.nodes}); drop --gpus-per-node")
    return this_cpu(ns.mem)


def _with_more_host_memory(pruned: list[Candidate]) -> str:
    """The least host memory that would make a candidate fit whose device memory already does, in words."""
    host_only = [c for c in pruned if c.reserved_bytes <= c.usable_bytes and not c.fits_host]
    if not host_only:
        return ""
    c = min(host_only, key=lambda k: (k.host_node_bytes, k.step_time_s))
    return f"; with --host-mem {math.ceil(c.host_node_bytes / GIB)}GiB, {c.strategy.label()} would fit"


def _limits(result, ns) -> dict[Strategy, dict[str, Limit]]:
    """``--max-seq-len`` / ``--max-micro-batch`` for the rows the table shows (and the closest that do not fit)."""
    out: dict[Strategy, dict[str, Limit]] = {}
    shown = [row.first for row in table_rows(result.fitting)[: ns.top]]
    if ns.max_micro_batch and shown:
        for c, limit in zip(shown, max_micro_batches(result, shown)):
            out.setdefault(c.strategy, {})["max_micro_batch"] = limit
    if ns.max_seq_len:
        asked = shown + closest(result)
        for c, limit in zip(asked, max_seq_lens(result, asked)):
            out.setdefault(c.strategy, {})["max_seq_len"] = limit
    return out


def run(ns, answered: Answered | None = None) -> int:
    """Plan what ``ns`` asks; ``answered`` (the plan cache's) learns the input files once the search ran."""
    req = plan_request(ns)
    if ns.gpu and ns.gpu_mem:
        raise UserError("give --gpu or --gpu-mem, not both")
    if ns.simulate and ns.device == "cpu":
        raise UserError("--simulate replays a GPU's caching allocator; a --device cpu plan has none")
    if ns.simulate and ns.explain is None:
        raise UserError("--simulate replays one candidate's step: give --explain N too (N = its row in the table)")
    check_replay_options(ns)
    if ns.top < 0:  # this and the rest are said before the search, not after it
        raise UserError(f"--top must be >= 0 (got {ns.top})")
    ns.top = ns.top or None  # 0: every row (a slice to None)
    if ns.explain is not None and ns.explain < 1:
        raise UserError(f"--explain must be a row of the table, 1 or more (got {ns.explain})")
    if ns.gpus_per_node < 1 or ns.nodes < 1:
        raise UserError(f"--gpus-per-node and --nodes must be >= 1 (got {ns.gpus_per_node}, {ns.nodes})")
    if not 0 <= ns.headroom < 1:
        raise UserError(f"--headroom must be in [0, 1) (got {ns.headroom})")
    outputs = {"--html": ns.html, "--write-config": ns.write_config, "--write-deepspeed": ns.write_deepspeed}
    for flag, path in outputs.items():
        if path:
            check_output(Path(path), f"give another {flag}")
    if ns.device == "cpu":
        cluster = _cpu_cluster(ns)
    else:
        if ns.mem:
            raise UserError("--mem is the memory of a --device cpu plan; for a GPU give --gpu-mem")
        if not ns.gpu and not ns.gpu_mem:
            raise UserError("memfit plan needs --gpu (e.g. mi210, h100), --gpu-mem (e.g. 64GiB) or --device cpu")
        gpu = gpu_preset(ns.gpu) if ns.gpu else custom_gpu(parse_memory(ns.gpu_mem))
        host_mem = parse_memory(ns.host_mem, "--host-mem") if ns.host_mem else (this_machine_memory() or None)
        cluster = Cluster(gpu, ns.gpus_per_node, ns.nodes, host_mem)
    gpu = cluster.gpu
    pinned = req.typed_pins()
    if req.global_batch is None:
        per_gpu = pinned.get("micro_batch_size", 4) * (req.grad_accum or 1)
        req.global_batch = per_gpu * cluster.world_size
    seq_len = 2048 if req.seq_len is None else req.seq_len
    if seq_len <= 0 or req.global_batch <= 0:
        raise UserError(f"--seq-len and --global-batch must be > 0 (got {seq_len}, {req.global_batch})")
    workload = Workload(config_for_planning(req.model), req.model, seq_len, req.global_batch, req.lora)
    pins = Pins(pinned, req.engine, req.offload_params)
    with trace_workers():  # the search's trace workers serve the limits' probes too
        try:
            result = search(workload, cluster, pins, ns.headroom)
        except UserError as e:
            raise UserError(_with_pinning_files(str(e), req.pins)) from None
        limits = _limits(result, ns)
    if answered is not None and not gpu.is_cpu:  # a CPU plan reads the memory available now: never kept
        model_file = planning_config_file(req.model)
        config = resolve_config_path(ns.config) if ns.config else None
        answered.inputs = [str(Path(p).resolve()) for p in (config, ns.deepspeed, model_file) if p]
    # tables stay whole in logs and pipes; with --json, stdout holds the JSON alone and the rest goes to stderr
    stream = sys.stderr if ns.json else sys.stdout
    console = Console(file=stream) if stream.isatty() else Console(file=stream, width=190)
    if ns.json:
        print(json.dumps(plan_dict(result, limits)))
    else:
        render_table(result, console, ns.top, limits)
    if req.offload_params:
        _say_param_offload_ignored(result, ns.deepspeed, console)
    loop = EXPERTS_LOOP_NOTE if asks_experts_loop(workload.model_config) else None
    for note in filter(None, (attention_note(workload.model_config, "sdpa"), loop)):
        console.print(f"note: {note}", highlight=False, soft_wrap=True)
    if ns.html:  # written before a "nothing fits" error too: the closest candidates are what to look at then
        from memfit.pages.html import write_page
        from memfit.pages.plan import plan_page

        page = write_page(plan_page(plan_dict(result, limits), "memfit plan"), Path(ns.html))
        print(f"wrote {page}", file=sys.stderr)
    if result.best is None:
        closest = result.pruned[0]
        raise UserError(
            f"nothing fits on {gpu.name}: the closest candidate ({closest.strategy.label()}) {closest.why_not()}; "
            + ("give it more host memory (--host-mem), or " if not closest.fits_host else "")
            + ("try " if req.lora else "try LoRA, ")
            + ("more --mem" if gpu.is_cpu else "more GPUs with ZeRO")
            + (", a lower --lora-rank" if req.lora else "")
            + ", or a shorter --seq-len"
            + _with_more_host_memory(result.pruned)
        )
    if ns.explain is not None:
        rows = table_rows(result.fitting)
        if not 1 <= ns.explain <= len(rows):
            raise UserError(f"--explain must be a row of the table, 1 to {len(rows)} (got {ns.explain})")
        chosen = rows[ns.explain - 1].first
        if gpu.is_cpu:  # no caching allocator to replay
            render_explain(chosen, console)
            return 0

        events = _step_events(workload, chosen)
        model = replay_allocations(events)
        render_explain(chosen, console, (model.peak_reserved, model.peak_allocated))
        if ns.simulate:
            import torch

            _simulate(events, chosen, gpu, ns.hip_version, console, ns.torch_version or torch.__version__)
    if ns.write_config:
        write_train_config(
            result.best,
            result,
            _train_source(req.model),
            Path(ns.write_config),
            ns.engine,
            ns.write_deepspeed,
            req.data_source,
        )
        console.print(f"wrote {ns.write_config}", highlight=False)
    if ns.write_deepspeed:
        write_deepspeed(result.best, Path(ns.write_deepspeed))
        console.print(f"wrote {ns.write_deepspeed}", highlight=False)
    return 0
