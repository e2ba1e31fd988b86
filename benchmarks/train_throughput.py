"""Trainer throughput and memory on CPU: memfit vs a plain PyTorch loop vs HF Trainer, and AC policies.

Same model (the embedded SmolLM2-135M-Instruct, LoRA r=8 on all projections), same data (Shakespeare
rows from memfit's loader), same batch, sequence length, optimizer (AdamW foreach, lr 2e-3, clip 1.0)
and thread count. Every run is its own subprocess so its peak RSS is its own; each reports the median
step time over the steps after warm-up, and the minor page faults of those steps (memory the kernel mapped and
zeroed afresh). ``memfit-returning`` is memfit with ``allocator.host_keep_freed=false``: glibc's malloc returning
freed memory to the kernel, as it does by default (and did in memfit before that setting). The parent prints a table
and ends with one JSON line.

    python benchmarks/train_throughput.py                 # defaults below
    python benchmarks/train_throughput.py --reps 1 --steps 6   # quick look
    python benchmarks/train_throughput.py --model random:llama2-7b --device cuda --precision bf16-mixed \
        --seq-len 1024 --runners memfit,plain,hf --ac ""         # on a GPU: the 7B-shaped LoRA cell, with MFU
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _faults() -> int:
    """Minor page faults of this process so far (a page the kernel mapped and zeroed for it)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _memfit_config(a, out_dir: str, ac: str = "none", keep: str = "null"):
    from memfit.config.loader import load_config
    from memfit.config.shipped import shipped_configs

    return load_config(
        shipped_configs()["smollm2-shakespeare-lora-cpu"],
        [
            f"data.seq_len={a.seq_len}",
            f"data.max_documents={a.documents}",
            f"train.micro_batch_size={a.batch}",
            f"train.max_steps={a.steps}",
            "train.eval_every=0",
            "train.eval_batches=1",
            "train.checkpoint_every=0",
            "output.export=false",
            "optimizer.warmup_steps=2",
            f"strategy.activation_checkpointing={ac}",
            f"allocator.host_keep_freed={keep}",
            f"output.dir={out_dir}",
            f"model.source={a.model}",
            f"data.source={a.data}",
            f"train.device={a.device}",
            f"strategy.precision={a.precision}",
        ],
    )


def _rows(a):
    """The same training rows for every runner, from memfit's own loader."""
    from memfit.models.load import ModelSource, embedded_checkpoint_dir, load_tokenizer
    from memfit.train.data import load_dataset, split

    cfg = _memfit_config(a, "/nonexistent")
    tok = load_tokenizer(ModelSource("hf", path=embedded_checkpoint_dir()))
    train, _ = split(load_dataset(cfg.data, tok), cfg.data.eval_fraction)
    rows = train[: a.steps * a.batch][0]  # (steps * B, T + 1) int64
    vocab = _model_config(a).vocab_size
    return (rows % vocab).to(a.device)  # a random preset's smaller vocabulary: ids folded, as memfit folds them


def _model_config(a):
    from memfit.models.load import embedded_checkpoint_dir
    from memfit.models.presets import preset_config

    if a.model.startswith("random:"):
        return preset_config(a.model.removeprefix("random:"), "sdpa")
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(embedded_checkpoint_dir())


def _lora_model(a=None):
    """The plain loop's and HF Trainer's model: the embedded SmolLM2 (or a random preset with ``--model``), LoRA r=8
    on every projection; under bf16-mixed the frozen base in bf16 and the adapters in fp32, as memfit keeps them."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from memfit.models.load import embedded_checkpoint_dir

    torch.manual_seed(0)
    if a is None or not a.model.startswith("random:"):
        model = AutoModelForCausalLM.from_pretrained(
            embedded_checkpoint_dir(), dtype=torch.float32, attn_implementation="sdpa"
        )
    else:  # built where it trains, in its base dtype: a 7B model initialised on a CPU takes minutes
        with torch.device(a.device):
            model = AutoModelForCausalLM.from_config(_model_config(a), dtype=torch.float32)
    model.config.use_cache = False
    if a is not None and a.precision == "bf16-mixed":
        model.to(torch.bfloat16)
    model = get_peft_model(
        model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    )
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    return model.to(a.device if a is not None else "cpu")


def _sync(a) -> None:
    if a.device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def fit_counting_faults(cfg):
    """memfit's ``Trainer.fit()`` on ``cfg``, quiet; its result and the page faults of each step's forward, backward
    and update."""
    from rich.console import Console

    from memfit.train.loop import Trainer

    faults = []

    class Counted(Trainer):
        def _step(self, *args):
            before = _faults()
            out = super()._step(*args)
            faults.append(_faults() - before)
            return out

    return Counted(cfg, display_console=Console(quiet=True)).fit(), faults


def run_memfit(a, ac: str = "none", keep: str = "null") -> dict:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        result, faults = fit_counting_faults(_memfit_config(a, f"{d}/run", ac, keep))
    times = [r["step_time_s"] for r in result.steps]
    return {"step_times_s": times, "step_faults": faults, "loss": result.steps[-1]["loss"]}


def run_memfit_returning(a) -> dict:
    """memfit with the host's malloc left to return freed memory, as before ``allocator.host_keep_freed``."""
    return run_memfit(a, keep="false")


