"""Does the caching-allocator overhead of a traced step extrapolate from shallow depths?

    python benchmarks/replay_depth.py [--depths 2,3,4,6,8,12,16,32]

Traces Llama-2-7B + LoRA r=8 (bf16-mixed, AC none, fused AdamW, B=2, T=2048, 2 micro-batches, 512-byte
rounding) at each depth, replays the storage allocations through memfit's allocator model, and prints
peak allocated, peak reserved and their difference (cached-but-free bytes at the peak), with the time
the trace and the replay took. Why `memfit plan`'s table keeps a margin instead of a replay.
"""

from __future__ import annotations

import argparse
import time

from memfit.allocator.whatif import replay_allocations
from memfit.config.schema import LoraConfig
from memfit.config.strategy import Strategy
from memfit.models.presets import preset_config
from memfit.planner.trace import StepSpec, trace_allocations

GIB = 1 << 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depths", default="2,3,4,6,8,12,16,32")
    ns = ap.parse_args()
    spec = StepSpec(
        preset_config("llama2-7b"),
        2048,
        Strategy(precision="bf16-mixed", optimizer="fused", micro_batch_size=2, grad_accum_steps=2),
        LoraConfig(enabled=True, rank=8),
        512,
    )
    print(
        "| layers | events | peak allocated GiB | peak reserved GiB | reserved - allocated GiB | trace s | replay s |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for depth in map(int, ns.depths.split(",")):
        t0 = time.perf_counter()
        events = trace_allocations(spec, depth)
        t1 = time.perf_counter()
        model = replay_allocations(events)
        t2 = time.perf_counter()
        print(
            f"| {depth} | {len(events)} | {model.peak_allocated / GIB:.3f} | {model.peak_reserved / GIB:.3f} | "
            f"{(model.peak_reserved - model.peak_allocated) / GIB:.3f} | {t1 - t0:.2f} | {t2 - t1:.2f} |"
        )


if __name__ == "__main__":
    main()
