"""The ``memfit`` command line: a thin layer that parses arguments and hands off to the library."""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

from memfit.errors import UserError, print_user_error

DEFAULT_CONFIG = "smollm2-shakespeare-lora-cpu"


def shipped_configs() -> dict[str, Path]:
    """Configs that ship with memfit, by name (file name without .yaml)."""
    root = resources.files("memfit") / "configs"
    return {Path(p.name).stem: Path(str(p)) for p in root.iterdir() if p.name.endswith(".yaml")}


def resolve_config_path(arg: str | None) -> Path:
    """A config path from the argument: a file, a shipped config name, or the default when absent."""
    if arg is None:
        return shipped_configs()[DEFAULT_CONFIG]
    if Path(arg).is_file():
        return Path(arg)
    shipped = shipped_configs()
    if arg in shipped:
        return shipped[arg]
    from memfit.errors import did_you_mean

    raise UserError(
        f"config '{arg}' is neither a file nor a shipped config{did_you_mean(arg, shipped)}; "
        f"shipped: {', '.join(sorted(shipped))}"
    )


def split_train_args(args: list[str]) -> tuple[str | None, list[str]]:
    """The optional CONFIG (first argument without '=') and the key=value overrides."""
    config = None
    overrides = []
    for a in args:
        if "=" in a or config is not None:
            overrides.append(a)
        else:
            config = a
    return config, overrides


def cmd_train(ns: argparse.Namespace) -> int:
    from memfit.config.loader import config_help, dump_config, load_config

    if ns.help_config:
        print(config_help())
        return 0
    config_arg, overrides = split_train_args(ns.args)
    cfg = load_config(resolve_config_path(config_arg), overrides)
    if ns.print_config:
        print(dump_config(cfg), end="")
        return 0
    if ns.nproc_per_node is not None or ns.nnodes > 1:
        from memfit.dist.launch import LaunchSpec, launch

        spec = LaunchSpec(ns.nproc_per_node or 1, ns.nnodes, ns.node_rank, ns.rdzv_endpoint)
        return launch(spec, cfg, resolve_config_path(config_arg), overrides)
    from memfit.dist.runtime import launched_ranks

    if launched_ranks() > 1:  # a rank started by torchrun
        from memfit.dist.worker import run_rank

        run_rank(cfg)
    from memfit.train.loop import Trainer

    trainer = Trainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.close()
    return 0


def cmd_exporter(ns: argparse.Namespace) -> int:
    import time

    from memfit.telemetry.prometheus import serve_exporter

    try:
        server, backend = serve_exporter(ns.port, ns.host)
    except OSError as e:
        raise UserError(f"--port {ns.port}: cannot listen on {ns.host} ({e.strerror}); pick a free port") from None
    print(f"memfit exporter: device memory from {backend} at http://{ns.host}:{server.server_port}/metrics", flush=True)
    try:
        while True:
            time.sleep(3600)
    finally:
        server.shutdown()


def cmd_plan(ns: argparse.Namespace) -> int:
    from memfit.memory.planner import run_plan

    return run_plan(ns)


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
    what.add_argument("--global-batch", type=int, help="sequences per optimizer step across all GPUs (default: GPUs x 4)")
    what.add_argument("--lora", action="store_true", help="LoRA fine-tune (all attention and MLP projections)")
    what.add_argument("--lora-rank", type=int, default=16)
    what.add_argument("--config", help="a memfit train YAML: model, seq_len, LoRA and its strategies become pins")
    what.add_argument("--deepspeed", help="a DeepSpeed JSON: ZeRO stage, bf16/fp16, micro batch, accumulation become pins")
    hw = plan.add_argument_group("hardware")
    hw.add_argument("--gpu", help="GPU preset (mi210, mi250x, mi300x, a100-40g, a100-80g, h100, h200, l40s, rtx4090, ...)")
    hw.add_argument("--gpu-mem", help="GPU memory instead of a preset, e.g. 64GiB")
    hw.add_argument("--gpus-per-node", type=int, default=1)
    hw.add_argument("--nodes", type=int, default=1)
    hw.add_argument("--headroom", type=float, default=0.05, help="fraction of GPU memory kept free (default 0.05)")
    pin = plan.add_argument_group("pins (restrict the search)")
    pin.add_argument("--ac", help="none | full | ffn | every_k:N")
    pin.add_argument("--precision", help="fp32 | bf16-mixed | fp16-mixed | bf16-pure")
    pin.add_argument("--zero", type=int, help="ZeRO stage 0-3")
    pin.add_argument("--micro-batch", type=int)
    pin.add_argument("--optimizer", help="fused | foreach | for-loop")
    pin.add_argument("--engine", default="fsdp2", help="sharding semantics: fsdp2 (default) | deepspeed")
    out = plan.add_argument_group("output")
    out.add_argument("--top", type=int, default=10, help="rows of the table")
    out.add_argument("--json", action="store_true", help="print the whole plan as JSON instead of tables")
    out.add_argument("--explain", type=int, metavar="N", help="per-phase breakdown of the N-th fitting candidate")
    out.add_argument("--simulate", action="store_true",
                     help="with --explain: replay that candidate's traced step under several allocator settings")
    out.add_argument("--hip-version", help="with --simulate: judge settings for this ROCm version, e.g. 6.2")
    out.add_argument("--write-config", metavar="PATH", help="write the winner as a memfit train YAML")
    out.add_argument("--write-deepspeed", metavar="PATH", help="write the winner as a DeepSpeed JSON")
    plan.set_defaults(func=cmd_plan)


