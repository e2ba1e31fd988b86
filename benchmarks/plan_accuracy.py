"""Planner accuracy on CPU: predicted steady-state peak vs the peak torch.profiler measures on real
tensors during the trainer's own step, for the tiny preset and the pretrained SmolLM2-135M.

    python benchmarks/plan_accuracy.py

Prediction: ``extrapolated_step`` (2-3 layer fake traces extrapolated to full depth, as the planner
does). Measurement: ``measured_steady_step`` (second step, profiler memory events + live tensors,
each block at the peak put in a category by what it is: parameter, optimizer state, gradient,
saved for backward, or else a temporary). Prints a table and one JSON line.
"""

from __future__ import annotations

import json
import platform
from datetime import datetime, timezone

from memfit.config.schema import LoraConfig, ModelConfig
from memfit.config.strategy import CheckpointPolicy, Strategy
from memfit.models.load import ModelSource, build_model, embedded_checkpoint_dir, model_config
from memfit.models.presets import preset_config
from memfit.planner.categories import Category
from memfit.planner.measure import measured_steady_step
from memfit.planner.trace import StepSpec, extrapolated_step
from memfit.strategies.precision import precision_policy


def main() -> None:
    smol = ModelSource("hf", path=embedded_checkpoint_dir())
    models = {
        "tiny (random, 2 layers), B=4 T=128": (preset_config("tiny"), None, 4, 128),
        "SmolLM2-135M (pretrained, 30 layers), B=1 T=64": (model_config(smol, ModelConfig()), smol, 1, 64),
    }
    rows = []
    for label, (config, source, batch, seq) in models.items():
        for lora in (False, True):
            for precision in ("fp32", "bf16-mixed", "bf16-pure"):
                for ac in ("none", "ffn", "full", "every_k:2"):
                    spec = StepSpec(
                        config,
                        seq,
                        Strategy(
                            activation_checkpointing=CheckpointPolicy.parse(ac),
                            precision=precision,
                            optimizer="foreach",
                            micro_batch_size=batch,
                        ),
                        LoraConfig(enabled=True) if lora else None,
                    )
                    predicted = extrapolated_step(spec).peak
                    model = (
                        build_model(
                            source, ModelConfig(), precision_policy(precision).param_dtype, 0, trains_on_cpu=True
                        )
                        if source
                        else None
                    )
                    measured = measured_steady_step(spec, model)
                    rows.append(
                        {
                            "model": label,
                            "lora": lora,
                            "precision": precision,
                            "ac": ac,
                            "predicted_bytes": predicted.total_bytes,
                            "measured_bytes": measured.total_bytes,
                            "error_pct": _pct(predicted.total_bytes, measured.total_bytes),
                            "predicted": predicted.as_dict(),
                            "measured": measured.as_dict(),
                            "category_error_pct": {c.value: _pct(predicted[c], measured[c]) for c in Category},
                        }
                    )
    print(
        f"{'model':48s} {'tune':5s} {'precision':11s} {'AC':10s} {'predicted MiB':>14s} {'measured MiB':>13s} "
        f"{'error':>8s}  worst category"
    )
    for r in rows:
        cat, err = max(r["category_error_pct"].items(), key=lambda kv: abs(kv[1]))
        print(
            f"{r['model']:48s} {'lora' if r['lora'] else 'full':5s} {r['precision']:11s} {r['ac']:10s} "
            f"{r['predicted_bytes'] / 2**20:14.2f} {r['measured_bytes'] / 2**20:13.2f} {r['error_pct']:+7.3f}%  "
            f"{cat} {err:+.3f}%"
        )
    worst = max(abs(r["error_pct"]) for r in rows)
    worst_cat = max(abs(e) for r in rows for e in r["category_error_pct"].values())
    print(f"worst |error| {worst:.3f}% (peak), {worst_cat:.3f}% (any category) over {len(rows)} configurations")
    print(
        json.dumps(
            {
                "benchmark": "plan_accuracy",
                "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "machine": platform.platform(),
                "worst_abs_error_pct": worst,
                "worst_abs_category_error_pct": worst_cat,
                "rows": rows,
            }
        )
    )


def _pct(predicted: int, measured: int) -> float:
    """Relative error in %; 0 when both are 0 (a category absent at the peak)."""
    if measured == 0:
        return 0.0 if predicted == 0 else float("inf")
    return 100 * (predicted - measured) / measured


if __name__ == "__main__":
    main()