def run_plain(a) -> dict:
    import torch

    rows = _rows(a)
    model = _lora_model(a)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=2e-3, betas=(0.9, 0.95), foreach=True)
    times, faults = [], []
    for step in range(a.steps):
        batch = rows[step * a.batch : (step + 1) * a.batch]
        start, before = time.perf_counter(), _faults()
        loss = plain_step(model, params, opt, batch, a.precision == "bf16-mixed")
        _sync(a)
        times.append(time.perf_counter() - start)
        faults.append(_faults() - before)
    return {"step_times_s": times, "step_faults": faults, "loss": float(loss)}


def plain_step(model, params, opt, batch, bf16: bool = False):
    """One step of the plain PyTorch loop (also ``step_ab.py``'s reference): forward (under bf16 autocast with
    ``bf16``), fp32 cross-entropy, backward, clip at 1.0, optimizer step, zero_grad. Returns the loss tensor."""
    import torch

    with torch.autocast(batch.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=batch[:, :-1]).logits  # (B, T, V)
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def run_hf(a) -> dict:
    import tempfile

    from transformers import Trainer, TrainerCallback, TrainingArguments

    rows = _rows(a).cpu()
    data = [{"input_ids": r[:-1], "labels": r[:-1]} for r in rows]  # HF shifts labels itself
    times, faults, losses = [], [], []

    class Clock(TrainerCallback):
        def on_step_begin(self, *args, **kw):
            self.t, self.f = time.perf_counter(), _faults()

        def on_step_end(self, *args, **kw):
            _sync(a)
            times.append(time.perf_counter() - self.t)
            faults.append(_faults() - self.f)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    with tempfile.TemporaryDirectory() as d:
        args = TrainingArguments(
            output_dir=d,
            per_device_train_batch_size=a.batch,
            max_steps=a.steps,
            learning_rate=2e-3,
            adam_beta2=0.95,
            warmup_steps=2,
            lr_scheduler_type="cosine",
            max_grad_norm=1.0,
            optim="adamw_torch",
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=a.device == "cpu",
            bf16=a.precision == "bf16-mixed",
            dataloader_num_workers=0,
            disable_tqdm=True,
            seed=0,
        )
        Trainer(model=_lora_model(a), args=args, train_dataset=data, callbacks=[Clock()]).train()
    return {"step_times_s": times, "step_faults": faults, "loss": losses[-1] if losses else None}


RUNNERS = {"memfit": run_memfit, "memfit-returning": run_memfit_returning, "plain": run_plain, "hf": run_hf}


def child(a) -> None:
    if a.runner.startswith("ac:"):
        out = run_memfit(a, a.runner[3:])
    else:
        out = RUNNERS[a.runner](a)
    times = out["step_times_s"][a.warmup :]
    out.update(
        median_step_time_s=statistics.median(times),
        median_step_faults=statistics.median(out["step_faults"][a.warmup :]),
        peak_rss_bytes=_peak_rss_bytes(),
        tokens_per_s=a.batch * a.seq_len / statistics.median(times),
    )
    if a.device.startswith("cuda"):
        out.update(gpu_utilisation(a, out["tokens_per_s"]))
    print("RESULT " + json.dumps(out))


def gpu_utilisation(a, tokens_per_s: float) -> dict:
    """The device's name, its peak allocated bytes, and model FLOPs utilisation: the model's training FLOPs a token
    (memfit's cost model without recomputation: forward, and backward as LoRA runs it) x tokens/s, over the bf16
    peak of the memfit hardware preset the device's name carries."""
    import torch

    from memfit.config.strategy import Strategy
    from memfit.planner.cost import Shape, step_flops
    from memfit.planner.hardware import device_preset

    props = torch.cuda.get_device_properties(a.device)
    gpu = device_preset(props.name, props.total_memory, True)
    flops = step_flops(Shape.of(_model_config(a)), 1, a.seq_len, True, Strategy())
    return {
        "device": props.name,
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(a.device),
        "mfu": tokens_per_s * flops / (gpu.peak_tflops * 1e12),
        "peak_tflops": gpu.peak_tflops,
    }


