"""Supervised tokens per second on instruction data: memfit packed vs memfit padded vs HF Trainer padding-free.

Same model (the embedded SmolLM2-135M-Instruct, LoRA r=8 on all projections, fp32, SDPA), same records (the first
N of ``data.source=shakespeare-chat``, rendered by memfit's loader with the chat template, loss on the answers),
same optimizer (AdamW foreach, lr 2e-3, clip 1.0) and thread count:

- ``memfit-packed``: ``data.packing=true``, ``--batch`` rows of ``seq_len + 1`` tokens, several records each;
- ``memfit-padded``: ``data.packing=false``, ``--batch`` rows, one record each;
- ``hf-flat``: HF Trainer with ``DataCollatorWithFlattening`` (padding-free: a batch's records in one row with
  position ids), each step the very records of memfit's packed step (``packed_steps``), in memfit's order, so
  the two take a loss on the same tokens at every step and their rates differ only by their step times.

Each run is its own subprocess; the arms are interleaved rep by rep so drift hits all alike. A run's number is the
tokens that took a loss over the steps after warm-up divided by those steps' time (each step's own rate varies
with the rows it drew); the table gives the median run and the spread. Prints a table, then one JSON line.

    python benchmarks/packing.py                    # defaults below
    python benchmarks/packing.py --reps 1 --steps 4 # quick look
    python benchmarks/packing.py --model random:llama2-7b --device cuda --precision bf16-mixed --seq-len 1024 \
        --batch 4 --data .gpu_carry/shakespeare-chat.jsonl   # on a GPU: the 7B-shaped LoRA cell, with MFU

With ``--model random:PRESET`` the records' token ids are folded into the preset's vocabulary (``id mod V``) as
memfit's trainer folds them, for the HF arm too. On a GPU each run also reports model FLOPs utilisation: the FLOPs of
every position the arm's model ran (padding included: the padded arm's MFU says how busy the GPU was, its supervised
tokens/s how much of that was useful), at memfit's cost model's FLOPs a token for ``--seq-len`` with LoRA and no
recomputation, over the bf16 peak of the memfit preset the device's name carries.
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
from train_throughput import _lora_model, _model_config, _sync, gpu_utilisation, run_child  # noqa: E402  its model, runner


def _config(a, out_dir: str, packing: bool):
    from memfit.config.loader import load_config
    from memfit.config.shipped import shipped_configs

    return load_config(
        shipped_configs()["smollm2-shakespeare-lora-cpu"],
        [
            f"data.source={a.data}",
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
            f"model.source={a.model}",
            f"train.device={a.device}",
            f"strategy.precision={a.precision}",
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
        "positions_per_s": [r["tokens_per_s"] for r in steps],
        "step_times_s": [r["step_time_s"] for r in steps],
        "rows": rows,
        "records": records,
        "loss": result.steps[-1]["loss"],
    }


def packed_steps(a) -> list[list[dict]]:
    """The records each of memfit's packed micro-batches holds, in order: the rows its trainer draws (the same
    rows, split and seeded sampler as ``Trainer.fit``), each row cut where its position ids restart, the padding
    after the last record left out. Each record as ``{"input_ids", "labels"}`` as the row holds it (its first
    label ignored, as HF's flattening collator ignores it too)."""
    from memfit.models.load import ModelSource, embedded_checkpoint_dir, load_tokenizer
    from memfit.train.data import IGNORE_INDEX, EpochBatchSampler, load_dataset, split

    with tempfile.TemporaryDirectory() as d:
        cfg = _config(a, f"{d}/run", packing=True)
    tok = load_tokenizer(ModelSource("hf", path=embedded_checkpoint_dir()))
    whole = load_dataset(cfg.data, tok)
    if a.model.startswith("random:") and len(tok) > _model_config(a).vocab_size:
        whole = whole.folded(_model_config(a).vocab_size)  # as memfit's trainer folds a random preset's ids
    train, _ = split(whole, cfg.data.eval_fraction)
    sampler = EpochBatchSampler(len(train), a.batch, cfg.train.seed)
    steps = []
    for b in range(a.steps):
        records = []
        for r in sampler.batch(b):
            tokens, labels, positions = (t[r].tolist() for t in (train.tokens, train.labels, train.positions))
            starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
            for lo, hi in zip(starts, starts[1:]):
                if all(x == IGNORE_INDEX for x in labels[lo:hi]) and all(x == tok.pad_token_id for x in tokens[lo:hi]):
                    continue  # the row's padding
                records.append({"input_ids": tokens[lo:hi], "labels": labels[lo:hi]})
        steps.append(records)
    return steps


def run_hf(a) -> dict:
    import torch
    from transformers import DataCollatorWithFlattening, Trainer, TrainerCallback, TrainingArguments

    steps = packed_steps(a)
    flatten = DataCollatorWithFlattening()
    supervised: list[int] = []
    positions: list[int] = []

    def collate(features):  # one item per step: that step's records
        batch = flatten(features[0])
        supervised.append(int((batch["labels"][:, 1:] != -100).sum()))  # HF shifts labels inside the loss
        positions.append(batch["input_ids"].numel())
        return batch

    class InOrder(Trainer):  # memfit's steps in memfit's order, not reshuffled
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    times = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *args, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, *args, **kw):
            _sync(a)
            times.append(time.perf_counter() - self.t)

    with tempfile.TemporaryDirectory() as d:
        args = TrainingArguments(
            output_dir=d,
            per_device_train_batch_size=1,
            max_steps=a.steps,
            learning_rate=2e-3,
            adam_beta2=0.95,
            warmup_steps=2,
            max_grad_norm=1.0,
            optim="adamw_torch",
            logging_steps=10**6,
            save_strategy="no",
            report_to=[],
            use_cpu=a.device == "cpu",
            bf16=a.precision == "bf16-mixed",
            dataloader_num_workers=0,
            remove_unused_columns=False,  # an item is a list of records, not model inputs
            disable_tqdm=True,
            seed=0,
        )
        model = _lora_model(a)
        InOrder(model=model, args=args, train_dataset=steps, data_collator=collate, callbacks=[Clock()]).train()
    measured = list(zip(supervised, positions, times))[a.warmup :]
    return {
        "supervised_tokens_per_s": [n / t for n, _, t in measured],
        "positions_per_s": [n / t for _, n, t in measured],
        "step_times_s": [t for _, _, t in measured],
        "records_per_step": [len(r) for r in steps],
    }


