"""Planner speed on this machine: a full search for Llama-2-7B and Llama-2-70B, and one full-depth trace.

    python benchmarks/plan_speed.py

Targets (issue 3): 7B search (>= 100 candidates) <= 10 s, 70B <= 20 s (issue 16: the 70B and 13B QLoRA searches
too), one 7B full-depth trace <= 5 s; issue 21:
<= 5 s cold and <= 1 s warm. Each search runs in a fresh Predictor twice: cold (an empty trace cache in a temporary
directory) and warm (the same search again, every trace read from that cache). Imports are not timed. Then the
README's example as a user runs it, `memfit plan` in its own process (imports timed): cold (empty trace and plan
caches), traces warm (a new question: the plan cache empty, every trace cached) and asked again (answered from the
plan cache). Prints a table, then one JSON line.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import memfit
from memfit.cli import build_parser
from memfit.commands.plan import plan_request
from memfit.config.strategy import CheckpointPolicy, Strategy
from memfit.models.planning import config_for_planning
from memfit.planner.hardware import gpu_preset
from memfit.planner.search import Cluster, Workload, search
from memfit.planner.trace import StepSpec, trace_step
from memfit.units import this_machine_memory

README_PLAN = ["plan", "--model", "llama2-7b", "--gpu", "mi210", "--seq-len", "2048", "--global-batch", "16", "--lora"]


def cli_seconds() -> dict[str, float]:
    """Wall seconds of the README's `memfit plan` example in a fresh process: cold, traces warm, asked again."""
    root = tempfile.mkdtemp(prefix="memfit-plan-cli-")
    # the memfit this benchmark imported (a worktree's through PYTHONPATH), first on the path, from a directory without
    # one: `python -m` puts the working directory first, which in the repository root is its own memfit
    tree = str(Path(memfit.__file__).resolve().parents[1])
    env = dict(os.environ, MEMFIT_TRACE_CACHE=f"{root}/traces")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tree, os.environ.get("PYTHONPATH")) if p)
    out = {}
    for name, plans in (("cold", "cold"), ("traces_warm", "other"), ("asked_again", "other")):
        env["MEMFIT_PLAN_CACHE"] = f"{root}/plans-{plans}"
        t0 = time.perf_counter()
        p = subprocess.run(
            [sys.executable, "-m", "memfit.cli", *README_PLAN, "--top", "2"],
            env=env,
            cwd=root,
            capture_output=True,
            text=True,
        )
        out[name] = time.perf_counter() - t0
        if p.returncode != 0:
            raise SystemExit(f"memfit plan failed ({p.returncode}): {p.stderr.strip()}")
    return out


def main() -> None:
    warm = config_for_planning("tiny")
    trace_step(StepSpec(warm, 64, Strategy(micro_batch_size=2)))  # import/compile warm-up, not timed
    cases = [
        ("llama2-7b full FT, 1 x mi210, seq 4096, batch 16", "llama2-7b", 4096, 16, Cluster(gpu_preset("mi210"))),
        ("llama2-7b full FT, 8 x mi210, seq 4096, batch 64", "llama2-7b", 4096, 64, Cluster(gpu_preset("mi210"), 8)),
        (
            "llama2-70b full FT, 8 x mi300x, seq 4096, batch 64",
            "llama2-70b",
            4096,
            64,
            Cluster(gpu_preset("mi300x"), 8),
        ),
    ]
    # issue 16's QLoRA searches, as `memfit plan --model M --gpu G --lora` asks them (seq 2048, batch 4, this host's
    # memory): nothing fits without an NF4 base, so most of their traces are fallbacks, traced a few at a time
    host = this_machine_memory()
    lora = plan_request(build_parser().parse_args(["plan", "--model", "tiny", "--lora"])).lora  # what `--lora` asks for
    qlora = [
        ("llama2-70b LoRA, 1 x a100-80g, seq 2048, batch 4", "llama2-70b", Cluster(gpu_preset("a100-80g"), 1, 1, host)),
        ("llama2-13b LoRA, 1 x rtx4090, seq 2048, batch 4", "llama2-13b", Cluster(gpu_preset("rtx4090"), 1, 1, host)),
    ]
    cases = [(*c, None) for c in cases] + [(label, model, 2048, 4, cluster, lora) for label, model, cluster in qlora]
    rows = []
    for label, model, seq, batch, cluster, adapters in cases:
        os.environ["MEMFIT_TRACE_CACHE"] = tempfile.mkdtemp(prefix="memfit-plan-speed-")  # cold: its own, empty
        timed = []
        for _ in ("cold", "warm"):
            t0 = time.perf_counter()
            r = search(Workload(config_for_planning(model), model, seq, batch, adapters), cluster)
            timed.append((time.perf_counter() - t0, r))
        (dt, r), (warm_s, warm) = timed
        rows.append(
            {
                "case": label,
                "seconds": dt,
                "warm_seconds": warm_s,
                "warm_cached_traces": warm.cached_traces,
                "candidates": len(r.fitting) + len(r.pruned),
                "fitting": len(r.fitting),
                "traces": r.traces,
            }
        )
    spec = StepSpec(
        config_for_planning("llama2-7b"),
        4096,
        Strategy(
            activation_checkpointing=CheckpointPolicy("ffn"),
            precision="bf16-mixed",
            optimizer="fused",
            micro_batch_size=1,
        ),
        round_to=512,
    )
    t0 = time.perf_counter()
    trace_step(spec)
    full_trace_s = time.perf_counter() - t0
    print(f"{'case':55s} {'cold s':>8s} {'warm s':>8s} {'candidates':>10s} {'fit':>5s} {'traces':>7s}")
    for r in rows:
        print(
            f"{r['case']:55s} {r['seconds']:8.2f} {r['warm_seconds']:8.2f} {r['candidates']:10d} {r['fitting']:5d} "
            f"{r['traces']:7d}"
        )
    print(f"{'one full-depth 32-layer llama2-7b trace (B=1, T=4096)':55s} {full_trace_s:8.2f}")
    cli = cli_seconds()
    print(
        f"README example, `memfit plan` with its imports: cold {cli['cold']:.2f} s, traces warm "
        f"{cli['traces_warm']:.2f} s, asked again {cli['asked_again']:.2f} s"
    )
    print(
        json.dumps(
            {
                "benchmark": "plan_speed",
                "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "machine": platform.platform(),
                "searches": rows,
                "full_trace_7b_s": full_trace_s,
                "cli_readme_example_s": cli,
            }
        )
    )


if __name__ == "__main__":
    main()
