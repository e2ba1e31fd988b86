"""Every GPU measurement the open issues ask for, in one short run (a lent GPU has ~15 minutes).

    bash benchmarks/gpu_prepare.sh          # here: tokenizer + two plays into .gpu_carry/ (no hub)
    bash benchmarks/gpu_check.sh            # there: runs this script, results under $OUT

Parts, each in its own subprocess(es) with its own time limit, so one failure leaves the others. With no
``--parts``, the run is ``OPEN_PARTS``: what the open issues still ask of a GPU, in this order:

1. ``doctor``: the platform as memfit sees it (``memfit doctor --json``).
2. ``bench-qlora`` (issue 16, items 0 and 3): ``memfit bench`` on the Llama-2-7B-shaped LoRA cell (bf16-mixed, AC
   none and full) with the base in bf16 (``lora.quantize_base=none``: the frozen base stored in bf16 under
   bf16-mixed) and in NF4: per cell peak allocated / reserved, fragmentation, step time, tokens/s, and the planner's
   prediction (computed on the machine's CPU before the cell allocated) beside ``torch.cuda.max_memory_allocated()``.
3. ``bench-lowbit`` (issue 16 item 1): the full fine-tune (bf16-pure, AC full) with 32-, 8- and 4-bit AdamW
   states (``optimizer.name``). torchao comes from ``.gpu_carry/wheels`` (``gpu_prepare.sh``).
4. ``packing`` (issue 18): ``benchmarks/packing.py`` on the 7B-shaped LoRA cell (bf16-mixed, T = 1024, 4 rows):
   supervised tokens/s and model FLOPs utilisation of memfit packed, memfit padded and HF Trainer's padding-free
   collator on the same records (``.gpu_carry/shakespeare-chat.jsonl``), 2 interleaved runs per arm.
5. ``bench-optimizer-offload`` (issue 16 item 2): the full fine-tune (bf16-pure, AC full) with AdamW in host
   memory (``optimizer.offload``): device peak, step time and host RSS against the planner's device and host bytes;
   the same cell with AdamW on the device is ``bench-lowbit``'s 32-bit one (not run twice). Last: its host step and
   pinned buffers (58 GiB of host memory predicted) make it the slowest cell.
6. ``bench-moe-qlora`` (issue 16 item 3, the thirty-seventh session's NF4 experts): ``bench-moe``'s
   Mixtral-8x7B-shaped model (LoRA on attention, bf16-mixed, AC none) with its base in bf16 and in NF4, experts
   included: peak allocated against the planner. Last, so that a short budget drops it first.

Parts measured on 2026-11-30 (benchmarks/RESULTS.md) or by an earlier issue, run only when named in ``--parts``:

- ``replay`` (fragmentation): a 7B-shaped LoRA run records allocator history from before the weights arrive and
  dumps a snapshot after step 3; the trace is replayed through memfit's allocator model and its peak reserved and
  segment count set beside what the allocator reported (target within 2%), for default settings and for
  expandable segments; also the cost of one fragmentation reading against the step time, and the layout rebuilt
  from the trace (``memfit/allocator/layout.py``).
- ``layout`` (fragmentation): a random alloc/free workload on the GPU (with ``empty_cache`` calls), in a fresh
  process per allocator setting, takes ``torch.cuda.memory_snapshot()`` three times mid-run as ground truth, set
  beside the layout rebuilt from the final snapshot's trace at those moments.
- ``bench-lora`` / ``bench-full``: AC policy x precision (bf16-mixed, bf16-pure), LoRA and full fine-tuning, with
  the allocator model's peak reserved for the planned two steps beside ``max_memory_reserved()``.
- ``bench-chunks``, ``bench-offload``, ``bench-in-backward`` (the first levers issue): the loss whole and in 8
  chunks; activations offloaded and not (device peak, step time, host RSS against the planner's device and host
  bytes); the full fine-tune's optimizer step after and in backward.
- ``throughput``: ``benchmarks/train_throughput.py`` on the 7B-shaped LoRA cell: memfit vs a plain loop vs HF
  Trainer on the same padded text rows, tokens/s and MFU.
- ``diag``: one bench cell (7B LoRA, ffn, bf16-pure) once more, its last step both profiled (torch.profiler's
  memory events, written to ``diag_events.json.gz``) and traced by the allocator (``diag_snapshot.pickle.gz``),
  then ``memfit frag --simulate`` on that snapshot (its plots come back as ``diag_*.png``).
- ``oom``: a cell under ``allocator.memory_fraction=0.25`` must exit 3 with the bytes requested and a snapshot.
- ``exporter``: ``memfit exporter`` on loopback, scraped and parsed with prometheus_client.
- ``auto``: ``memfit train --auto`` on the 7B-shaped cell: the row it chose for this GPU (after the allocator
  replay), three steps, the predicted and measured peak and step time.
- ``on-oom``: the ``oom`` cell with ``train.on_oom=next``: the switches it made and whether it ends.
- ``restart``: ``train.restart_on`` with the whole run's allocator trace recorded.
- ``bench-lora-embeddings`` (no issue: the thirty-ninth session's ``lora.modules_to_save``): ``bench-qlora``'s
  bf16-mixed LoRA cell without checkpointing (its ``quantize_base=none`` cell is the same cell without them) with the
  embeddings and head trained whole, peak allocated against the planner (predicted 21.1 GiB more on Llama-3-8B).
- ``bench-moe`` (no issue: the thirty-fifth session's mixtures of experts): ``memfit bench`` on a Mixtral-8x7B-shaped
  model of 4 layers (LoRA on its attention, bf16-mixed and bf16-pure, AC none and full), the planner's prediction
  (the experts' grouped matmuls traced on CPU) beside ``torch.cuda.max_memory_allocated()``.

``--budget-s`` bounds the whole run: each part's time limit is clipped to what is left, and a part with
under 30 s left is skipped. Work files live in a temporary directory, so only the summaries, tables and
plots land in ``--out`` (the device tool brings back at most 8 files).

Writes ``summary.json`` and ``summary.md`` (and the bench tables and plots) to ``--out``. ``--smoke``
runs the same parts on the tiny preset on CPU to check the script itself (GPU-only parts report
"skipped").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from memfit.allocator.validation import compare_moments, layout_line, replay_line, replay_row  # noqa: E402
from memfit.telemetry.bench import run_in_group  # noqa: E402

GIB = 1 << 30
OPEN_PARTS = ("doctor", "bench-qlora", "bench-lowbit", "packing", "bench-optimizer-offload", "bench-moe-qlora")
"""The default run: what the open issues still ask a GPU for, the likeliest to finish first (about 8 minutes on the
H200 by the 2026-11-30 runs' 30-35 s a bench cell: 8 cells and 6 packing runs). Run it as
``bash benchmarks/gpu_check.sh --out $OUT`` with carry ``[".gpu_carry"]`` and a ``timeout_s`` of about 580: a lent
GPU's 15 minutes include its start, so there is one try; every part rewrites ``summary.json`` as it ends."""
TRAINED = ("lora.modules_to_save=[embed_tokens,lm_head]",)
"""``bench-lora-embeddings``: what its LoRA cell trains beside the adapters."""
DEADLINE = [float("inf")]  # perf_counter time by which every part must be done (--budget-s)


def _left(timeout_s: float) -> int:
    """``timeout_s`` clipped to what the run's budget has left."""
    return max(1, int(min(timeout_s, DEADLINE[0] - time.perf_counter())))


def _run(cmd: list[str], timeout_s: int, log) -> subprocess.CompletedProcess | None:
    """Run ``cmd`` in its own process group, logged; past ``timeout_s`` the whole group is killed (a bench's
    cell subprocesses too, so they do not hold the GPU into the next part)."""
    timeout_s = _left(timeout_s)
    log.write(f"$ {' '.join(cmd)}  (limit {timeout_s} s)\n")
    log.flush()
    proc = run_in_group(cmd, timeout_s, REPO)
    if proc is None:
        log.write(f"timed out after {timeout_s} s\n")
        return None
    log.write(proc.stdout[-6000:] + proc.stderr[-6000:] + f"\n(exit {proc.returncode})\n")
    log.flush()
    return proc


def _train_args(s: argparse.Namespace, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "memfit.cli",
        "train",
        "tiny-cpu",
        *s.base,
        *extra,
        f"output.dir={out}",
        "train.eval_every=0",
        "train.eval_batches=1",
        "output.export=false",
        "train.keep_checkpoints=0",
        "train.log_every=1",
    ]


def part_doctor(s, out: Path, log) -> dict:
    proc = _run([sys.executable, "-m", "memfit.cli", "doctor", "--json"], 120, log)
    if proc is None or not proc.stdout.strip():
        return {"status": "failed"}
    return {"status": "ok", "doctor": json.loads(proc.stdout.strip().splitlines()[-1])}


def part_replay(s, out: Path, log) -> dict:
    """Record history over 3 steps, replay the snapshot's trace in the model, compare."""
    import torch

    if not torch.cuda.is_available():
        return {"status": "skipped", "why": "needs a CUDA/ROCm device"}
    from memfit.allocator.model import AllocatorSettings
    from memfit.allocator.snapshot import load_snapshot
    from memfit.telemetry.metrics_file import read_metrics

    rows = []
    for label, settings, extra in (
        ("default", AllocatorSettings(), []),
        ("expandable_segments", AllocatorSettings(expandable_segments=True), ["allocator.expandable_segments=true"]),
    ):
        run = s.work / f"replay-{label}"
        proc = _run(
            _train_args(
                s,
                run,
                *s.replay_cell,
                "train.max_steps=3",
                "train.record_memory_history=true",
                "train.snapshot_at_step=3",
                "train.frag_every=1",
                *extra,
            ),
            120,
            log,
        )
        if proc is None or proc.returncode != 0:
            rows.append({"settings": label, "status": "failed"})
            continue
        try:
            steps = [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "step"]
            rows.append(replay_row(label, settings, load_snapshot(run / "snapshot_step3.pickle"), steps))
        except Exception as e:  # keep the other setting's row
            rows.append({"settings": label, "status": f"error: {type(e).__name__}: {e}"})
        shutil.rmtree(run, ignore_errors=True)  # the snapshot is large; its numbers are in the summary
    return {"status": "ok" if all(r["status"] == "ok" for r in rows) else "partial", "rows": rows}


def layout_worker(path: str) -> None:
    """In a fresh process on the GPU (allocator settings from the environment): the workload, the
    three ground-truth readings, the final snapshot and the comparison, as JSON to ``path``."""
    import random

    import torch

    from memfit.allocator.snapshot import analyze

    torch.cuda.memory._record_memory_history(max_entries=1_000_000, context=None)
    rng, live, truths = random.Random(0), [], []
    for i in range(1, 1501):
        roll = rng.random()
        if live and (roll < 0.45 or sum(t.numel() for t in live) > 24 * GIB):
            live.pop(rng.randrange(len(live)))
        elif roll < 0.47:
            torch.cuda.empty_cache()
        else:
            size = rng.choice(
                [rng.randrange(1, 1 << 20), rng.randrange(1 << 20, 40 << 20), rng.randrange(40 << 20, 300 << 20)]
            )
            live.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
        if i in (400, 800, 1200):
            truths.append(analyze({"segments": torch.cuda.memory_snapshot()}, 0).as_dict())
    result = compare_moments(torch.cuda.memory._snapshot(), truths)
    Path(path).write_text(json.dumps(result))


def part_layout(s, out: Path, log) -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"status": "skipped", "why": "needs a CUDA/ROCm device"}
    rows = []
    for label, conf in (("default", ""), ("expandable_segments", "expandable_segments:True")):
        path = s.work / f"layout-{label}.json"
        var = "PYTORCH_HIP_ALLOC_CONF" if torch.version.hip else "PYTORCH_CUDA_ALLOC_CONF"
        env = {**os.environ, var: conf} if conf else dict(os.environ)
        log.write(f"$ {var}={conf} layout worker\n")
        try:
            proc = subprocess.run(
                [sys.executable, __file__, "--layout-worker", str(path)],
                capture_output=True,
                text=True,
                timeout=_left(120),
                cwd=REPO,
                env=env,
            )
            log.write(proc.stdout[-3000:] + proc.stderr[-3000:] + f"\n(exit {proc.returncode})\n")
        except subprocess.TimeoutExpired:
            log.write("timed out\n")
        rows.append(
            {"settings": label, **json.loads(path.read_text())}
            if path.is_file()
            else {"settings": label, "status": "failed or timed out"}
        )
    return {"status": "ok" if all(r["status"] == "ok" for r in rows) else "partial", "layout_rows": rows}


