"""The default job (SmolLM2-135M-Instruct LoRA on Shakespeare, CPU) run as it ships and with one setting changed:
the losses step by step against the first variant's, the optimizer state, the profiled tensor peak of one step
beside the planner's prediction, and the median step time.

    python benchmarks/default_job_variants.py --steps 30 --set optimizer     # adamw, adamw8bit, adamw4bit
    python benchmarks/default_job_variants.py --steps 10 --set frozen-base   # bf16-mixed LoRA, base fp32 / bf16
    python benchmarks/default_job_variants.py --steps 10 --set qlora         # bf16-mixed LoRA, base bf16 / NF4
    python benchmarks/default_job_variants.py --steps 10 --set optimizer-offload   # AdamW on the device / host

``--set frozen-base`` runs the job under ``strategy.precision=bf16-mixed`` twice: with the frozen base in fp32
(memfit before 2026-12-01: ``Precision.frozen_dtype`` patched back to fp32 for that run) and in bf16 (now).
Each variant runs in this process, one after the other, from the same seed and data order. Prints a table and
one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import tempfile
from datetime import datetime, timezone

import torch

import memfit.strategies.precision as precision_module
from memfit.config.loader import load_config
from memfit.config.shipped import shipped_configs
from memfit.train.loop import Trainer

MIB = 1 << 20
os.environ["MEMFIT_TRACE_CACHE"] = "off"  # --set frozen-base patches the precision table: no cached trace may answer
SETS = {
    "optimizer": [(f"optimizer.name={n}", n, None) for n in ("adamw", "adamw8bit", "adamw4bit")],
    "qlora": [
        ("lora.quantize_base=none", "bf16-mixed LoRA", None),
        ("lora.quantize_base=nf4", "bf16-mixed QLoRA (NF4 base)", None),
    ],
    "optimizer-offload": [
        ("optimizer.offload=false", "AdamW on the device", None),
        ("optimizer.offload=true", "AdamW in host memory", None),
    ],
    "frozen-base": [
        ("strategy.precision=bf16-mixed", "bf16-mixed, base fp32 (before)", torch.float32),
        ("strategy.precision=bf16-mixed", "bf16-mixed, base bf16 (now)", None),
    ],
}


@contextlib.contextmanager
def frozen_dtype(dtype: torch.dtype | None):
    """bf16-mixed with its frozen base stored in ``dtype`` while open (None: as memfit ships it)."""
    saved = precision_module._POLICIES["bf16-mixed"]
    if dtype is not None:
        precision_module._POLICIES["bf16-mixed"] = dataclasses.replace(saved, frozen_dtype=dtype)
    try:
        yield
    finally:
        precision_module._POLICIES["bf16-mixed"] = saved


def run(override: str, dtype: torch.dtype | None, steps: int, out: str, precision: str | None) -> dict:
    cfg = load_config(
        shipped_configs()["smollm2-shakespeare-lora-cpu"],
        [
            *([f"strategy.precision={precision}"] if precision else []),
            override,
            f"train.max_steps={steps}",
            "train.profile_step=2",
            "train.eval_every=0",
            "train.eval_batches=1",
            "train.checkpoint_every=0",
            "output.export=false",
            f"output.dir={out}",
        ],
    )
    with frozen_dtype(dtype):
        trainer = Trainer(cfg)
        try:
            result = trainer.fit()
        finally:
            trainer.close()
    s = result.summary
    return {
        "losses": [r["loss"] for r in result.steps],
        "optimizer_state_bytes": s.states.optimizer_bytes,
        "params_bytes": s.states.params_bytes,
        "profiled_peak_bytes": s.profiled_peak_bytes,
        "predicted_peak_bytes": s.predicted_peak_bytes,
        "median_step_time_s": s.median_step_time_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--set", choices=sorted(SETS), required=True)
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory(prefix="memfit-variants-") as out:  # each variant a fresh run directory
        for i, (override, label, dtype) in enumerate(SETS[a.set]):
            rows[label] = run(override, dtype, a.steps, f"{out}/{i}", "bf16-mixed" if a.set == "qlora" else None)
    base = next(iter(rows.values()))["losses"]
    print(f"default job, {a.steps} steps, CPU ({platform.processor() or platform.machine()}); MiB")
    print(
        f"{'variant':32s} {'params':>8s} {'optim':>7s} {'profiled':>9s} {'planner':>8s} {'error':>7s} "
        f"{'max |dloss|/loss':>17s} {'last':>9s} {'step s':>7s}"
    )
    for label, r in rows.items():
        diffs = [abs(a - b) / a for a, b in zip(base, r["losses"])]
        r["max_rel_loss_diff"], r["last_rel_loss_diff"] = max(diffs), diffs[-1]
        err = 100 * (r["predicted_peak_bytes"] - r["profiled_peak_bytes"]) / r["profiled_peak_bytes"]
        print(
            f"{label:32s} {r['params_bytes'] / MIB:8.2f} {r['optimizer_state_bytes'] / MIB:7.2f} "
            f"{r['profiled_peak_bytes'] / MIB:9.2f} {r['predicted_peak_bytes'] / MIB:8.2f} {err:+6.2f}% "
            f"{r['max_rel_loss_diff']:17.2e} {r['last_rel_loss_diff']:9.2e} {r['median_step_time_s']:7.3f}"
        )
    print(
        json.dumps(
            {
                "benchmark": "default_job_variants",
                "set": a.set,
                "steps": a.steps,
                "date": datetime.now(timezone.utc).date().isoformat(),
                "machine": platform.node(),
                "torch": torch.__version__,
                "variants": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
