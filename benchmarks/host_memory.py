"""Freed host memory kept or returned (``allocator.host_keep_freed``): step time, page faults and peak resident memory.

A CPU run of the tiny preset at seq 512, micro-batch 4 (``--micro-batch``), one thread (the ``on_oom`` ladder
test's shape), with the setting true and false, interleaved, each run its own process; each reports its median step
time over steps 3..N, the minor page faults of each of those steps and its peak resident set (``VmHWM``, which the
trainer resets before every step: the peak of the last step and the run's end; a kept heap stays resident, so it
shows the kept heap). Prints a table and one JSON line:

    python benchmarks/host_memory.py [--reps 3] [--steps 8] [--micro-batch 4]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from train_throughput import fit_counting_faults, run_child  # benchmarks/ is on the path when run as a script

ROOT = Path(__file__).resolve().parent.parent


def child(keep: str, steps: int, micro_batch: int) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from support.tiny import tiny_overrides

    from memfit.config.loader import load_config
    from memfit.config.shipped import shipped_configs
    from memfit.telemetry.readings import peak_rss_bytes

    common = ["data.seq_len=512", "data.max_documents=20", "train.eval_every=0", "train.eval_batches=1"]
    common += [
        "output.export=false",
        "train.threads=1",
        "train.checkpoint_every=0",
        f"train.micro_batch_size={micro_batch}",
    ]
    with tempfile.TemporaryDirectory() as d:
        overrides = tiny_overrides(d, *common, f"train.max_steps={steps}", f"allocator.host_keep_freed={keep}")
        result, faults = fit_counting_faults(load_config(shipped_configs()["tiny-cpu"], overrides))
    out = {
        "median_step_time_s": statistics.median(r["step_time_s"] for r in result.steps[2:]),
        "step_faults": faults[2:],
        "peak_resident_bytes": peak_rss_bytes(),  # VmHWM, which the trainer resets before each step: the last one's
    }
    print("RESULT " + json.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", choices=["true", "false"])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=4)
    a = p.parse_args()
    if a.child:
        return child(a.child, a.steps, a.micro_batch)
    runs: dict[str, list[dict]] = {"true": [], "false": []}
    for rep in range(a.reps):
        for keep in runs:
            cmd = [
                sys.executable,
                __file__,
                "--child",
                keep,
                "--steps",
                str(a.steps),
                "--micro-batch",
                str(a.micro_batch),
            ]
            runs[keep].append(run_child(cmd, f"host_keep_freed={keep}"))
            r = runs[keep][-1]
            print(
                f"rep {rep + 1}/{a.reps} kept={keep:5s} {r['median_step_time_s']:.3f} s/step, "
                f"{statistics.median(r['step_faults']):,.0f} faults a step, {r['peak_resident_bytes'] / 2**30:.2f} GiB",
                file=sys.stderr,
            )
    med = {
        k: {
            "median_step_time_s": statistics.median(r["median_step_time_s"] for r in v),
            "runs_step_time_s": [round(r["median_step_time_s"], 3) for r in v],
            "step_faults": statistics.median(f for r in v for f in r["step_faults"]),
            "peak_resident_bytes": [r["peak_resident_bytes"] for r in v],
        }
        for k, v in runs.items()
    }
    print(f"\ntiny preset, seq 512, micro-batch {a.micro_batch}, 1 thread, CPU; {a.reps} runs x {a.steps} steps")
    for k, v in med.items():
        rss = ", ".join(f"{b / 2**30:.2f}" for b in v["peak_resident_bytes"])
        print(
            f"host_keep_freed={k:5s} median step {v['median_step_time_s']:.3f} s (runs {v['runs_step_time_s']}), "
            f"{v['step_faults']:,.0f} page faults a step, peak resident {rss} GiB"
        )
    speedup = med["false"]["median_step_time_s"] / med["true"]["median_step_time_s"]
    print(f"kept ÷ returned throughput: {speedup:.2f}x")
    summary = {
        "benchmark": "host_memory",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.platform(),
        "settings": vars(a),
        "arms": med,
        "throughput_kept_vs_returned": speedup,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
