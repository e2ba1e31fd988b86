"""The longest sequence and the biggest micro-batch that fit, as ``memfit plan --max-seq-len / --max-micro-batch``
finds them, against real CPU tensors at that value and one step above it.

    python benchmarks/max_fit.py [--cap 3GiB]

For each cell (SmolLM2-135M's shape, full fine-tune and LoRA, with and without checkpointing, fp32) the planner is
given a cap on tensor bytes (a CPU plan with no runtime share and no headroom: the cap is what the step's tensors
may hold) and searches the limit (``planner.limits``). The steady-state step is then run on real tensors at the
limit and one step above it (``measured_steady_step``: torch.profiler's peak, classified without the planner's
code), beside the planner's own prediction at both. The limit is right when the measured peak at it is within the
cap and the one a step above is not. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
from datetime import datetime, timezone

from memfit.config.schema import LoraConfig, ModelConfig
from memfit.config.strategy import CheckpointPolicy, Strategy
from memfit.models.load import ModelSource, build_model, embedded_checkpoint_dir, model_config
from memfit.planner.hardware import cpu_device
from memfit.planner.limits import SEQ_STEP, max_micro_batches, max_seq_lens
from memfit.planner.measure import measured_steady_step
from memfit.planner.predict import Predictor
from memfit.planner.search import Cluster, Pins, Workload, search
from memfit.planner.trace import StepSpec
from memfit.strategies.precision import precision_policy
from memfit.units import parse_memory

MIB = 1 << 20
CELLS = (  # (tune, activation checkpointing, micro-batch, what is searched)
    ("full", "none", 1, "seq"),
    ("full", "full", 1, "seq"),
    ("lora", "none", 1, "seq"),
    ("lora", "none", 1, "micro-batch"),
    ("full", "none", 1, "micro-batch"),
)


def _cell(smol, config, cap: int, tune: str, ac: str, micro_batch: int, what: str, seq_len: int) -> dict:
    lora = LoraConfig(enabled=True) if tune == "lora" else None
    strategy = Strategy(
        activation_checkpointing=CheckpointPolicy.parse(ac),
        precision="fp32",
        optimizer="foreach",
        micro_batch_size=micro_batch,
    )
    fixed = ("activation_checkpointing", "precision", "optimizer", "micro_batch_size", "loss_chunks", "optimizer_name")
    pins = Pins({name: getattr(strategy, name) for name in (*fixed, "optimizer_in_backward")})
    w = Workload(config, "smollm2-135m", seq_len, micro_batch, lora)
    result = search(w, Cluster(cpu_device(cap)), pins, headroom=0.0)
    (candidate,) = result.fitting + result.pruned
    if what == "seq":
        limit = max_seq_lens(result, [candidate])[0]
        shapes = [(limit.value, micro_batch), (limit.value + SEQ_STEP, micro_batch)]
    else:
        limit = max_micro_batches(result, [candidate])[0]
        shapes = [(seq_len, limit.value), (seq_len, limit.value + 1)]
    row = {"tune": tune, "ac": ac, "searched": what, "limit": limit.value, "at_ceiling": limit.at_ceiling}
    for edge, (seq, batch) in zip(("at", "above"), shapes):
        s = candidate.strategy.replace(micro_batch_size=batch)
        predicted = Predictor(StepSpec(config, seq, lora=lora, host_is_device=True)).predict(s).peak_bytes
        model = build_model(smol, ModelConfig(), precision_policy("fp32").param_dtype, 0, trains_on_cpu=True)
        measured = measured_steady_step(StepSpec(config, seq, s, lora, host_is_device=True), model)
        row[edge] = {
            "seq_len": seq,
            "micro_batch": batch,
            "predicted_bytes": predicted,
            "measured_bytes": measured.total_bytes,
            "measured_fits": measured.total_bytes <= cap,
        }
    row["right"] = row["at"]["measured_fits"] and not row["above"]["measured_fits"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cap", default="3GiB", help="tensor bytes the step may hold (default 3GiB)")
    ap.add_argument("--seq-len", type=int, default=256, help="the requested length the searches start from")
    a = ap.parse_args()
    cap = parse_memory(a.cap, "--cap")
    smol = ModelSource("hf", path=embedded_checkpoint_dir())
    config = model_config(smol, ModelConfig())
    rows = [_cell(smol, config, cap, *cell, a.seq_len) for cell in CELLS]
    print(
        f"SmolLM2-135M fp32, cap {cap / MIB:.0f} MiB of tensors, CPU ({platform.processor() or platform.machine()}); "
        f"limits in steps of {SEQ_STEP} tokens / 1 sequence; peaks in MiB"
    )
    print(
        f"{'tune':5s} {'AC':5s} {'searched':12s} {'limit':>6s} {'pred. at':>9s} {'meas. at':>9s} "
        f"{'pred. +1':>9s} {'meas. +1':>9s} {'right':>6s}"
    )
    for r in rows:
        at, above = r["at"], r["above"]
        print(
            f"{r['tune']:5s} {r['ac']:5s} {r['searched']:12s} {r['limit']:6d} {at['predicted_bytes'] / MIB:9.1f} "
            f"{at['measured_bytes'] / MIB:9.1f} {above['predicted_bytes'] / MIB:9.1f} "
            f"{above['measured_bytes'] / MIB:9.1f} {'yes' if r['right'] else 'NO':>6s}"
        )
    print(
        json.dumps(
            {
                "benchmark": "max_fit",
                "date": datetime.now(timezone.utc).date().isoformat(),
                "machine": platform.node(),
                "cap_bytes": cap,
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
