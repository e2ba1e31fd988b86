"""2-rank engines on CPU (gloo), in one run: loss-curve agreement with one process on the same global
batch, step time, and each rank's torch.profiler tensor peak beside the planner's per-rank prediction.

    python benchmarks/distributed.py [--steps 10] [--out runs/bench-distributed]

Every run is a real `memfit train` subprocess (`--nproc-per-node 2` for the engines). Prints a Markdown
table and one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ENGINES = {
    "one process": [],
    "DDP (ZeRO-0)": ["distributed.zero_stage=0"],
    "DDP + ZeroRedundancyOptimizer (ZeRO-1)": ["distributed.zero_stage=1"],
    "FSDP2 ZeRO-2": ["distributed.zero_stage=2"],
    "FSDP2 ZeRO-3": ["distributed.zero_stage=3"],
    "DeepSpeed ZeRO-2": ["distributed.engine=deepspeed", "distributed.zero_stage=2"],
    "DeepSpeed ZeRO-3": ["distributed.engine=deepspeed", "distributed.zero_stage=3"],
}
DS_FP32 = {"zero_optimization": {"contiguous_gradients": True, "overlap_comm": False}}  # stage: memfit's config


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def run(out: Path, name: str, overrides: list[str], ranks: int) -> tuple[list[dict], float]:
    cmd = [sys.executable, "-m", "memfit.cli", "train", "tiny-cpu", *overrides, f"output.dir={out / name}"]
    if ranks > 1:
        cmd += ["--nproc-per-node", str(ranks)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{name} failed:\n{proc.stderr[-3000:]}")
    return records(out / name), time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=f"runs/bench-distributed-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}")
    ns = ap.parse_args()
    out = Path(ns.out)
    out.mkdir(parents=True)
    ds_json = out / "ds.json"
    ds_json.write_text(json.dumps(DS_FP32))
    base = [
        "model.source=random:tiny",
        "data.seq_len=64",
        "data.max_documents=2",
        "strategy.precision=fp32",
        f"train.max_steps={ns.steps}",
        "train.eval_every=0",
        "train.eval_batches=1",
        "output.export=false",
        "train.micro_batch_size=2",
        "train.global_batch_size=4",
        f"distributed.deepspeed_config={ds_json}",
    ]
    rows, curves = [], {}
    for name, extra in ENGINES.items():
        recs, wall = run(out, name.split(" ")[0].lower() + "-" + str(len(rows)), base + extra, 1 if not extra else 2)
        steps = [r for r in recs if r["kind"] == "step"]
        curves[name] = [r["loss"] for r in steps]
        rows.append(
            {"engine": name, "median_step_s": statistics.median(r["step_time_s"] for r in steps[1:]), "wall_s": wall}
        )
    ref = curves["one process"]
    for row in rows:
        got = curves[row["engine"]]
        row["max_rel_loss_diff"] = max(abs(a - b) / abs(b) for a, b in zip(got, ref))

    # per-rank tensor peak (torch.profiler) vs the planner, on a SmolLM2-135M-shaped model
    profiled = []
    for stage in (2, 3):
        recs, _ = run(
            out,
            f"profile-zero{stage}",
            [
                "model.source=random:smollm2-135m",
                "data.seq_len=64",
                "data.max_documents=2",
                "strategy.precision=fp32",
                "train.max_steps=3",
                "train.profile_step=2",
                "train.micro_batch_size=1",
                "train.eval_every=0",
                "train.eval_batches=1",
                "output.export=false",
                f"distributed.zero_stage={stage}",
            ],
            2,
        )
        rec = next(r for r in recs if "rank_profiled_peak_bytes" in r)
        profiled.append(
            {
                "stage": stage,
                "ranks": rec["rank_profiled_peak_bytes"],
                "predicted": rec["predicted_peak_bytes"],
                "error_pct": 100
                * (rec["predicted_peak_bytes"] - rec["profiled_peak_bytes"])
                / rec["profiled_peak_bytes"],
            }
        )

    print(
        f"2 ranks, gloo, CPU; tiny preset, global batch 4 (2 ranks x 2), T=64, fp32, {ns.steps} steps; "
        f"{datetime.now(timezone.utc).date()} on {platform.node()} ({platform.machine()})\n"
    )
    print("| engine | max relative loss difference vs one process | median step time (s) |")
    print("|---|---:|---:|")
    for r in rows:
        print(f"| {r['engine']} | {r['max_rel_loss_diff']:.2e} | {r['median_step_s']:.3f} |")
    print("\nSmolLM2-135M-shaped (random), B=1 per rank, T=64, fp32, 2 ranks: step 2's tensor peak per rank")
    print("| FSDP2 stage | rank 0 (GiB) | rank 1 (GiB) | planner per rank (GiB) | error vs worst rank |")
    print("|---|---:|---:|---:|---:|")
    for p in profiled:
        print(
            f"| ZeRO-{p['stage']} | {p['ranks'][0] / 2**30:.3f} | {p['ranks'][1] / 2**30:.3f} | "
            f"{p['predicted'] / 2**30:.3f} | {p['error_pct']:+.1f}% |"
        )
    print(json.dumps({"benchmark": "distributed", "engines": rows, "profiled": profiled}))


if __name__ == "__main__":
    main()
