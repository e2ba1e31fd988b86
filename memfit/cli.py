"""The ``memfit`` command line: argument parsers and dispatch to ``memfit.commands.<verb>.run``.

A verb's module is imported only when it runs, so ``memfit --help`` and ``memfit doctor`` do not pay
for importing transformers and the planner.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from memfit.allocator.conf import check_version_flags
from memfit.cache import cache_limit
from memfit.config.shipped import DEFAULT_CONFIG
from memfit.config.strategy import levers
from memfit.errors import UserError, print_user_error
from memfit.telemetry.bench import BENCH_AXES


def add_plan_parser(sub) -> None:
    plan = sub.add_parser(
        "plan",
        help="predict peak memory per strategy without a GPU and pick the fastest configuration that fits",
        description="Trace the trainer's own step on fake tensors, predict per-rank memory for every candidate "
        "(checkpointing x precision x ZeRO stage x micro-batch x optimizer) and rank those that fit.",
    )
    what = plan.add_argument_group("workload")
    what.add_argument("--model", help="preset (llama2-7b, llama3-8b, ...), checkpoint directory or config.json")
    what.add_argument("--seq-len", type=int, help="tokens per sequence (default 2048, or from --config)")
    what.add_argument(
        "--global-batch", type=int, help="sequences per optimizer step across all GPUs (default: GPUs x 4)"
    )
    what.add_argument("--lora", action="store_true", help="LoRA fine-tune (every Linear but the output head)")
    what.add_argument("--lora-rank", type=int, help="with --lora: LoRA rank r (default 16)")
    what.add_argument("--lora-targets", help="with --lora: comma-separated modules to adapt, e.g. q_proj,v_proj")
    what.add_argument(
        "--lora-parameters",
        help="with --lora: comma-separated 3-D expert weights to adapt, e.g. experts.gate_up_proj,experts.down_proj",
    )
    what.add_argument("--lora-alpha", type=float, help="with --lora: LoRA alpha (default 2 x rank)")
    what.add_argument(
        "--lora-modules-to-save",
        help="with --lora: comma-separated modules trained whole beside the adapters, e.g. embed_tokens,lm_head",
    )
    what.add_argument(
        "--lora-trainable-tokens",
        help="with --lora: comma-separated token ids whose embedding rows train, e.g. 128000,128009",
    )
    what.add_argument("--config", help="a memfit train YAML: model, seq_len, LoRA and its strategies become pins")
    what.add_argument(
        "--deepspeed", help="a DeepSpeed JSON: ZeRO stage, bf16/fp16, micro batch, accumulation become pins"
    )
    hw = plan.add_argument_group("hardware")
    hw.add_argument(
        "--gpu", help="GPU preset (mi210, mi250x, mi300x, a100-40g, a100-80g, h100, h200, l40s, rtx4090, ...)"
    )
    hw.add_argument("--gpu-mem", help="GPU memory instead of a preset, e.g. 64GiB")
    hw.add_argument(
        "--device",
        choices=("gpu", "cpu"),
        default="gpu",
        help="cpu: plan a run on this machine's CPU (host bytes, no allocator rounding, the runtime's resident "
        "memory stated apart), in --mem (default: the memory available now)",
    )
    hw.add_argument("--mem", help="with --device cpu: the memory the run may use, e.g. 24GiB")
    hw.add_argument("--gpus-per-node", type=int, default=1)
    hw.add_argument("--nodes", type=int, default=1)
    hw.add_argument("--headroom", type=float, default=0.05, help="fraction of GPU memory kept free (default 0.05)")
    hw.add_argument(
        "--host-mem",
        help="host memory per node that offloaded activations and optimizer state may use, e.g. 512GiB "
        "(default: this machine's)",
    )
    pin = plan.add_argument_group("pins (restrict the search)")
    for lever in levers().values():  # one pin per strategy lever
        if lever.flag:
            searched = " | ".join(map(str, lever.searched)) or "divisors of the per-GPU batch"
            pin.add_argument(lever.flag, help=f"pin {lever.config_key} (searched: {searched})")
    pin.add_argument("--engine", default="fsdp2", choices=("fsdp2", "deepspeed"), help="sharding rules")
    out = plan.add_argument_group("output")
    out.add_argument("--top", type=int, default=10, help="rows of the table (0: every row)")
    out.add_argument("--json", action="store_true", help="print the whole plan as JSON instead of tables")
    out.add_argument(
        "--max-seq-len",
        action="store_true",
        help="per shown candidate, the longest sequence (steps of 128 tokens) that still fits; for the closest "
        "that do not fit, the longest at which they would",
    )
    out.add_argument(
        "--max-micro-batch",
        action="store_true",
        help="per shown candidate, the largest micro-batch that still fits (its accumulation unchanged)",
    )
    out.add_argument("--explain", type=int, metavar="N", help="per-phase breakdown of the N-th fitting candidate")
    out.add_argument(
        "--simulate",
        action="store_true",
        help="with --explain: replay that candidate's traced step under several allocator settings",
    )
    out.add_argument("--hip-version", help="with --simulate: judge settings for this ROCm version, e.g. 6.2")
    out.add_argument("--torch-version", help="with --simulate: ... and this PyTorch release, e.g. 2.11 (default: this)")
    out.add_argument(
        "--html", metavar="PATH", help="also write the plan as one offline HTML page (sortable, breakdown per row)"
    )
    out.add_argument("--write-config", metavar="PATH", help="write the winner as a memfit train YAML")
    out.add_argument("--write-deepspeed", metavar="PATH", help="write the winner as a DeepSpeed JSON")
    plan.set_defaults(command="plan")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memfit", description="Fit LLM fine-tuning into GPU memory, and show where the memory went."
    )
    sub = parser.add_subparsers(dest="verb", required=True)
    train = sub.add_parser(
        "train",
        help="fine-tune a model (full or LoRA) with the configured memory strategies",
        description=(
            "memfit train [CONFIG] [section.key=value ...]\n\nCONFIG is a YAML file or the name of a "
            f"shipped config (default: {DEFAULT_CONFIG}). Overrides such as train.max_steps=10 or "
            "strategy.activation_checkpointing=ffn follow it. --help-config lists every key."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("args", nargs="*", metavar="CONFIG | key=value")
    train.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    train.add_argument("--help-config", action="store_true", help="list every config key with its default and meaning")
    auto = train.add_argument_group("--auto: choose the memory levers that fit this device, then train")
    auto.add_argument(
        "--auto",
        action="store_true",
        help="plan every memory lever for the device this run uses (the job and any lever given as key=value "
        "stay), print the plan, write it to the run directory, and train the fastest candidate that fits",
    )
    auto.add_argument("--mem", help="with --auto on a CPU: the memory the run may use, e.g. 8GiB (default: available)")
    dist = train.add_argument_group("distributed (launches torchrun; engine and ZeRO stage come from distributed.*)")
    dist.add_argument("--nproc-per-node", type=int, help="processes (GPUs) per node")
    dist.add_argument("--nnodes", type=int, default=1, help="nodes (default 1)")
    dist.add_argument("--node-rank", type=int, default=0, help="this node's rank among --nnodes")
    dist.add_argument("--rdzv-endpoint", help="HOST:PORT of the c10d rendezvous, the same on every node")
    dist.add_argument(
        "--numa-binding",
        metavar="MODE",
        help="bind each rank to the CPUs near its GPU (torchrun's --numa-binding: node | socket | exclusive | "
        "core-complex, where the installed torch has it)",
    )
    train.set_defaults(command="train")
    add_plan_parser(sub)
    frag = sub.add_parser(
        "frag", help="explain fragmentation in a PyTorch memory snapshot (torch.cuda.memory._dump_snapshot)"
    )
    frag.add_argument("snapshot", help="snapshot pickle (read with a restricted unpickler: plain containers only)")
    frag.add_argument("--device", type=int, help="device index in the snapshot (default: the first)")
    frag.add_argument("--out", help="directory for the PNG plots (default: SNAPSHOT.frag/)")
    frag.add_argument("--top", type=int, default=10, help="segments listed (0: every one)")
    frag.add_argument("--json", action="store_true", help="print the numbers as JSON")
    frag.add_argument("--simulate", action="store_true", help="replay the trace under other allocator settings")
    frag.add_argument("--capacity", help="device memory for --simulate, e.g. 64GiB (default: unlimited)")
    frag.add_argument("--hip-version", help="judge settings for this ROCm version, e.g. 5.7 (default: this build)")
    frag.add_argument("--torch-version", help="... and this PyTorch release, e.g. 2.11 (default: this build's)")
    frag.set_defaults(command="frag")
    bench = sub.add_parser(
        "bench", help="run a matrix of strategies, each in its own process, and tabulate memory and speed"
    )
    bench.add_argument("config", nargs="?", help=f"base train config or shipped name (default {DEFAULT_CONFIG})")
    for name, default in BENCH_AXES.items():  # one axis per benched strategy lever
        lever = levers()[name]
        bench.add_argument(lever.flag, default=default, help=f"comma-separated {lever.config_key} values ({default})")
    bench.add_argument("--lora", default="true", help="comma-separated true/false (or yes/no, on/off, 1/0)")
    bench.add_argument(
        "--zero", default="none", help="comma-separated ZeRO stages for multi-rank cells, or none (one process)"
    )
    bench.add_argument("--nproc-per-node", type=int, default=2, help="ranks of the cells with a ZeRO stage (default 2)")
    bench.add_argument(
        "--global-batch", type=int, help="sequences per step in every cell (default: the largest micro-batch)"
    )
    bench.add_argument("--steps", type=int, default=4, help="measured steps per cell")
    bench.add_argument("--warmup", type=int, default=1, help="warm-up steps per cell (not measured)")
    bench.add_argument("--mem-limit", help="cap each cell's address space (CPU OOM injection), e.g. 3GiB")
    bench.add_argument("--out", help="output directory (default runs/bench-<time>)")
    bench.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides applied to every cell")
    bench.set_defaults(command="bench")
    report = sub.add_parser(
        "report",
        help="write one offline HTML page for a run directory, a memory snapshot, a plan JSON or a bench directory",
        description="One self-contained HTML file (scripts, styles and data inline; no network request) showing a "
        "run (loss, throughput, memory over steps, plan against measurement), a snapshot (timeline with stack "
        "frames, every segment, fragmentation, OOM verdicts, --simulate what-if), a plan (memfit plan --json "
        "output: sortable candidates, breakdown by phase) or a bench (cells, memory per cell, Pareto front).",
    )
    report.add_argument("path", help="run directory, bench directory, snapshot pickle (.gz too) or plan JSON")
    report.add_argument("--out", help="the HTML file (default: DIR/report.html, or FILE.html beside a file)")
    report.add_argument("--device", type=int, help="snapshot: device index (default: the first)")
    report.add_argument("--simulate", action="store_true", help="snapshot: add the what-if replay of the trace")
    report.add_argument("--capacity", help="snapshot --simulate: device memory, e.g. 64GiB (default: unlimited)")
    report.add_argument("--hip-version", help="snapshot --simulate: judge settings for this ROCm version")
    report.add_argument("--torch-version", help="snapshot --simulate: ... and this PyTorch release")
    report.set_defaults(command="report")
    exporter = sub.add_parser(
        "exporter", help="serve per-device memory as Prometheus metrics (amdsmi / NVML / CPU fallback)"
    )
    exporter.add_argument("--port", type=int, default=9400, help="TCP port (default 9400; 0 picks a free one)")
    exporter.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    exporter.set_defaults(command="exporter")
    doctor = sub.add_parser("doctor", help="check the platform: build, devices, precisions, allocator settings")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.set_defaults(command="doctor")
    return parser


QUIET_LOGGERS = ("torchao", "torch.utils._pytree")
"""Warnings on import that say nothing about the user's run (PEFT imports torchao where it is installed):
torchao's CUDA kernels that cannot load on this machine, its enum registrations."""