def diag_worker(args: str) -> None:
    """In this process: one training run whose last step is both profiled (torch.profiler's memory
    events, written out) and traced by the allocator (its snapshot), so the two accounts of the same
    step and the planner's prediction can be compared offline. ``args``: JSON [events path, overrides]."""
    import gzip

    import memfit.planner.measure as measure
    from memfit.config.loader import load_config
    from memfit.config.shipped import shipped_configs
    from memfit.train.loop import Trainer

    events_path, overrides = json.loads(args)
    seen: list = []
    original = measure.allocation_events

    def keep(prof, device_type):
        events = original(prof, device_type)
        seen.extend(events)
        return events

    measure.allocation_events = keep
    trainer = Trainer(load_config(shipped_configs()["tiny-cpu"], overrides))
    result = trainer.fit()
    trainer.close()
    record = next(r for r in result.steps if "profiled_peak_bytes" in r)
    payload = {
        "events": seen,
        "record": record,
        "predicted_peak_bytes": trainer.predicted.peak_bytes if trainer.predicted else None,
        "predicted_phase": trainer.predicted.peak_phase if trainer.predicted else None,
    }
    with gzip.open(events_path, "wt") as f:
        json.dump(payload, f, default=str)


def part_diag(s, out: Path, log) -> dict:
    """The bench cell whose prediction erred most (7B LoRA, ffn, bf16-pure) once more, its last step
    profiled and traced; the events and the snapshot come back gzipped, and ``memfit frag --simulate``
    runs on that real snapshot (its plots come back too)."""
    import gzip

    run = s.work / "diag"
    step = 3
    overrides = [
        *s.base,
        *s.diag_cell,
        f"output.dir={run}",
        "train.eval_every=0",
        "train.eval_batches=1",
        "output.export=false",
        "train.keep_checkpoints=0",
        "train.log_every=1",
        f"train.max_steps={step}",
        f"train.profile_step={step}",
        f"train.snapshot_at_step={step}",
    ]
    events = out / "diag_events.json.gz"
    proc = _run([sys.executable, __file__, "--diag-worker", json.dumps([str(events), overrides])], 150, log)
    if proc is None or proc.returncode != 0 or not events.is_file():
        return {"status": "failed"}
    payload = json.loads(gzip.open(events).read())
    result = {
        "status": "ok",
        "record": payload["record"],
        "predicted_peak_bytes": payload["predicted_peak_bytes"],
        "predicted_phase": payload["predicted_phase"],
        "profiler_events": len(payload["events"]),
    }
    snap = run / f"snapshot_step{step}.pickle"
    if snap.is_file():
        with open(snap, "rb") as src, gzip.open(out / "diag_snapshot.pickle.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        frag = _run(
            [
                sys.executable,
                "-m",
                "memfit.cli",
                "frag",
                str(snap),
                "--simulate",
                "--json",
                "--out",
                str(s.work / "frag"),
            ],
            120,
            log,
        )
        if frag is not None and frag.returncode == 0:
            result["frag"] = json.loads(frag.stdout.strip().splitlines()[-1])
            text = _run(
                [sys.executable, "-m", "memfit.cli", "frag", str(snap), "--simulate", "--out", str(s.work / "frag")],
                120,
                log,
            )
            result["frag_text"] = text.stdout if text is not None else None
            for png in ("segments_at_peak_device0.png", "timeline_device0.png", "whatif_device0.png"):
                if (s.work / "frag" / png).is_file():
                    shutil.copy(s.work / "frag" / png, out / f"diag_{png}")
    return result


