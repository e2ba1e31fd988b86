"""Supervised tokens per second on instruction data: memfit packed vs memfit padded vs HF Trainer padding-free.

Same model (the embedded SmolLM2-135M-Instruct, LoRA r=8 on all projections, fp32, SDPA), same records (the first
N of ``data.source=shakespeare-chat``, rendered by memfit's loader with the chat template, loss on the answers),
same optimizer (AdamW foreach, lr 2e-3, clip 1.0) and thread count:

- ``memfit-packed``: ``data.packing=true``, ``--batch`` rows of ``seq_len + 1`` tokens, several records each;
- ``memfit-padded``: ``data.packing=false``, ``--batch`` rows, one record each;
- ``hf-flat``: HF Trainer with ``DataCollatorWithFlattening`` (padding-free: a batch's records in one row with
  position ids), as many records per step as a packed memfit step holds on average.

Each run is its own subprocess; the arms are interleaved rep by rep so drift hits all alike. A run's number is the
tokens that took a loss over the steps after warm-up divided by those steps' time (each step's own rate varies
with the rows it drew); the table gives the median run and the spread. Prints a table, then one JSON line.

    python benchmarks/packing.py                    # defaults below
    python benchmarks/packing.py --reps 1 --steps 4 # quick look
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from train_throughput import _lora_model, run_child  # noqa: E402  the throughput benchmark's model and runner


def _config(a, out_dir: str, packing: bool):
    from memfit.config.loader import load_config
    from memfit.config.shipped import shipped_configs

    return load_config(
        shipped_configs()["smollm2-shakespeare-lora-cpu"],
        [
            "data.source=shakespeare-chat",
            f"data.packing={str(packing).lower()}",
            f"data.seq_len={a.seq_len}",
            f"data.max_documents={a.records}",
            f"train.micro_batch_size={a.batch}",
            f"train.max_steps={a.steps}",
            "train.eval_every=0",
            "train.eval_batches=1",
            "train.checkpoint_every=0",
            "train.plan_check=false",
            "output.export=false",
            "optimizer.warmup_steps=2",
            f"output.dir={out_dir}",
        ],
    )


def run_memfit(a, packing: bool) -> dict:
    from rich.console import Console

    from memfit.train.data import load_dataset
    from memfit.train.loop import Trainer

    with tempfile.TemporaryDirectory() as d:
        cfg = _config(a, f"{d}/run", packing)
        trainer = Trainer(cfg, display_console=Console(quiet=True))
        whole = load_dataset(cfg.data, trainer.tokenizer)  # before the split: records and rows
        rows, records = len(whole), whole.records
        result = trainer.fit()
    steps = result.steps[a.warmup :]
    return {
        "supervised_tokens_per_s": [r["supervised_tokens_per_s"] for r in steps],
        "step_times_s": [r["step_time_s"] for r in steps],
        "rows": rows,
        "records": records,
        "loss": result.steps[-1]["loss"],
    }


def run_hf(a) -> dict:
    from transformers import DataCollatorWithFlattening, Trainer, TrainerCallback, TrainingArguments

    from memfit.models.load import ModelSource, embedded_checkpoint_dir, load_tokenizer
    from memfit.train.data import chat_records
    from memfit.train.plays import plays_chat_file

    tok = load_tokenizer(ModelSource("hf", path=embedded_checkpoint_dir()))
    records = chat_records(plays_chat_file(), tok, a.records)
    row = a.seq_len + 1
    data = [{"input_ids": ids[:row], "labels": labels[:row]} for ids, labels in records]
    flatten = DataCollatorWithFlattening()
    supervised: list[int] = []

    def collate(features):
        batch = flatten(features)
        supervised.append(int((batch["labels"][:, 1:] != -100).sum()))  # HF shifts labels inside the loss
        return batch

    times = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *args, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, *args, **kw):
            times.append(time.perf_counter() - self.t)

    with tempfile.TemporaryDirectory() as d:
        args = TrainingArguments(
            output_dir=d,
            per_device_train_batch_size=a.hf_records,
            max_steps=a.steps,
            learning_rate=2e-3,
            adam_beta2=0.95,
            warmup_steps=2,
            max_grad_norm=1.0,
            optim="adamw_torch",
            logging_steps=10**6,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            dataloader_num_workers=0,
            disable_tqdm=True,
            seed=0,
        )
        Trainer(model=_lora_model(), args=args, train_dataset=data, data_collator=collate, callbacks=[Clock()]).train()
    steps = list(zip(supervised, times))[a.warmup :]
    return {
        "supervised_tokens_per_s": [n / t for n, t in steps],
        "step_times_s": [t for _, t in steps],
        "records_per_step": a.hf_records,
    }


def child(a) -> None:
    out = run_hf(a) if a.runner == "hf-flat" else run_memfit(a, a.runner == "memfit-packed")
    supervised = sum(r * t for r, t in zip(out["supervised_tokens_per_s"], out["step_times_s"]))
    out["supervised_tokens"] = supervised
    out["rate"] = supervised / sum(out["step_times_s"])
    print("RESULT " + json.dumps(out))


ARMS = ("memfit-packed", "memfit-padded", "hf-flat")


def spawn(a, runner: str) -> dict:
    flags = ["--steps", a.steps, "--warmup", a.warmup, "--batch", a.batch, "--seq-len", a.seq_len]
    flags += ["--records", a.records, "--hf-records", a.hf_records]
    return run_child([sys.executable, __file__, "--child", runner, *map(str, flags)], runner)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", dest="runner")
    p.add_argument("--reps", type=int, default=5, help="runs per arm (interleaved)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2, help="steps excluded from the median")
    p.add_argument("--batch", type=int, default=2, help="memfit rows per step")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--records", type=int, default=600, help="records of shakespeare-chat used")
    p.add_argument("--hf-records", type=int, default=0, help="HF records per step (default: a packed step's)")
    a = p.parse_args()
    if a.runner:
        return child(a)
    results: dict[str, list[dict]] = {k: [] for k in ARMS}
    for rep in range(a.reps):
        for arm in ARMS:
            if arm == "hf-flat" and not a.hf_records:  # as many records per step as a packed memfit step
                packed = results["memfit-packed"][0]
                a.hf_records = max(1, round(a.batch * packed["records"] / packed["rows"]))
            r = spawn(a, arm)
            results[arm].append(r)
            rate = r["rate"]
            print(f"rep {rep + 1}/{a.reps} {arm:14s} {rate:8.1f} supervised tok/s", file=sys.stderr)
    med = {
        k: {
            "supervised_tokens_per_s": statistics.median(r["rate"] for r in v),
            "runs": [round(r["rate"], 1) for r in v],
            "median_step_time_s": statistics.median(statistics.median(r["step_times_s"]) for r in v),
            "supervised_tokens_per_step": statistics.median(r["supervised_tokens"] for r in v) / (a.steps - a.warmup),
        }
        for k, v in results.items()
    }
    base = med["memfit-packed"]["supervised_tokens_per_s"]
    print(
        f"\nSmolLM2-135M LoRA r=8, fp32, CPU ({platform.processor() or platform.machine()}), shakespeare-chat "
        f"({a.records} records), T={a.seq_len}; memfit B={a.batch} rows, HF {a.hf_records} records per step; "
        f"{a.reps} runs x {a.steps} steps (median of steps {a.warmup + 1}..{a.steps})"
    )
    head = f"{'arm':14s} {'supervised tok/s':>17s} {'runs min-max':>13s} {'step s':>7s} {'sup tok/step':>13s}"
    print(head + f" {'packed ÷ this':>14s}")
    for k, v in med.items():
        spread = f"{min(v['runs']):.0f}-{max(v['runs']):.0f}"
        print(
            f"{k:14s} {v['supervised_tokens_per_s']:17.1f} {spread:>13s} {v['median_step_time_s']:7.2f} "
            f"{v['supervised_tokens_per_step']:13.0f} {base / v['supervised_tokens_per_s']:14.2f}"
        )
    summary = {
        "benchmark": "packing",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.platform(),
        "settings": vars(a),
        "arms": med,
        "packed_vs_padded": base / med["memfit-padded"]["supervised_tokens_per_s"],
        "packed_vs_hf_flat": base / med["hf-flat"]["supervised_tokens_per_s"],
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