PATH_OPTIONS = {
    "plan": ("model", "config", "deepspeed", "html", "write_config", "write_deepspeed"),
    "bench": ("out",),
    "frag": ("out",),
    "report": ("out",),
}
"""Options that name a file or directory: an empty one (``--out "$UNSET"``) is refused, not taken as left out."""


def check_no_empty_paths(ns) -> None:
    for dest in PATH_OPTIONS.get(ns.command, ()):
        if getattr(ns, dest, None) is not None and not getattr(ns, dest).strip():
            raise UserError(f"--{dest.replace('_', '-')} is empty: give a path or a name, or leave the option out")


def values_that_look_negative(argv: list[str]) -> list[str]:
    """``--mem -5GiB`` as ``--mem=-5GiB``: argparse reads a value that starts with ``-`` and is not a plain number as
    an option and says only "expected one argument"; no memfit option starts with a digit, so it is the option's value,
    which the option's own check then names (``--mem must look like 64GiB ...``)."""
    out: list[str] = []
    for token in argv:
        if out and token[:1] == "-" and token[1:2].isdigit() and out[-1].startswith("--") and "=" not in out[-1]:
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns, extra = parser.parse_known_args(values_that_look_negative(sys.argv[1:] if argv is None else argv))
    if getattr(ns, "command", None) == "train":  # overrides after an option: ``train cfg --auto train.max_steps=9``
        ns.args += [a for a in extra if not a.startswith("-")]
        extra = [a for a in extra if a.startswith("-")]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        check_version_flags(getattr(ns, "hip_version", None), getattr(ns, "torch_version", None))
        check_no_empty_paths(ns)
        cache_limit()  # a MEMFIT_CACHE_LIMIT that is no size: said before any work
        if ns.command == "plan":  # a question asked before is answered from the plan cache, torch not imported
            from memfit.commands.plan_cache import answer

            return answer(ns)
        return importlib.import_module(f"memfit.commands.{ns.command}").run(ns)
    except UserError as e:
        print_user_error(e)
        return e.exit_code
    except KeyboardInterrupt:
        print("memfit: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
