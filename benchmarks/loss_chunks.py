"""What ``strategy.loss_chunks`` saves, measured on real CPU tensors and predicted by the planner.

    python benchmarks/loss_chunks.py [--batch 2 --seq-len 256 --chunks 8]

Part 1, measured: the pretrained SmolLM2-135M (30 layers, vocabulary 49,152, tied embeddings), full
fine-tune and LoRA, fp32 and bf16-mixed: the steady-state step's peak by ``torch.profiler`` on real
tensors (``measured_steady_step``, each block classified without the planner's code) with the whole-logits
loss and with the chunked one, and the planner's prediction for each (``Predictor``, as ``memfit plan``
computes it: shallow traces extrapolated to 30 layers, the chunked loss's segments shifted in).

Part 2, predicted only: the planner's peak with and without chunking for Llama-2-7B (vocabulary 32,000)
and Llama-3-8B (128,256) at the README's example shape (LoRA, bf16-mixed, micro-batch 1 x 2048 tokens),
without checkpointing and with full checkpointing.

Prints two tables and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
from datetime import datetime, timezone

from memfit.config.schema import LoraConfig, ModelConfig
from memfit.config.strategy import CheckpointPolicy, Strategy
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


def measured_rows(batch: int, seq_len: int, chunks: int) -> list[dict]:
    smol = ModelSource("hf", path=embedded_checkpoint_dir())
    config = model_config(smol, ModelConfig())
    rows = []
    for lora in (False, True):
        lora_cfg = LoraConfig(enabled=True) if lora else None
        predictor = Predictor(StepSpec(config, seq_len, lora=lora_cfg))
        for precision in ("fp32", "bf16-mixed"):
            for n in (0, chunks):
                strategy = Strategy(precision=precision, optimizer="foreach", micro_batch_size=batch, loss_chunks=n)
                model = build_model(smol, ModelConfig(), precision_policy(precision).param_dtype, 0)
                measured = measured_steady_step(StepSpec(config, seq_len, strategy, lora_cfg), model)
                predicted = predictor.predict(strategy).peak
                rows.append(
                    {
                        "tune": "lora" if lora else "full",
                        "precision": precision,
                        "loss_chunks": n,
                        "measured_bytes": measured.total_bytes,
                        "predicted_bytes": predicted.total_bytes,
                        "error_pct": _pct(predicted.total_bytes, measured.total_bytes),
                        "worst_category_error_pct": max(
                            (abs(_pct(predicted[c], measured[c])) for c in Category if measured[c]), default=0.0
                        ),
                        "measured": measured.as_dict(),
                        "predicted": predicted.as_dict(),
                    }
                )
    return rows


def predicted_rows() -> list[dict]:
    rows = []
    for name in ("llama2-7b", "llama3-8b"):
        lora = LoraConfig(enabled=True)
        predictor = Predictor(StepSpec(preset_config(name), 2048, lora=lora, round_to=512))
        for ac in ("none", "full"):
            peaks = {}
            for n in (0, 8):
                strategy = Strategy(
                    activation_checkpointing=CheckpointPolicy.parse(ac),
                    precision="bf16-mixed",
                    optimizer="fused",
                    micro_batch_size=1,
                    loss_chunks=n,
                )
                peaks[n] = predictor.predict(strategy).peak_bytes
            rows.append(
                {
                    "model": name,
                    "ac": ac,
                    "peak_bytes": peaks[0],
                    "chunked_peak_bytes": peaks[8],
                    "saved_bytes": peaks[0] - peaks[8],
                }
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=8)
    a = ap.parse_args()
    measured = measured_rows(a.batch, a.seq_len, a.chunks)
    print(
        f"SmolLM2-135M, B={a.batch}, T={a.seq_len}, CPU ({platform.processor() or platform.machine()}); "
        f"steady-state step peak, MiB"
    )
    print(
        f"{'tune':5s} {'precision':11s} {'chunks':>6s} {'measured':>10s} {'predicted':>10s} {'error':>8s} "
        f"{'worst category':>15s} {'saved (measured)':>17s}"
    )
    base = {}
    for r in measured:
        key = (r["tune"], r["precision"])
        base.setdefault(key, r["measured_bytes"])
        saved = base[key] - r["measured_bytes"]
        print(
            f"{r['tune']:5s} {r['precision']:11s} {r['loss_chunks']:6d} {r['measured_bytes'] / MIB:10.2f} "
            f"{r['predicted_bytes'] / MIB:10.2f} {r['error_pct']:+7.3f}% {r['worst_category_error_pct']:14.3f}% "
            f"{saved / MIB:10.2f} ({100 * saved / base[key]:.1f}%)"
        )
    predicted = predicted_rows()
    print("\nplanner only: LoRA r=8, bf16-mixed, micro-batch 1 x 2048 tokens, GiB")
    print(f"{'model':10s} {'AC':5s} {'whole logits':>13s} {'8 chunks':>9s} {'saved':>7s}")
    for r in predicted:
        print(
            f"{r['model']:10s} {r['ac']:5s} {r['peak_bytes'] / GIB:13.3f} {r['chunked_peak_bytes'] / GIB:9.3f} "
            f"{r['saved_bytes'] / GIB:7.3f}"
        )
    print(
        json.dumps(
            {
                "benchmark": "loss_chunks",
                "date": datetime.now(timezone.utc).date().isoformat(),
                "machine": platform.node(),
                "measured": measured,
                "predicted": predicted,
            }
        )
    )


if __name__ == "__main__":
    main()