def part_oom(s, out: Path, log) -> dict:
    """A cell that cannot fit under a memory-fraction cap: the trainer must exit 3 with the bytes
    requested, a snapshot, its diagnosis and the planner's numbers, the run directory intact."""
    import torch

    if not torch.cuda.is_available():
        return {"status": "skipped", "why": "needs a CUDA/ROCm device"}
    run = s.work / "oom"
    proc = _run(
        _train_args(
            s, run, *s.oom_cell, "train.max_steps=2", "train.plan_check=false", "train.record_memory_history=true"
        ),
        150,
        log,
    )
    if proc is None:
        return {"status": "timed out"}
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "out of memory" in line]
    files = sorted(p.name for p in run.iterdir()) if run.is_dir() else []
    return {
        "status": "ok" if proc.returncode == 3 else f"exit {proc.returncode}",
        "exit_code": proc.returncode,
        "message": lines[-1] if lines else None,
        "run_dir_files": files,
    }


def part_auto(s, out: Path, log) -> dict:
    """``memfit train --auto`` on the GPU: the plan for the visible device, the allocator replay of the chosen row,
    three steps; the chosen row, its predicted and measured step time, and the predicted and measured peak."""
    import torch

    if not torch.cuda.is_available():
        return {"status": "skipped", "why": "needs a CUDA/ROCm device"}
    run = s.work / "auto"
    args = _train_args(s, run, "train.max_steps=3")
    proc = _run([*args[:5], "--auto", *args[5:]], 240, log)
    if proc is None:
        return {"status": "timed out"}
    plan = json.loads((run / "auto-plan.json").read_text()) if (run / "auto-plan.json").is_file() else {}
    summaries = (
        [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"summary"' in x]
        if (run / "metrics.jsonl").is_file()
        else []
    )
    chosen = plan["fitting"][plan["chosen_row"] - 1] if plan else None
    return {
        "status": "ok" if proc.returncode == 0 else f"exit {proc.returncode}",
        "chosen": {k: chosen[k] for k in ("activation_checkpointing", "precision", "micro_batch_size", "loss_chunks")}
        if chosen
        else None,
        "predicted_peak_bytes": chosen["peak_bytes"] if chosen else None,
        "predicted_step_time_s": plan.get("predicted_step_time_s"),
        "measured_median_step_time_s": plan.get("measured_median_step_time_s"),
        "summary": summaries[-1] if summaries else None,
    }


def part_on_oom(s, out: Path, log) -> dict:
    """The OOM cell with ``train.on_oom=next``: its out-of-memory exits walk down the ladder until one fits."""
    import torch

    if not torch.cuda.is_available():
        return {"status": "skipped", "why": "needs a CUDA/ROCm device"}
    run = s.work / "on_oom"
    proc = _run(
        _train_args(s, run, *s.oom_cell, "train.max_steps=2", "train.plan_check=false", "train.on_oom=next")
        + ["train.keep_checkpoints=1"],
        300,
        log,
    )
    if proc is None:
        return {"status": "timed out"}
    return {
        "status": "ok" if proc.returncode == 0 else f"exit {proc.returncode}",
        "switches": _records(run, "on_oom"),
    }


def _records(run: Path, kind: str) -> list[dict]:
    """The ``kind`` records of a run's metrics.jsonl ([] where it wrote none)."""
    metrics = run / "metrics.jsonl"
    records = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.is_file() else []
    return [r for r in records if r.get("kind") == kind]


def part_restart(s, out: Path, log) -> dict:
    """``train.restart_on`` with the whole run's allocator trace recorded: the restart record's allocator advice
    comes from the what-if replay of that recorded trace (``replayed``), and the run resumes in a fresh process."""
    import torch

    if not torch.cuda.is_available():
        return {"status": "skipped", "why": "needs a CUDA/ROCm device"}
    run = s.work / "restart"
    extra = ["train.max_steps=4", "train.restart_on=every:2steps", "train.max_restarts=1"]
    extra += ["train.record_memory_history=true", "train.keep_checkpoints=1"]
    proc = _run(_train_args(s, run, *s.replay_cell, *extra), 300, log)
    if proc is None:
        return {"status": "timed out"}
    return {"status": "ok" if proc.returncode == 0 else f"exit {proc.returncode}", "restarts": _records(run, "restart")}


def part_exporter(s, out: Path, log) -> dict:
    """``memfit exporter`` on loopback, scraped twice and parsed with prometheus_client."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    proc = subprocess.Popen(
        [sys.executable, "-m", "memfit.cli", "exporter", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
    )
    try:
        first = proc.stdout.readline()  # "memfit exporter: device memory from BACKEND at http://HOST:PORT/metrics"
        log.write(first)
        url = first.rsplit(" at ", 1)[-1].strip()
        text = urllib.request.urlopen(url, timeout=30).read().decode()
        samples = {
            f"{x.name}{x.labels}": x.value
            for fam in text_string_to_metric_families(text)
            for x in fam.samples
            if x.name.startswith("memfit_")
        }
        return {"status": "ok", "banner": first.strip(), "samples": samples}
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def part_script(s, out: Path, log, name: str, args: list[str], timeout_s: int) -> dict:
    """``benchmarks/<name>.py`` with ``args``: its whole output to ``<name>.txt`` in ``--out``, its last line (the
    benchmark's JSON summary) into the summary."""
    proc = _run([sys.executable, str(REPO / "benchmarks" / f"{name}.py"), *args], timeout_s, log)
    if proc is None:
        return {"status": "timed out"}
    (out / f"{name}.txt").write_text(proc.stdout + proc.stderr)
    lines = proc.stdout.strip().splitlines() or [""]
    if proc.returncode != 0 or not lines[-1].startswith("{"):
        return {"status": f"exit {proc.returncode}"}
    return {"status": "ok", "result": json.loads(lines[-1]), "table": "\n".join(lines[:-1]).strip()}


def moe_config(s) -> str:
    """A Mixtral-8x7B-shaped ``config.json`` (4 of its 32 layers: 5.6B parameters, 8 experts of which 2 run per
    token) written into the work directory, as ``random:<path>`` (the tiny mixture of experts with ``--smoke``)."""
    from transformers import MixtralConfig

    shape = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8)
    if s.smoke:
        shape = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
    config = MixtralConfig(**shape, num_hidden_layers=4, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000)
    config.save_pretrained(s.work / "mixtral")
    return f"model.source=random:{s.work / 'mixtral' / 'config.json'}"


def part_bench(s, out: Path, log, name: str, matrix: list[str], extra: tuple[str, ...] = ()) -> dict:
    bench_out = s.work / name
    cmd = [
        sys.executable,
        "-m",
        "memfit.cli",
        "bench",
        "tiny-cpu",
        *matrix,
        "--steps",
        str(s.steps),
        "--warmup",
        "1",
        "--out",
        str(bench_out),
        "--set",
        *s.base,
        *extra,
        "output.export=false",
    ]
    proc = _run(cmd, s.bench_timeout, log)
    results = bench_out / "results.json"  # rewritten after every cell: a timeout keeps the finished ones
    if not results.is_file():
        return {"status": "failed" if proc is not None else "timed out"}
    # At most 8 files come back from the machine: the table goes into summary.md, the plot is copied (the default run's
    # parts bring back 7 files in all), and the cells of the older levers' parts travel in summary.json only.
    copies = [("memory_per_cell.png", f"{name}_memory.png")]
    if name == "bench_lora":
        copies.append(("pareto.png", f"{name}_pareto.png"))
    if name in ("bench_offload", "bench_in_backward", "bench_chunks", "bench_moe_qlora", "bench_lora_embeddings"):
        copies = []
    for src, dst in copies:
        if (bench_out / src).is_file():
            shutil.copy(bench_out / src, out / dst)
    cells = json.loads(results.read_text())
    frag = []
    for c in cells:
        metrics = bench_out / "cells" / c["name"] / "metrics.jsonl"
        if metrics.is_file():
            from memfit.telemetry.metrics_file import read_metrics

            frag += [
                (r["frag_time_s"], r["step_time_s"])
                for r in read_metrics(metrics)
                if r.get("kind") == "step" and r.get("frag_time_s") is not None
            ]
    done = proc is not None and all(c["status"] != "pending" for c in cells)
    table = (bench_out / "results.md").read_text() if (bench_out / "results.md").is_file() else None
    status = "ok" if done else "partial (timed out)"
    return {"status": status, "cells": cells, "frag_time_vs_step": frag, "table": table}


def summary_md(summary: dict) -> str:
    lines = [f"# GPU check {summary['date']} on {summary['device']}", ""]
    for name, part in summary["parts"].items():
        lines.append(f"## {name}: {part.get('status')} ({part.get('wall_s', 0):.0f} s)")
        if part.get("table"):
            lines += ["", part["table"].strip(), ""]
        for r in part.get("rows", []):
            if r["status"] != "ok":
                lines.append(f"- {r['settings']}: {r['status']}")
                continue
            lines.append(replay_line(r))
        for r in part.get("layout_rows", []):
            if r["status"] != "ok":
                lines.append(f"- layout, {r['settings']}: {r['status']}")
                continue
            lines.append(layout_line(r))
        if part.get("frag_time_vs_step"):
            worst = max(f / t for f, t in part["frag_time_vs_step"])
            lines.append(
                f"- one fragmentation reading costs up to {100 * worst:.2f}% of a step "
                f"({len(part['frag_time_vs_step'])} readings)"
            )
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/gpu_check"))
    ap.add_argument("--smoke", action="store_true", help="tiny preset on CPU: checks this script, measures nothing")
    ap.add_argument("--parts", default=",".join(OPEN_PARTS), help="comma-separated, run in this order")
    ap.add_argument("--budget-s", type=float, default=540, help="all parts end within this many seconds")
    ap.add_argument("--layout-worker", metavar="JSON", help=argparse.SUPPRESS)
    ap.add_argument("--diag-worker", metavar="JSON", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    ns.smoke = bool(ns.smoke)
    if ns.layout_worker:
        layout_worker(ns.layout_worker)
        return 0
    if ns.diag_worker:
        diag_worker(ns.diag_worker)
        return 0
    DEADLINE[0] = time.perf_counter() + ns.budget_s
    out = Path(ns.out)
    data = REPO / ".gpu_carry" / "data"
    source = str(data) if data.is_dir() else "shakespeare"
    if ns.smoke:
        ns.base = [
            "model.source=random:tiny",
            f"data.source={source}",
            "data.seq_len=64",
            "data.max_documents=2",
            "train.device=cpu",
            "train.threads=2",
        ]
        ns.replay_cell = ["strategy.precision=fp32", "train.micro_batch_size=2"]
        ns.lora = ["--ac", "none,full", "--precision", "fp32", "--micro-batch", "2", "--lora", "true"]
        ns.full = ["--ac", "full", "--precision", "fp32", "--micro-batch", "2", "--lora", "false"]
        ns.chunks = [
            "--ac",
            "none",
            "--precision",
            "fp32",
            "--micro-batch",
            "2",
            "--lora",
            "true",
            "--loss-chunks",
            "0,4",
        ]
        ns.offload = ["--ac", "none", "--precision", "fp32", "--micro-batch", "2", "--lora", "true"]
        ns.offload += ["--activation-offload", "false,true"]
        ns.in_backward = ["--ac", "full", "--precision", "fp32", "--micro-batch", "2", "--lora", "false"]
        ns.in_backward += ["--optimizer-in-backward", "false,true"]
        ns.lowbit = ["--ac", "full", "--precision", "fp32", "--micro-batch", "2", "--lora", "false"]
        ns.lowbit += ["--optimizer-name", "adamw,adamw8bit,adamw4bit"]
        ns.qlora = ["--ac", "none", "--precision", "bf16-mixed", "--micro-batch", "2", "--lora", "true"]
        ns.qlora += ["--quantize-base", "none,nf4"]
        ns.host_optimizer = ["--ac", "full", "--precision", "fp32", "--micro-batch", "2", "--lora", "false"]
        ns.host_optimizer += ["--optimizer-offload", "true"]  # on the device: bench-lowbit's adamw cell
        ns.diag_cell = [
            "strategy.precision=fp32",
            "strategy.activation_checkpointing=ffn",
            "lora.enabled=true",
            "train.micro_batch_size=2",
        ]
        ns.oom_cell = ns.replay_cell
        ns.packing = ["--model", "random:tiny", "--seq-len", "128", "--records", "60", "--data", "shakespeare-chat"]
        ns.packing += ["--reps", "1", "--steps", "3", "--warmup", "1"]
        ns.throughput = ["--model", "random:tiny", "--seq-len", "64", "--reps", "1", "--steps", "3", "--warmup", "1"]
        ns.throughput += ["--runners", "memfit,plain,hf", "--ac", "", "--data", source]
        ns.moe = ["--ac", "none,full", "--precision", "fp32", "--micro-batch", "2", "--lora", "true"]
        ns.moe_qlora = ["--ac", "none", "--precision", "bf16-mixed", "--micro-batch", "2", "--lora", "true"]
        ns.moe_qlora += ["--quantize-base", "none,nf4"]
        ns.lora_embeddings = ["--ac", "none", "--precision", "fp32", "--micro-batch", "2", "--lora", "true"]
        ns.steps, ns.bench_timeout = 2, 300
    else:
        ns.base = [
            "model.source=random:llama2-7b",
            f"data.source={source}",
            "data.seq_len=1024",
            "data.max_documents=2",
            "train.device=cuda",
            "data.num_workers=0",
        ]
        ns.replay_cell = [
            "strategy.precision=bf16-mixed",
            "strategy.activation_checkpointing=ffn",
            "lora.enabled=true",
            "train.micro_batch_size=4",
        ]
        ns.lora = [
            "--ac",
            "none,ffn,full",
            "--precision",
            "bf16-mixed,bf16-pure",
            "--micro-batch",
            "4",
            "--lora",
            "true",
        ]
        ns.full = ["--ac", "full", "--precision", "bf16-mixed,bf16-pure", "--micro-batch", "4", "--lora", "false"]
        ns.chunks = [
            "--ac",
            "none,full",
            "--precision",
            "bf16-mixed",
            "--micro-batch",
            "4",
            "--lora",
            "true",
            "--loss-chunks",
            "0,8",
        ]
        ns.offload = ["--ac", "none", "--precision", "bf16-mixed", "--micro-batch", "4", "--lora", "true"]
        ns.offload += ["--activation-offload", "false,true"]
        ns.in_backward = ["--ac", "full", "--precision", "bf16-pure", "--micro-batch", "4", "--lora", "false"]
        ns.in_backward += ["--optimizer-in-backward", "false,true"]
        ns.lowbit = ["--ac", "full", "--precision", "bf16-pure", "--micro-batch", "4", "--lora", "false"]
        ns.lowbit += ["--optimizer-name", "adamw,adamw8bit,adamw4bit"]
        ns.qlora = ["--ac", "none,full", "--precision", "bf16-mixed", "--micro-batch", "4", "--lora", "true"]
        ns.qlora += ["--quantize-base", "none,nf4"]
        ns.host_optimizer = ["--ac", "full", "--precision", "bf16-pure", "--micro-batch", "4", "--lora", "false"]
        ns.host_optimizer += ["--optimizer-offload", "true"]  # on the device: bench-lowbit's adamw cell
        ns.diag_cell = [
            "strategy.precision=bf16-pure",
            "strategy.activation_checkpointing=ffn",
            "lora.enabled=true",
            "train.micro_batch_size=4",
        ]
        ns.oom_cell = [
            "strategy.precision=bf16-mixed",
            "strategy.activation_checkpointing=none",
            "lora.enabled=true",
            "train.micro_batch_size=4",
            "allocator.memory_fraction=0.25",
        ]
        chat = REPO / ".gpu_carry" / "shakespeare-chat.jsonl"  # gpu_prepare.sh: the GPU machine has no plays
        ns.packing = ["--model", "random:llama2-7b", "--device", "cuda", "--precision", "bf16-mixed"]
        ns.packing += ["--seq-len", "1024", "--batch", "4", "--records", "3000", "--reps", "2", "--steps", "8"]
        ns.packing += ["--data", str(chat) if chat.is_file() else "shakespeare-chat"]
        ns.throughput = ["--model", "random:llama2-7b", "--device", "cuda", "--precision", "bf16-mixed"]
        ns.throughput += ["--seq-len", "1024", "--batch", "4", "--steps", "10", "--reps", "2"]
        ns.throughput += ["--runners", "memfit,plain,hf", "--ac", "", "--data", source]
        ns.moe = ["--ac", "none,full", "--precision", "bf16-mixed,bf16-pure", "--micro-batch", "4", "--lora", "true"]
        ns.moe_qlora = ["--ac", "none", "--precision", "bf16-mixed", "--micro-batch", "4", "--lora", "true"]
        ns.moe_qlora += ["--quantize-base", "none,nf4"]
        ns.lora_embeddings = ["--ac", "none", "--precision", "bf16-mixed", "--micro-batch", "4", "--lora", "true"]
        ns.steps, ns.bench_timeout = 3, 190
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    summary = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": device,
        "torch": torch.__version__,
        "args": sys.argv[1:],
        "parts": {},
    }
    parts = {
        "doctor": lambda log: part_doctor(ns, out, log),
        "replay": lambda log: part_replay(ns, out, log),
        "layout": lambda log: part_layout(ns, out, log),
        "bench-lora": lambda log: part_bench(ns, out, log, "bench_lora", ns.lora),
        "bench-full": lambda log: part_bench(ns, out, log, "bench_full", ns.full),
        "bench-chunks": lambda log: part_bench(ns, out, log, "bench_chunks", ns.chunks),
        "bench-offload": lambda log: part_bench(ns, out, log, "bench_offload", ns.offload),
        "bench-in-backward": lambda log: part_bench(ns, out, log, "bench_in_backward", ns.in_backward),
        "bench-lowbit": lambda log: part_bench(ns, out, log, "bench_lowbit", ns.lowbit),
        "bench-qlora": lambda log: part_bench(ns, out, log, "bench_qlora", ns.qlora),
        "bench-optimizer-offload": lambda log: part_bench(ns, out, log, "bench_optimizer_offload", ns.host_optimizer),
        "diag": lambda log: part_diag(ns, out, log),
        "oom": lambda log: part_oom(ns, out, log),
        "exporter": lambda log: part_exporter(ns, out, log),
        "auto": lambda log: part_auto(ns, out, log),
        "on-oom": lambda log: part_on_oom(ns, out, log),
        "restart": lambda log: part_restart(ns, out, log),
        "bench-lora-embeddings": lambda log: part_bench(
            ns, out, log, "bench_lora_embeddings", ns.lora_embeddings, TRAINED
        ),
        "bench-moe": lambda log: part_bench(ns, out, log, "bench_moe", ns.moe, (moe_config(ns),)),
        "bench-moe-qlora": lambda log: part_bench(ns, out, log, "bench_moe_qlora", ns.moe_qlora, (moe_config(ns),)),
        "packing": lambda log: part_script(ns, out, log, "packing", ns.packing, 300),
        "throughput": lambda log: part_script(ns, out, log, "train_throughput", ns.throughput, 300),
    }
    unknown = [name for name in ns.parts.split(",") if name not in parts]
    if unknown:
        ap.error(f"--parts: no part {', '.join(unknown)}; the parts are {', '.join(parts)}")
    out.mkdir(parents=True, exist_ok=True)
    ns.work = Path(tempfile.mkdtemp(prefix="memfit-gpu-check-"))  # outside --out: only summaries travel back
    with open(out / "log.txt", "a") as log:
        for name in ns.parts.split(","):
            start = time.perf_counter()
            try:
                if DEADLINE[0] - start < 30:
                    result = {"status": "skipped", "why": f"--budget-s {ns.budget_s:.0f} spent"}
                else:
                    result = parts[name](log)
            except Exception as e:  # one part's failure must not lose the others' numbers
                log.write(f"part {name} raised {type(e).__name__}: {e}\n")
                result = {"status": "error", "error": f"{type(e).__name__}: {e}"}
            result["wall_s"] = time.perf_counter() - start
            summary["parts"][name] = result
            (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
            (out / "summary.md").write_text(summary_md(summary) + "\n")
            print(f"{name}: {result['status']} in {result['wall_s']:.0f} s", flush=True)
    shutil.rmtree(ns.work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