def cmd_frag(ns: argparse.Namespace) -> int:
    from memfit.memory.frag_command import run_frag

    return run_frag(ns)


def cmd_bench(ns: argparse.Namespace) -> int:
    from memfit.telemetry.bench import run_bench

    return run_bench(ns, str(resolve_config_path(ns.config)))


def cmd_doctor(ns: argparse.Namespace) -> int:
    import json

    from rich.console import Console

    from memfit.doctor import render, report

    r = report()
    if ns.json:
        print(json.dumps(r))
    else:
        render(r, Console())
    return 1 if r["problems"] else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memfit", description="Fit LLM fine-tuning into GPU memory, and show where the memory went.")
    sub = parser.add_subparsers(dest="command", required=True)
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
    dist = train.add_argument_group("distributed (launches torchrun; engine and ZeRO stage come from distributed.*)")
    dist.add_argument("--nproc-per-node", type=int, help="processes (GPUs) per node")
    dist.add_argument("--nnodes", type=int, default=1, help="nodes (default 1)")
    dist.add_argument("--node-rank", type=int, default=0, help="this node's rank among --nnodes")
    dist.add_argument("--rdzv-endpoint", help="HOST:PORT of the c10d rendezvous, the same on every node")
    train.set_defaults(func=cmd_train)
    add_plan_parser(sub)
    frag = sub.add_parser("frag", help="explain fragmentation in a PyTorch memory snapshot (torch.cuda.memory._dump_snapshot)")
    frag.add_argument("snapshot", help="snapshot pickle (read with a restricted unpickler: plain containers only)")
    frag.add_argument("--device", type=int, help="device index in the snapshot (default: the first)")
    frag.add_argument("--out", help="directory for the PNG plots (default: SNAPSHOT.frag/)")
    frag.add_argument("--top", type=int, default=10, help="segments listed")
    frag.add_argument("--json", action="store_true", help="print the numbers as JSON")
    frag.add_argument("--simulate", action="store_true", help="replay the trace under other allocator settings")
    frag.add_argument("--capacity", help="device memory for --simulate, e.g. 64GiB (default: unlimited)")
    frag.add_argument("--hip-version", help="judge settings for this ROCm version, e.g. 5.7 (default: this build)")
    frag.set_defaults(func=cmd_frag)
    bench = sub.add_parser("bench", help="run a matrix of strategies, each in its own process, and tabulate memory and speed")
    bench.add_argument("config", nargs="?", help=f"base train config or shipped name (default {DEFAULT_CONFIG})")
    bench.add_argument("--ac", default="none,full", help="comma-separated checkpointing policies")
    bench.add_argument("--precision", default="fp32", help="comma-separated precisions")
    bench.add_argument("--micro-batch", default="2", help="comma-separated micro-batch sizes")
    bench.add_argument("--lora", default="true", help="comma-separated true/false")
    bench.add_argument("--zero", default="none", help="comma-separated ZeRO stages for multi-rank cells, or none (one process)")
    bench.add_argument("--nproc-per-node", type=int, default=2, help="ranks of the cells with a ZeRO stage (default 2)")
    bench.add_argument("--global-batch", type=int, help="sequences per step in every cell (default: the largest micro-batch)")
    bench.add_argument("--steps", type=int, default=4, help="measured steps per cell")
    bench.add_argument("--warmup", type=int, default=1, help="warm-up steps per cell (not measured)")
    bench.add_argument("--mem-limit", help="cap each cell's address space (CPU OOM injection), e.g. 3GiB")
    bench.add_argument("--out", help="output directory (default runs/bench-<time>)")
    bench.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides applied to every cell")
    bench.set_defaults(func=cmd_bench)
    exporter = sub.add_parser("exporter", help="serve per-device memory as Prometheus metrics (amdsmi / NVML / CPU fallback)")
    exporter.add_argument("--port", type=int, default=9400)
    exporter.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    exporter.set_defaults(func=cmd_exporter)
    doctor = sub.add_parser("doctor", help="check the platform: build, devices, precisions, allocator settings")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.set_defaults(func=cmd_doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns)
    except UserError as e:
        print_user_error(e)
        return e.exit_code
    except KeyboardInterrupt:
        print("memfit: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
