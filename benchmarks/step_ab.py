"""memfit's training step against a plain PyTorch step, interleaved in one process on one model.

The subprocess benchmark (``train_throughput.py``) compares whole runs, and on a noisy 2-core VM its
run-to-run spread (about ±10%) is wider than the gap it looks for. Here both steps run on the same
LoRA model, batch and optimizer, alternating A/B and B/A, so process-level noise hits both alike:

    python benchmarks/step_ab.py [--steps 12]

memfit's step is ``StepRunner.step`` + ``zero_grad`` (what ``memfit train`` times, less data loading and
the scheduler); the plain step is ``train_throughput.plain_step`` (forward, fp32 cross-entropy, backward,
clip, AdamW foreach, zero_grad).
A tiny learning rate keeps the model nearly unchanged over the alternation. Prints medians and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import datetime, timezone

import torch
from train_throughput import plain_step  # the plain loop's step (benchmarks/ is on the path when run as a script)

from memfit.config.schema import LoraConfig, ModelConfig, OptimizerConfig
from memfit.models.load import ModelSource, build_model, embedded_checkpoint_dir
from memfit.strategies.lora import apply_lora
from memfit.strategies.optimizer import build_optimizer
from memfit.strategies.precision import precision_policy
from memfit.train.loop import StepRunner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12, help="timed steps of each kind")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    a = ap.parse_args()

    model = build_model(
        ModelSource("hf", path=embedded_checkpoint_dir()), ModelConfig(), torch.float32, 0, trains_on_cpu=True
    )
    torch.manual_seed(1)
    model = apply_lora(model, LoraConfig(enabled=True), precision_policy("fp32"))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = build_optimizer(params, OptimizerConfig(implementation="foreach", lr=1e-6), torch.device("cpu"))
    runner = StepRunner(model, params, opt, precision_policy("fp32"), torch.device("cpu"), grad_clip=1.0)
    tokens = torch.randint(
        0, model.config.vocab_size, (a.batch, a.seq_len + 1), generator=torch.Generator().manual_seed(0)
    )

    def memfit_step() -> None:
        runner.step([(tokens, tokens)])
        runner.zero_grad()

    steps = {"memfit": memfit_step, "plain": lambda: plain_step(model, params, opt, tokens)}
    for fn in steps.values():  # warm-up: optimizer state, allocator, kernels
        fn()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(a.steps):
        order = list(steps) if i % 2 == 0 else list(reversed(steps))
        for name in order:
            start = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(v) for name, v in times.items()}
    for name, v in times.items():
        print(f"{name:7s} median {med[name]:.3f} s/step   " + " ".join(f"{x:.2f}" for x in v))
    ratio = med["plain"] / med["memfit"]
    print(f"memfit throughput ÷ plain: {ratio:.3f}")
    print(
        json.dumps(
            {
                "benchmark": "step_ab",
                "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "machine": platform.platform(),
                "settings": vars(a),
                "median_s": med,
                "step_times_s": times,
                "ratio_memfit_vs_plain": ratio,
            }
        )
    )


if __name__ == "__main__":
    main()
