"""What one memory lever saves, measured on real CPU tensors and predicted by the planner.

    python benchmarks/levers.py --lever loss_chunks=8            [--batch 2 --seq-len 256]
    python benchmarks/levers.py --lever optimizer_in_backward=true [--ac full]
    python benchmarks/levers.py --lever activation_offload=true
    python benchmarks/levers.py --lever optimizer_name=adamw8bit

Part 1, measured: the pretrained SmolLM2-135M (30 layers, vocabulary 49,152, tied embeddings), full
fine-tune and LoRA, fp32 and bf16-mixed: the steady-state step's peak by ``torch.profiler`` on real
tensors (``measured_steady_step``, each block classified without the planner's code) with the lever off and
on, and the planner's prediction for each (``Predictor``, as ``memfit plan`` computes it: shallow traces
extrapolated to 30 layers). The step in backward frees each gradient inside backward, where the measurement
cannot tell it from a temporary: for it the worst-category error takes gradients and temporaries together.
Offloaded activations are measured as a GPU holds them (``measured_steady_step``: host copies apart, copies
back into new buffers): the device peak, and the host peak beside it (compared on its own, not as a
category of the device peak).

Part 2, predicted only: the planner's peak with the lever off and on for Llama-2-7B and Llama-3-8B at the
README's example shape (bf16-mixed, micro-batch 1 x 2048 tokens; LoRA, and a full fine-tune in bf16-pure),
without checkpointing and with full checkpointing.

The step after backward clips the gradient norm at 1.0 (the trainer's default); the step in backward cannot.
Prints two tables and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
from datetime import datetime, timezone

from memfit.config.schema import LoraConfig, ModelConfig
from memfit.config.strategy import CheckpointPolicy, Strategy, levers
from memfit.models.load import ModelSource, build_model, embedded_checkpoint_dir, model_config
from memfit.models.presets import preset_config
from memfit.planner.categories import Category
from memfit.planner.measure import measured_steady_step
from memfit.planner.predict import Predictor
from memfit.planner.trace import StepSpec
from memfit.strategies.precision import precision_policy

MIB = 1 << 20
GIB = 1 << 30


def _pct(a: int, b: int) -> float:
    return 100.0 * (a - b) / b if b else 0.0


def _worst_category_pct(predicted, measured, merge_grads: bool) -> float:
    groups = [[c] for c in Category if c not in (Category.GRADS, Category.TEMPORARIES, Category.HOST)]
    groups += [[Category.GRADS, Category.TEMPORARIES]] if merge_grads else [[Category.GRADS], [Category.TEMPORARIES]]
    errors = []
    for group in groups:
        m, p = sum(measured[c] for c in group), sum(predicted[c] for c in group)
        if m:
            errors.append(abs(_pct(p, m)))
    return max(errors, default=0.0)


def measured_rows(name: str, on, batch: int, seq_len: int, ac: CheckpointPolicy) -> list[dict]:
    smol = ModelSource("hf", path=embedded_checkpoint_dir())
    config = model_config(smol, ModelConfig())
    off = levers()[name].searched[0]  # the lever's "off" value: 0, False, adamw
    rows = []
    for lora in (False, True):
        lora_cfg = LoraConfig(enabled=True) if lora else None
        predictor = Predictor(StepSpec(config, seq_len, lora=lora_cfg))
        for precision in ("fp32", "bf16-mixed"):
            for value in (off, on):
                strategy = Strategy(
                    activation_checkpointing=ac,
                    precision=precision,
                    optimizer=_implementation(name, "foreach"),
                    micro_batch_size=batch,
                    **{name: value},
                )
                model = build_model(smol, ModelConfig(), precision_policy(precision).param_dtype, 0, trains_on_cpu=True)
                measured = measured_steady_step(StepSpec(config, seq_len, strategy, lora_cfg), model)
                prediction = predictor.predict(strategy)
                predicted = prediction.peak
                rows.append(
                    {
                        "tune": "lora" if lora else "full",
                        "precision": precision,
                        name: value,
                        "measured_bytes": measured.total_bytes,
                        "predicted_bytes": predicted.total_bytes,
                        "measured_host_bytes": measured.host_bytes,
                        "predicted_host_bytes": prediction.host_peak_bytes,
                        "error_pct": _pct(predicted.total_bytes, measured.total_bytes),
                        "worst_category_error_pct": _worst_category_pct(
                            predicted, measured, strategy.optimizer_in_backward
                        ),
                        "measured": measured.as_dict(),
                        "predicted": predicted.as_dict(),
                    }
                )
    return rows


def _implementation(lever: str, usual: str) -> str:
    """AdamW's implementation for both cells: low-bit states step one parameter at a time, so their "off"
    cell does too (the saving is then the states' and the step's, not the implementation's)."""
    return "for-loop" if lever == "optimizer_name" else usual


def predicted_rows(name: str, on) -> list[dict]:
    off = levers()[name].searched[0]
    rows = []
    for model in ("llama2-7b", "llama3-8b"):
        for lora in (True, False):
            lora_cfg = LoraConfig(enabled=True) if lora else None
            predictor = Predictor(StepSpec(preset_config(model), 2048, lora=lora_cfg, round_to=512))
            for ac in ("none", "full"):
                peaks = {}
                for value in (off, on):
                    strategy = Strategy(
                        activation_checkpointing=CheckpointPolicy.parse(ac),
                        precision="bf16-mixed" if lora else "bf16-pure",
                        optimizer=_implementation(name, "fused"),
                        micro_batch_size=1,
                        **{name: value},
                    )
                    peaks[value] = predictor.predict(strategy).peak_bytes
                rows.append(
                    {
                        "model": model,
                        "tune": "lora" if lora else "full",
                        "ac": ac,
                        "off_peak_bytes": peaks[off],
                        "on_peak_bytes": peaks[on],
                        "saved_bytes": peaks[off] - peaks[on],
                    }
                )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lever", required=True, help="NAME=VALUE of a Strategy lever, e.g. loss_chunks=8")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--ac", default="none", help="activation checkpointing of the measured cells")
    a = ap.parse_args()
    name, _, text = a.lever.partition("=")
    on = levers()[name].parse(text, "--lever")
    ac = CheckpointPolicy.parse(a.ac, "--ac")
    measured = measured_rows(name, on, a.batch, a.seq_len, ac)
    print(
        f"{name}={on}: SmolLM2-135M, AC {ac}, B={a.batch}, T={a.seq_len}, "
        f"CPU ({platform.processor() or platform.machine()}); steady-state step peak, MiB"
    )
    print(
        f"{'tune':5s} {'precision':11s} {'lever':>6s} {'measured':>10s} {'predicted':>10s} {'error':>8s} "
        f"{'worst category':>15s} {'saved (measured)':>17s} {'host meas.':>11s} {'host pred.':>11s}"
    )
    base = {}
    for r in measured:
        key = (r["tune"], r["precision"])
        base.setdefault(key, r["measured_bytes"])
        saved = base[key] - r["measured_bytes"]
        print(
            f"{r['tune']:5s} {r['precision']:11s} {str(r[name]):>6s} {r['measured_bytes'] / MIB:10.2f} "
            f"{r['predicted_bytes'] / MIB:10.2f} {r['error_pct']:+7.3f}% {r['worst_category_error_pct']:14.3f}% "
            f"{saved / MIB:10.2f} ({100 * saved / base[key]:.1f}%) {r['measured_host_bytes'] / MIB:11.2f} "
            f"{r['predicted_host_bytes'] / MIB:11.2f}"
        )
    predicted = predicted_rows(name, on)
    print(f"\nplanner only: micro-batch 1 x 2048 tokens (LoRA r=8 bf16-mixed, full bf16-pure), GiB; {name}={on}")
    print(f"{'model':10s} {'tune':5s} {'AC':5s} {'off':>8s} {'on':>8s} {'saved':>7s}")
    for r in predicted:
        print(
            f"{r['model']:10s} {r['tune']:5s} {r['ac']:5s} {r['off_peak_bytes'] / GIB:8.3f} "
            f"{r['on_peak_bytes'] / GIB:8.3f} {r['saved_bytes'] / GIB:7.3f}"
        )
    print(
        json.dumps(
            {
                "benchmark": "levers",
                "lever": {name: on},
                "ac": str(ac),
                "date": datetime.now(timezone.utc).date().isoformat(),
                "machine": platform.node(),
                "measured": measured,
                "predicted": predicted,
            }
        )
    )


if __name__ == "__main__":
    main()