def spawn(a, runner: str) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        runner,
        "--steps",
        str(a.steps),
        "--warmup",
        str(a.warmup),
        "--batch",
        str(a.batch),
        "--seq-len",
        str(a.seq_len),
        "--documents",
        str(a.documents),
        "--model",
        a.model,
        "--device",
        a.device,
        "--precision",
        a.precision,
        "--data",
        a.data,
    ]
    return run_child(cmd, runner)


def run_child(cmd: list[str], runner: str) -> dict:
    """Run a benchmark's child process and return the JSON of its ``RESULT`` line (exit on failure)."""
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    line = next((t for t in proc.stdout.splitlines() if t.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(f"{runner} failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT ") :])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", dest="runner")
    p.add_argument("--reps", type=int, default=3, help="runs per trainer (interleaved)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2, help="steps excluded from the median")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--documents", type=int, default=4)
    p.add_argument("--model", default="smollm2-135m-instruct", help="or random:PRESET (e.g. random:llama2-7b)")
    p.add_argument("--device", default="cpu", help="cpu | cuda")
    p.add_argument("--precision", default="fp32", help="fp32 | bf16-mixed")
    p.add_argument("--data", default="shakespeare", help="memfit's data.source (a directory of texts on a GPU machine)")
    p.add_argument("--runners", default=None, help="comma-separated arms (default: all)")
    p.add_argument("--ac", default="none,ffn,every_k:2,full", help="AC policies for the memfit table ('' for none)")
    a = p.parse_args()
    if a.runner:
        return child(a)

    arms = a.runners.split(",") if a.runners else list(RUNNERS)
    results: dict[str, list[dict]] = {k: [] for k in arms}
    for rep in range(a.reps):
        for name in arms:  # interleaved so drift hits all trainers alike
            results[name].append(spawn(a, name))
            r = results[name][-1]
            print(
                f"rep {rep + 1}/{a.reps} {name:16s} {r['tokens_per_s']:8.1f} tok/s, "
                f"{r['median_step_faults']:,.0f} page faults a step",
                file=sys.stderr,
            )
    med = {
        k: {
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in v),
            "peak_rss_bytes": statistics.median(r["peak_rss_bytes"] for r in v),
            "runs_tokens_per_s": [round(r["tokens_per_s"], 1) for r in v],
            "step_faults": statistics.median(r["median_step_faults"] for r in v),
            **({"mfu": statistics.median(r["mfu"] for r in v), "device": v[0]["device"]} if "mfu" in v[0] else {}),
            **({"peak_allocated_bytes": max(r["peak_allocated_bytes"] for r in v)} if "mfu" in v[0] else {}),
        }
        for k, v in results.items()
    }
    ac_rows = {}
    for policy in filter(None, a.ac.split(",")):
        r = spawn(a, f"ac:{policy}")
        ac_rows[policy] = {
            "median_step_time_s": r["median_step_time_s"],
            "peak_rss_bytes": r["peak_rss_bytes"],
            "loss": r["loss"],
        }
        print(f"ac {policy:10s} {r['median_step_time_s']:.3f} s/step", file=sys.stderr)

    gib = 1 << 30
    where = med[arms[0]].get("device") or f"CPU ({platform.processor() or platform.machine()})"
    print(
        f"\n{a.model} LoRA r=8, B={a.batch}, T={a.seq_len}, {a.precision}, {where}, "
        f"{a.reps} runs x {a.steps} steps (median of steps {a.warmup + 1}..{a.steps})"
    )
    print(
        f"{'trainer':17s} {'tokens/s (median)':>18s} {'runs':>40s} {'page faults/step':>17s} "
        f"{'peak RSS GiB':>13s} {'memfit ÷ this':>14s} {'MFU':>6s}"
    )
    for k, v in med.items():
        ratio = med["memfit"]["tokens_per_s"] / v["tokens_per_s"] if "memfit" in med else float("nan")
        mfu = f"{100 * v['mfu']:5.1f}%" if "mfu" in v else "     -"
        print(
            f"{k:17s} {v['tokens_per_s']:18.1f} {str(v['runs_tokens_per_s']):>40s} {v['step_faults']:17,.0f} "
            f"{v['peak_rss_bytes'] / gib:13.3f} {ratio:14.3f} {mfu}"
        )
    print(f"\n{'AC policy':10s} {'step time s':>12s} {'peak RSS GiB':>13s} {'loss after N':>13s}")
    for policy, r in ac_rows.items():
        print(f"{policy:10s} {r['median_step_time_s']:12.3f} {r['peak_rss_bytes'] / gib:13.3f} {r['loss']:13.5f}")
    summary = {
        "benchmark": "train_throughput",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.platform(),
        "settings": vars(a),
        "trainers": med,
        **{
            f"ratio_vs_{k.replace('-', '_')}": med["memfit"]["tokens_per_s"] / v["tokens_per_s"]
            for k, v in med.items()
            if k != "memfit" and "memfit" in med
        },
        "ac": ac_rows,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