def child(a) -> None:
    out = run_hf(a) if a.runner == "hf-flat" else run_memfit(a, a.runner == "memfit-packed")
    supervised = sum(r * t for r, t in zip(out["supervised_tokens_per_s"], out["step_times_s"]))
    out["supervised_tokens"] = supervised
    out["rate"] = supervised / sum(out["step_times_s"])
    if a.device.startswith("cuda"):
        positions = sum(r * t for r, t in zip(out["positions_per_s"], out["step_times_s"]))
        out.update(gpu_utilisation(a, positions / sum(out["step_times_s"])))
    print("RESULT " + json.dumps(out))


ARMS = ("memfit-packed", "memfit-padded", "hf-flat")


def spawn(a, runner: str) -> dict:
    flags = ["--steps", a.steps, "--warmup", a.warmup, "--batch", a.batch, "--seq-len", a.seq_len]
    flags += ["--records", a.records, "--model", a.model, "--device", a.device, "--precision", a.precision]
    flags += ["--data", a.data]
    return run_child([sys.executable, __file__, "--child", runner, *map(str, flags)], runner)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", dest="runner")
    p.add_argument("--reps", type=int, default=5, help="runs per arm (interleaved)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2, help="steps excluded from the median")
    p.add_argument("--batch", type=int, default=2, help="memfit rows per step")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--records", type=int, default=600, help="records of --data used")
    p.add_argument("--data", default="shakespeare-chat", help="memfit's data.source: chat records (.jsonl)")
    p.add_argument("--model", default="smollm2-135m-instruct", help="or random:PRESET (e.g. random:llama2-7b)")
    p.add_argument("--device", default="cpu", help="cpu | cuda")
    p.add_argument("--precision", default="fp32", help="fp32 | bf16-mixed")
    a = p.parse_args()
    if a.runner:
        return child(a)
    results: dict[str, list[dict]] = {k: [] for k in ARMS}
    for rep in range(a.reps):
        for arm in ARMS:
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
            **({"mfu": statistics.median(r["mfu"] for r in v), "device": v[0]["device"]} if "mfu" in v[0] else {}),
        }
        for k, v in results.items()
    }
    base = med["memfit-packed"]["supervised_tokens_per_s"]
    where = med["memfit-packed"].get("device") or f"CPU ({platform.processor() or platform.machine()})"
    print(
        f"\n{a.model} LoRA r=8, {a.precision}, {where}, {a.data} "
        f"({a.records} records), T={a.seq_len}; memfit B={a.batch} rows, HF the records of memfit's packed steps; "
        f"{a.reps} runs x {a.steps} steps (median of steps {a.warmup + 1}..{a.steps})"
    )
    head = f"{'arm':14s} {'supervised tok/s':>17s} {'runs min-max':>13s} {'step s':>7s} {'sup tok/step':>13s}"
    print(head + f" {'packed ÷ this':>14s}" + (f" {'MFU':>6s}" if "mfu" in med["memfit-packed"] else ""))
    for k, v in med.items():
        spread = f"{min(v['runs']):.0f}-{max(v['runs']):.0f}"
        print(
            f"{k:14s} {v['supervised_tokens_per_s']:17.1f} {spread:>13s} {v['median_step_time_s']:7.2f} "
            f"{v['supervised_tokens_per_step']:13.0f} {base / v['supervised_tokens_per_s']:14.2f}"
            + (f" {100 * v['mfu']:5.1f}%" if "mfu" in v else "")
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
