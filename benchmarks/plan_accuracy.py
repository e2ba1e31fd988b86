"""Planner accuracy on CPU: predicted steady-state peak vs the peak torch.profiler measures on real
tensors during the trainer's own step, for the tiny preset and the pretrained SmolLM2-135M.

    python benchmarks/plan_accuracy.py

Prediction: ``extrapolated_step`` (2-3 layer fake traces extrapolated to full depth, as the planner
does). Measurement: ``measured_steady_peak`` (second step, profiler memory events + live tensors).
Prints a table and one JSON line.
"""

from __future__ import annotations

import json
import platform
from datetime import datetime, timezone

from memfit.config.schema import LoraConfig, ModelConfig
from memfit.memory.measure import measured_steady_peak
from memfit.memory.trace import StepSpec, extrapolated_step
from memfit.models.load import ModelSource, build_model, embedded_checkpoint_dir, model_config
from memfit.models.presets import preset_config
from memfit.strategies.precision import precision_policy


def main() -> None:
    smol = ModelSource("hf", path=embedded_checkpoint_dir())
    models = {"tiny (random, 2 layers), B=4 T=128": (preset_config("tiny"), None, 4, 128),
              "SmolLM2-135M (pretrained, 30 layers), B=1 T=64": (model_config(smol, ModelConfig()), smol, 1, 64)}
    rows = []
    for label, (config, source, batch, seq) in models.items():
        for lora in (False, True):
            for precision in ("fp32", "bf16-mixed", "bf16-pure"):
                for ac in ("none", "ffn", "full", "every_k:2"):
                    spec = StepSpec(config, batch, seq, precision, ac, "foreach", LoraConfig(enabled=True) if lora else None)
                    predicted = extrapolated_step(spec).peak_bytes
                    model = build_model(source, ModelConfig(), precision_policy(precision).param_dtype, 0) if source else None
                    measured = measured_steady_peak(spec, model)
                    rows.append({"model": label, "lora": lora, "precision": precision, "ac": ac,
                                 "predicted_bytes": predicted, "measured_bytes": measured,
                                 "error_pct": 100 * (predicted - measured) / measured})
    print(f"{'model':48s} {'tune':5s} {'precision':11s} {'AC':10s} {'predicted MiB':>14s} {'measured MiB':>13s} {'error':>8s}")
    for r in rows:
        print(f"{r['model']:48s} {'lora' if r['lora'] else 'full':5s} {r['precision']:11s} {r['ac']:10s} "
              f"{r['predicted_bytes'] / 2**20:14.2f} {r['measured_bytes'] / 2**20:13.2f} {r['error_pct']:+7.3f}%")
    worst = max(abs(r["error_pct"]) for r in rows)
    print(f"worst |error| {worst:.3f}% over {len(rows)} configurations")
    print(json.dumps({"benchmark": "plan_accuracy", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                      "machine": platform.platform(), "worst_abs_error_pct": worst, "rows": rows}))


if __name__ == "__main__":
    main()
