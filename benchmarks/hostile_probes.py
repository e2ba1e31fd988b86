"""The hostile-user probes (issue 19's, the twenty-second, twenty-third, twenty-fifth, twenty-sixth,
thirty-third to thirty-eighth sessions'), re-runnable:
each a real ``memfit`` command in a fresh directory, judged by the promise "one clear line, non-zero exit, nothing
half-written" (or, where the input is legitimate, that it works: resume however the path is spelled, train longer,
retry with another port).

    python benchmarks/hostile_probes.py [--only SUBSTRING] [--json PATH]

Prints one row per probe (item, probe, verdict, exit code, the error line) and the count passed. About 5 minutes
on a 2-core VM: most probes start a process that imports torch.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
TINY = [
    "model.source=random:tiny",
    "data.seq_len=64",
    "data.max_documents=2",
    "train.device=cpu",
    "train.max_steps=2",
    "train.eval_every=0",
    "train.eval_batches=1",
]


@dataclass
class Result:
    code: int
    out: str
    err: str


def memfit(*args: str, cwd: Path, timeout: float = 300, env: dict | None = None) -> Result:
    done = subprocess.run(
        [sys.executable, "-m", "memfit.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    return Result(done.returncode, done.stdout, done.stderr)


def one_error_line(r: Result, needle: str, code: int = 2) -> tuple[bool, str]:
    """Exit ``code``, no traceback, exactly one ``memfit: error:`` line on stderr, holding ``needle``."""
    lines = [line for line in r.err.splitlines() if line.startswith("memfit: error:")]
    line = lines[0] if lines else (r.err.strip().splitlines() or [""])[-1]
    ok = r.code == code and "Traceback" not in r.err and len(lines) == 1 and needle in lines[0]
    return ok, line[:300]


def train(tmp: Path, *extra: str, **kw) -> Result:
    return memfit("train", "tiny-cpu", *TINY, f"output.dir={tmp / 'run'}", *extra, cwd=tmp, **kw)


def empty_or_absent(path: Path) -> bool:
    return not path.exists() or (path.is_dir() and not any(path.iterdir()))


PROBES: list[tuple[str, str, Callable[[Path], tuple[bool, str]]]] = []
ITEMS: set[str] = set()


def probe(item: str, name: str):
    def add(fn):
        PROBES.append((item, name, fn))
        return fn

    return add


# -- 1, 2, 11, 12: resume -------------------------------------------------------------------------------------


@probe("1", "resume with the run directory spelled as an absolute path, then after moving it")
def _(tmp):
    first = train(tmp, "train.checkpoint_every=1")
    again = memfit(
        "train", "tiny-cpu", *TINY, "train.max_steps=3", f"output.dir={tmp}/./run", "train.resume=true", cwd=tmp
    )
    os.replace(tmp / "run", tmp / "moved")
    moved = memfit(
        "train", "tiny-cpu", *TINY, "train.max_steps=4", f"output.dir={tmp}/moved", "train.resume=true", cwd=REPO
    )
    ok = first.code == again.code == moved.code == 0 and "resuming from step_0000002" in again.out
    return ok, f"exits {first.code}/{again.code}/{moved.code}"


@probe("2", "latest checkpoint truncated: resume falls back to the older intact one")
def _(tmp):
    train(tmp, "train.checkpoint_every=1", "train.keep_checkpoints=2")
    latest = tmp / "run" / "checkpoints" / "step_0000002" / "trainable.safetensors"
    latest.write_bytes(latest.read_bytes()[:-100])
    r = train(tmp, "train.checkpoint_every=1", "train.keep_checkpoints=2", "train.max_steps=3", "train.resume=true")
    return r.code == 0 and "resuming from step_0000001" in r.out, (r.out.splitlines() or [""])[-1][:200]


@probe("2", "every checkpoint damaged: one line, nothing deleted")
def _(tmp):
    train(tmp, "train.checkpoint_every=1")
    for ckpt in (tmp / "run" / "checkpoints").glob("step_*"):
        (ckpt / "optimizer.pt").write_bytes(b"garbage")
    before = sorted(p.name for p in (tmp / "run" / "checkpoints").iterdir())
    ok, line = one_error_line(train(tmp, "train.checkpoint_every=1", "train.resume=true"), "no checkpoint is intact")
    return ok and sorted(p.name for p in (tmp / "run" / "checkpoints").iterdir()) == before, line


@probe("11", "busy metrics port: refused, nothing written; the retry with port 0 in the same directory runs")
def _(tmp):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        ok, line = one_error_line(train(tmp, f"train.metrics_port={busy.getsockname()[1]}"), "cannot listen")
    ok = ok and empty_or_absent(tmp / "run")
    retry = train(tmp, "train.metrics_port=0")
    return ok and retry.code == 0, line


@probe("11", "a run without checkpoints restarted with a smaller micro-batch at the same global batch")
def _(tmp):
    train(tmp, "train.keep_checkpoints=0")
    r = train(tmp, "train.keep_checkpoints=0", "train.micro_batch_size=2", "train.grad_accum_steps=2")
    return r.code == 0 and "changed since this run last started" in r.out, f"exit {r.code}"


@probe("11", "resume with the global batch split differently")
def _(tmp):
    train(tmp, "train.checkpoint_every=1")
    r = train(tmp, "train.micro_batch_size=2", "train.grad_accum_steps=2", "train.max_steps=3", "train.resume=true")
    return r.code == 0 and "changed on resume: train.micro_batch_size" in r.out, f"exit {r.code}"


@probe("11", "resume with another seed: refused with the one-line diff")
def _(tmp):
    train(tmp)
    return one_error_line(train(tmp, "train.seed=7", "train.resume=true"), "holds a different run (train.seed")


@probe("12", "a finished run trained longer")
def _(tmp):
    train(tmp)
    r = train(tmp, "train.max_steps=4", "train.resume=true")
    return r.code == 0 and "changed on resume: train.max_steps: 2 there, 4 here" in r.out, f"exit {r.code}"


# -- 3 to 10: bad input ---------------------------------------------------------------------------------------


@probe("3", "optimizer.lr=inf")
def _(tmp):
    return one_error_line(train(tmp, "optimizer.lr=inf"), "optimizer.lr must be")


@probe("3", "optimizer.lr=1e30: the run goes non-finite; stopped, no export")
def _(tmp):
    ok, line = one_error_line(train(tmp, "optimizer.lr=1e30", "optimizer.warmup_steps=0"), "the loss is")
    return ok and not (tmp / "run" / "export").exists(), line


@probe("4", "plan --seq-len 0")
def _(tmp):
    return one_error_line(memfit("plan", "--model", "tiny", "--gpu", "mi210", "--seq-len", "0", cwd=tmp), "--seq-len")


for _args, _needle in [
    (("--precision", "fp8"), "--precision must be one of"),
    (("--steps", "0"), "--steps must be >= 1"),
    (("--micro-batch", "0"), "--micro-batch must be > 0"),
    (("--ac", ","), "--ac needs at least one value"),
]:

    @probe("5", f"bench {' '.join(_args)}")
    def _(tmp, _args=_args, _needle=_needle):
        ok, line = one_error_line(memfit("bench", "tiny-cpu", *_args, "--out", str(tmp / "b"), cwd=tmp), _needle)
        return ok and not (tmp / "b").exists(), line


@contextlib.contextmanager
def tmpfs(path: Path, options: str):
    """A tmpfs mounted at ``path`` with ``options`` (None where this machine cannot mount one), lazily unmounted."""
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True).returncode:
        yield None
        return
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)])


@probe("6", "disk full while checkpointing (a 256 KiB tmpfs)")
def _(tmp):
    with tmpfs(tmp / "disk", "size=256k") as disk:
        if disk is None:
            return True, "skipped: cannot mount a tmpfs here"
        r = memfit("train", "tiny-cpu", *TINY, f"output.dir={disk}/run", "train.checkpoint_every=1", cwd=tmp)
        ok, line = one_error_line(r, "no space left")
        return ok and empty_or_absent(disk / "run" / "checkpoints"), line


for _where in ("file", "/proc", "/sys"):

    @probe("7", f"output.dir that cannot be created ({_where})")
    def _(tmp, _where=_where):
        if _where == "file":
            (tmp / "f").write_text("x")
            target = tmp / "f" / "run"
        else:
            target = Path(_where) / "memfit-probe"
        r = memfit("train", "tiny-cpu", *TINY, f"output.dir={target}", cwd=tmp)
        return one_error_line(r, "cannot be created")


@probe("7", "output.dir on a read-only mount")
def _(tmp):
    with tmpfs(tmp / "ro", "ro,size=1m") as ro:
        if ro is None:
            return True, "skipped: cannot mount a tmpfs here"
        return one_error_line(memfit("train", "tiny-cpu", *TINY, f"output.dir={ro}/run", cwd=tmp), "cannot be created")


def _tiny_checkpoint(tmp: Path) -> Path:
    code = (
        "import sys, torch; from transformers import AutoTokenizer; "
        "from memfit.models.load import ModelSource, build_model, embedded_checkpoint_dir; "
        "m = build_model(ModelSource('preset', preset='tiny'), None, torch.float32, 0); "
        "m.save_pretrained(sys.argv[1]); "
        "AutoTokenizer.from_pretrained(embedded_checkpoint_dir()).save_pretrained(sys.argv[1])"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp / "model")], check=True, capture_output=True)
    return tmp / "model"


for _damage in ("truncated weights", "garbage weights", "garbage config.json"):

    @probe("8", f"model directory with {_damage}")
    def _(tmp, _damage=_damage):
        model = _tiny_checkpoint(tmp)
        weights = model / "model.safetensors"
        if _damage == "truncated weights":
            weights.write_bytes(weights.read_bytes()[:-1000])
        elif _damage == "garbage weights":
            weights.write_bytes(b"\xff" * 4096)
        else:
            (model / "config.json").write_text("{nope")
        r = memfit("train", "tiny-cpu", *TINY, f"model.source={model}", f"output.dir={tmp / 'run'}", cwd=tmp)
        return one_error_line(r, "model.source:")


for _snapshot, _needle in [
    ({"segments": [None]}, "segments[0] is None"),
    ({"segments": [{"address": 0, "total_size": 8, "blocks": None}]}, "segments[0].blocks is None"),
    ({"segments": [], "device_traces": [["alloc"]]}, "device_traces[0][0] is str"),
    ({"segments": [], "device_traces": [[{"action": "alloc", "size": 1.5, "addr": 0}]]}, "size is float"),
]:

    @probe("9", f"frag on a snapshot whose {_needle.split(' is ')[0]} is wrong")
    def _(tmp, _snapshot=_snapshot, _needle=_needle):
        path = tmp / "s.pickle"
        path.write_bytes(pickle.dumps(_snapshot))
        return one_error_line(memfit("frag", str(path), "--out", str(tmp / "o"), cwd=tmp), _needle)


@probe("10", "chat .jsonl that is not UTF-8")
def _(tmp):
    (tmp / "d.jsonl").write_bytes(b'{"prompt": "a", "response": "b"}\n{"prompt": "\xff", "response": "c"}\n')
    return one_error_line(train(tmp, f"data.source={tmp / 'd.jsonl'}"), "not UTF-8 text")


@probe("10", "binary file with a .txt suffix")
def _(tmp):
    (tmp / "d.txt").write_bytes(bytes(range(256)) * 64)
    return one_error_line(train(tmp, f"data.source={tmp / 'd.txt'}"), "is binary, not text")


@probe("10", "plan --deepspeed with a non-UTF-8 JSON")
def _(tmp):
    (tmp / "ds.json").write_bytes(b'{"note": "\xe9"}')
    r = memfit("plan", "--model", "tiny", "--gpu", "mi210", "--deepspeed", str(tmp / "ds.json"), cwd=tmp)
    return one_error_line(r, "not UTF-8 text")


# -- 13 to 17 ---------------------------------------------------------------------------------------------------


@probe("13", "200 concurrent scrapes of the trainer's endpoint")
def _(tmp):
    code = (
        "import threading, urllib.request; from concurrent.futures import ThreadPoolExecutor; "
        "from memfit.telemetry.prometheus import TrainerMetrics; m = TrainerMetrics(); port = m.serve(0); "
        "b = threading.Barrier(200); "
        "f = lambda _: (b.wait(), urllib.request.urlopen(f'http://127.0.0.1:{port}/metrics', timeout=10).read())[1]; "
        "print(sum(1 for x in ThreadPoolExecutor(200).map(f, range(200)) if b'memfit_step' in x))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return done.stdout.strip() == "200", f"{done.stdout.strip() or done.stderr[-200:]} of 200 answered"


@probe("14", "YAML alias bomb in a config value")
def _(tmp):
    bomb = ["a: &a [x, x, x, x, x, x, x, x, x]"] + [
        f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]"
        for i in range(8)
    ]
    (tmp / "bomb.yaml").write_text("\n".join(bomb) + "\ntrain:\n  device: *i\n")
    r = memfit("train", str(tmp / "bomb.yaml"), cwd=tmp)
    return r.code == 2 and "Traceback" not in r.err and len(r.err) < 2500, f"{len(r.err)} characters on stderr"


@probe("15", "exporter --port 70000")
def _(tmp):
    return one_error_line(memfit("exporter", "--port", "70000", cwd=tmp), "--port must be in 0..65535")


@probe("16", "SIGTERM mid-run with checkpoint_every=0: final checkpoint, one line, exit 143, resume continues")
def _(tmp):
    cmd = [sys.executable, "-m", "memfit.cli", "train", "tiny-cpu", *TINY, "train.max_steps=100000"]
    cmd.append(f"output.dir={tmp / 'run'}")
    proc = subprocess.Popen(cmd, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    metrics = tmp / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not (metrics.is_file() and '"kind": "step"' in metrics.read_text()):
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    result = Result(proc.returncode, "", err.decode())
    ok, line = one_error_line(result, "checkpoint", code=128 + signal.SIGTERM)
    return ok and any((tmp / "run" / "checkpoints").glob("step_*")), line


@probe("17", "a key given twice in a config file")
def _(tmp):
    (tmp / "twice.yaml").write_text("train:\n  max_steps: 2\n  max_steps: 3\n")
    return one_error_line(memfit("train", str(tmp / "twice.yaml"), cwd=tmp), "given twice")


@probe("17", "a missing distributed.deepspeed_config in a one-process run")
def _(tmp):
    return one_error_line(train(tmp, f"distributed.deepspeed_config={tmp / 'none.json'}"), "does not exist")


@probe("17", "train.resume=true with nothing to resume: said, then trained")
def _(tmp):
    r = train(tmp, "train.resume=true")
    return r.code == 0 and "holds no checkpoint yet" in r.out, f"exit {r.code}"


# -- 18, 19: doctor and the what-if replay --------------------------------------------------------------------


@probe("18/19", "frag --simulate for ROCm 7.2 and PyTorch 2.13: max_split_size_mb with expandable is never advised")
def _(tmp):
    sys.path.insert(0, str(REPO / "tests"))
    from support.snapshots import sawtooth

    (tmp / "s.pickle").write_bytes(pickle.dumps(sawtooth()))
    r = memfit(
        "frag", str(tmp / "s.pickle"), "--out", str(tmp / "o"), "--simulate", "--json", "--hip-version", "7.2.1",
        "--torch-version", "2.13.0", cwd=tmp,
    )  # fmt: skip
    sim = json.loads(r.out)["simulate"] if r.code == 0 else {}
    row = next((s for s in sim.get("settings", []) if s["label"] == "expandable_segments:True,max_split_size_mb:512"))
    ok = "pytorch #123548" in (row.get("not_here") or "") and sim["recommended"] != row["label"]
    return ok, f"recommended {sim.get('recommended')}"


# -- 22: the twenty-second session's probes (plan and train inputs, DeepSpeed JSON shapes, ranks, resume) --------

LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 100}

for _config, _needle in [
    ({"num_attention_heads": 3}, "config.json"),
    ({"num_attention_heads": 4, "hidden_size": -64}, "has hidden_size -64"),
    ({"num_attention_heads": 4, "num_key_value_heads": 3}, "not a multiple of its 3 key/value heads"),
]:

    @probe("22", f"plan and train on a config.json with {json.dumps(_config)}")
    def _(tmp, _config=_config, _needle=_needle):
        (tmp / "config.json").write_text(json.dumps(LLAMA | _config))
        plan = memfit("plan", "--model", str(tmp / "config.json"), "--gpu", "h100", "--seq-len", "64", cwd=tmp)
        ok, line = one_error_line(plan, _needle)
        ok2, _ = one_error_line(train(tmp, f"model.source=random:{tmp / 'config.json'}"), _needle)
        return ok and ok2 and empty_or_absent(tmp / "run"), line


for _ds, _needle in [
    ({"zero_optimization": "x"}, "zero_optimization must be a JSON object"),
    ({"bf16": True}, "bf16 must be a JSON object"),
    ({"gradient_accumulation_steps": "x"}, "gradient_accumulation_steps must be a whole number"),
]:

    @probe("22", f"plan --deepspeed, and train on 2 ranks, with {json.dumps(_ds)}")
    def _(tmp, _ds=_ds, _needle=_needle):
        (tmp / "ds.json").write_text(json.dumps(_ds))
        ok, line = one_error_line(
            memfit("plan", "--model", "tiny", "--gpu", "h100", "--deepspeed", "ds.json", cwd=tmp), _needle
        )
        ranks = train(
            tmp, "distributed.engine=deepspeed", "distributed.deepspeed_config=ds.json", "--nproc-per-node", "2"
        )
        ok2, _ = one_error_line(ranks, _needle)  # once, by the launcher, not once per rank
        return ok and ok2, line


for _args, _needle in [
    (("--gpu-mem", "0"), "--gpu-mem must be more than 0 bytes"),
    (("--gpu", "h100", "--write-config", "no/such/dir/run.yaml"), "its directory 'no/such/dir' does not exist"),
    (("--gpu", "h100", "--html", "."), "is a directory"),
    (("--gpu", "h100", "--explain", "0"), "--explain must be a row of the table"),
    (("--gpu", "h100", "--torch-version", "banana"), "--torch-version must look like"),
    (("--device", "cpu", "--precision", "fp16-mixed"), "a CPU run has no fp16 loss scaling"),
]:

    @probe("22", f"plan {' '.join(_args)}")
    def _(tmp, _args=_args, _needle=_needle):
        return one_error_line(memfit("plan", "--model", "tiny", "--seq-len", "64", *_args, cwd=tmp), _needle)


@probe("22", "plan --json --explain 1: stdout is JSON alone")
def _(tmp):
    r = memfit("plan", "--model", "tiny", "--seq-len", "64", "--gpu", "h100", "--json", "--explain", "1", cwd=tmp)
    try:
        json.loads(r.out)
    except ValueError as e:
        return False, f"stdout is not JSON: {e}"
    return r.code == 0 and "per phase peak" in r.err, "JSON on stdout, the explanation on stderr"


for _env, _needle in [({"MEMFIT_PLAN_WORKERS": "two", "MEMFIT_PLAN_CACHE": "off"}, "MEMFIT_PLAN_WORKERS must be")]:

    @probe("22", f"plan with {_env}")
    def _(tmp, _env=_env, _needle=_needle):
        return one_error_line(
            memfit("plan", "--model", "tiny", "--seq-len", "64", "--gpu", "h100", cwd=tmp, env=_env), _needle
        )


for _extra, _needle in [
    (("train.seed=99999999999999999999",), "train.seed must be in 0..4294967295"),
    (("output.dir=",), "output.dir is empty"),
    (("data.source=/dev/null",), "is not a regular file"),
    (("--nproc-per-node", "0"), "--nproc-per-node must be >= 1"),
    (("--nproc-per-node", "2", "optimizer.in_backward=true", "optimizer.grad_clip=0"), "on 2 ranks"),
    (("train.metrics_host=192.0.2.1", "train.metrics_port=0"), "train.metrics_host 192.0.2.1: not an address"),
]:

    @probe("22", f"train {' '.join(_extra)}")
    def _(tmp, _extra=_extra, _needle=_needle):
        return one_error_line(train(tmp, *_extra), _needle)


@probe("22", "overrides after an option, and train.eval_batches=0 runs no evaluation")
def _(tmp):
    r = memfit("train", "tiny-cpu", "--print-config", "train.eval_batches=0", cwd=tmp)
    run = train(tmp, "train.eval_batches=0")
    evals = (tmp / "run" / "metrics.jsonl").read_text().count('"kind": "eval"') if run.code == 0 else -1
    return r.code == 0 and "eval_batches: 0" in r.out and evals == 0, f"exit {run.code}, {evals} eval records"


@probe("22", "resume past train.max_steps, and a finished run started again without train.resume")
def _(tmp):
    train(tmp, "train.checkpoint_every=1")
    ok, line = one_error_line(train(tmp, "train.max_steps=1", "train.resume=true"), "past train.max_steps 1")
    ok2, line2 = one_error_line(train(tmp, "train.max_steps=3"), "pass train.resume=true to continue it")
    return ok and ok2, f"{line} / {line2}"


@probe("22", "resume with the memory levers changed (loss chunks, activation offload, optimizer kernels)")
def _(tmp):
    train(tmp, "train.checkpoint_every=1")
    levers = ("strategy.loss_chunks=2", "strategy.activation_offload=true", "optimizer.implementation=for-loop")
    r = train(tmp, "train.max_steps=3", "train.resume=true", *levers)
    return r.code == 0 and "changed on resume: optimizer.implementation" in r.out, f"exit {r.code}"


@probe("22", "two starts into one output.dir at once: one trains, the other is one line")
def _(tmp):
    args = [
        sys.executable,
        "-m",
        "memfit.cli",
        "train",
        "tiny-cpu",
        *TINY,
        "train.max_steps=20",
        f"output.dir={tmp}/run",
    ]
    runs = [subprocess.Popen(args, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in "ab"]
    done = [Result(p.wait(timeout=600), p.stdout.read(), p.stderr.read()) for p in runs]
    codes = sorted(r.code for r in done)
    loser = next((r for r in done if r.code), Result(0, "", ""))
    ok, line = one_error_line(loser, "is in use by another memfit run")
    return codes == [0, 2] and ok, line


# -- 23: the twenty-third session's probes (snapshots, empty paths, bench axes, launch flags, step numbers) ---------

SNAPSHOTS = {  # (segment total_size, its blocks as (address, size, state)) -> the one line expected
    (-4096, ((0, -4096, "inactive"),)): "segments[0].total_size is -4096, not a byte count >= 0",
    (4096, ((0, 4096, "freed"),)): "blocks[0].state is 'freed', not one of active_allocated",
    (4096, ((0, 4096, "active_allocated"), (0, 4096, "inactive"))): "its blocks add up to 8,192 bytes",
}
for (_total, _blocks), _needle in SNAPSHOTS.items():

    @probe("23", f"frag and report on a snapshot segment of {_total} bytes with blocks {_blocks}")
    def _(tmp, _total=_total, _blocks=_blocks, _needle=_needle):
        rows = [{"address": a, "size": n, "state": state} for a, n, state in _blocks]
        (tmp / "s.pickle").write_bytes(
            pickle.dumps({"segments": [{"address": 0, "total_size": _total, "blocks": rows}]})
        )
        ok, line = one_error_line(memfit("frag", "s.pickle", cwd=tmp), _needle)
        ok2, _ = one_error_line(memfit("report", "s.pickle", cwd=tmp), _needle)
        return ok and ok2 and not (tmp / "s.pickle.frag").exists() and not (tmp / "s.pickle.html").exists(), line


for _args, _needle in [
    (("frag", "s.pickle", "--top", "-3"), "--top must be >= 0 (got -3)"),
    (("frag", ""), "the snapshot path is empty"),
    (("report", ""), "memfit report needs a path, not an empty one"),
    (("report", ".", "--out", ""), "--out is empty"),
    (("plan", "--model", "tiny", "--gpu", "h100", "--lora", "--lora-rank", "0"), "--lora-rank must be >= 1 (got 0)"),
    (("plan", "--model", "tiny", "--gpu", "h100", "--write-config", ""), "--write-config is empty"),
    (("plan", "--model", "", "--gpu", "h100"), "--model is empty"),
    (("plan", "--model", "tiny", "--gpu-mem", "10MiB", "--seq-len", "64"), "nothing fits on custom-10MiB"),
    (("bench", "tiny-cpu", "--out", ""), "--out is empty"),
    (("bench", "tiny-cpu", "--zero", "5"), "--zero must be comma-separated stages 0-3 or none (got '5')"),
]:

    @probe("23", " ".join(_args))
    def _(tmp, _args=_args, _needle=_needle):
        (tmp / "s.pickle").write_bytes(pickle.dumps({"segments": []}))
        return one_error_line(memfit(*_args, cwd=tmp), _needle)


for _extra, _needle in [
    (("--node-rank", "-1"), "--node-rank must be in 0..0 (got -1)"),
    (("--nproc-per-node", "2", "--rdzv-endpoint", "127.0.0.1:99999"), "with a port in 1..65535"),
    (("train.profile_step=0",), "train.profile_step must be a step >= 1"),
    (("train.snapshot_at_step=-2",), "train.snapshot_at_step must be a step >= 1"),
    (("data.source=few.jsonl", "train.micro_batch_size=4"), "larger than the 1 training rows"),
]:

    @probe("23", f"train {' '.join(_extra)}: one line, no run directory")
    def _(tmp, _extra=_extra, _needle=_needle):
        (tmp / "few.jsonl").write_text('{"prompt": "q", "response": "a"}\n' * 3)
        ok, line = one_error_line(train(tmp, *_extra), _needle)
        return ok and empty_or_absent(tmp / "run"), line


@probe("23", "bench --micro-batch 2,2 runs one cell")
def _(tmp):
    args = ("--ac", "none", "--lora", "true", "--micro-batch", "2,2", "--steps", "1", "--warmup", "0", "--out", "b")
    r = memfit("bench", "tiny-cpu", *args, "--set", *TINY[1:3], cwd=tmp)
    cells = json.loads((tmp / "b" / "results.json").read_text()) if r.code == 0 else []
    return r.code == 0 and len(cells) == 1, f"exit {r.code}, {len(cells)} cell(s)"


PLAN = ("plan", "--model", "llama2-7b", "--gpu", "a100-80g", "--top", "1")
for _args, _needle in [
    (("--optimizer-offload", "true", "--nodes", "2", "--gpus-per-node", "8", "--zero", "0"), "got ddp (16 GPUs"),
    (("--activation-offload", "true", "--engine", "deepspeed", "--gpus-per-node", "2"), "not reach into DeepSpeed"),
    (("--optimizer-in-backward", "true", "--precision", "fp16-mixed"), "fp16-mixed's GradScaler"),
]:

    @probe("25", f"plan {' '.join(_args)}: pins that leave nothing to plan")
    def _(tmp, _args=_args, _needle=_needle):
        ok, line = one_error_line(memfit(*PLAN, *_args, cwd=tmp), "nothing to plan: ")
        return ok and _needle in line, line


for _args, _needle in [
    (("--quantize-base", "nf4", "--lora", "false"), "--quantize-base nf4 quantizes a LoRA run's frozen base"),
    (("--optimizer-offload", "true", "--zero", "1"), "optimizer.offload (the optimizer state and step on the host)"),
    (("--optimizer-name", "adamw8bit", "--zero", "2"), "runs on one process or DDP without ZeRO"),
]:

    @probe("25", f"bench {' '.join(_args)}: one line, no --out directory")
    def _(tmp, _args=_args, _needle=_needle):
        ok, line = one_error_line(memfit("bench", "tiny-cpu", *_args, "--out", "b", cwd=tmp), _needle)
        return ok and line.startswith("memfit: error: no bench cell can run") and not (tmp / "b").exists(), line


@probe("25", "plan --lora --quantize-base nf4 --gpus-per-node 2: an NF4 base on DDP is planned (ZeRO-0)")
def _(tmp):
    r = memfit(*PLAN, "--lora", "--quantize-base", "nf4", "--gpus-per-node", "2", "--json", cwd=tmp)
    rows = json.loads(r.out.strip().splitlines()[-1])["fitting"] if r.code == 0 else []
    ok = bool(rows) and all(x["zero_stage"] == 0 and x["quantize_base"] == "nf4" for x in rows)
    return ok, f"exit {r.code}, {len(rows)} fitting row(s)" + (f": {r.err.strip().splitlines()[-1]}" if r.code else "")


# -- 26: the twenty-sixth session's round ----------------------------------------------------------------------


def _chat_file(tmp: Path, prompt_words: int, n: int = 10) -> Path:
    path = tmp / "chat.jsonl"
    record = json.dumps({"prompt": "x " * prompt_words, "response": "y " * 5})
    path.write_text((record + "\n") * n)
    return path


@probe("26", "chat records whose prompts fill data.seq_len: one line, no run directory (trained on a loss of 0)")
def _(tmp):
    r = train(tmp, f"data.source={_chat_file(tmp, 500)}", "data.max_documents=null")
    ok, line = one_error_line(r, "hold no token that takes a loss: every answer lies past data.seq_len")
    return ok and empty_or_absent(tmp / "run"), line


@probe("26", "resume with optimizer.offload turned on: resumes, the change said")
def _(tmp):
    train(tmp, "train.checkpoint_every=1")
    r = train(tmp, "optimizer.offload=true", "train.max_steps=3", "train.resume=true")
    return r.code == 0 and "changed on resume: optimizer.offload" in r.out, f"exit {r.code}: {r.err[-200:]}"


for _args, _needle in [
    (("--packing", "true"), "data.packing packs chat/instruction records"),
    (("--set", "data.source=no/such.jsonl"), "data.source: 'no/such.jsonl' does not exist"),
]:

    @probe("26", f"bench {' '.join(_args)}: one line before --out (the cell ran and failed)")
    def _(tmp, _args=_args, _needle=_needle):
        r = memfit("bench", "tiny-cpu", "--ac", "none", "--lora", "true", *_args, "--out", "b", cwd=tmp)
        ok, line = one_error_line(r, _needle)
        return ok and not (tmp / "b").exists(), line


@probe("26", "a second bench into an --out in use: one line (both ran one mixed table)")
def _(tmp):
    args = ("bench", "tiny-cpu", "--ac", "none,full", "--lora", "true", "--steps", "1", "--warmup", "0", "--out", "b")
    first = subprocess.Popen(
        [sys.executable, "-m", "memfit.cli", *args], cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.time() + 120
        while not (tmp / "b" / ".memfit.lock").exists() and first.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        ok, line = one_error_line(memfit(*args, cwd=tmp), "is in use by another memfit bench")
    finally:
        first.wait(timeout=600)
    return ok and first.returncode == 0, line


@probe("26", "plan --host-mem 1KiB --optimizer-offload true: the room is said as given, not as 0.00 GiB")
def _(tmp):
    r = memfit(
        "plan",
        "--model",
        "llama2-7b",
        "--gpu",
        "a100-80g",
        "--host-mem",
        "1KiB",
        "--optimizer-offload",
        "true",
        cwd=tmp,
    )
    ok, line = one_error_line(r, "> 1,024 bytes (--host-mem)")
    return ok, line


@probe("26", "exporter --host '' and train.metrics_host= : named as empty")
def _(tmp):
    ok1, line = one_error_line(memfit("exporter", "--host", "", cwd=tmp), "--host is empty")
    ok2, _ = one_error_line(train(tmp, "train.metrics_host=", "train.metrics_port=0"), "train.metrics_host is empty")
    return ok1 and ok2, line


@probe("26", "MEMFIT_PLAN_CACHE naming a file: said once, the plan still answers")
def _(tmp):
    (tmp / "afile").write_text("x")
    r = memfit(
        "plan",
        "--model",
        "tiny",
        "--gpu",
        "mi210",
        "--seq-len",
        "64",
        cwd=tmp,
        env={"MEMFIT_PLAN_CACHE": str(tmp / "afile")},
    )
    said = [ln for ln in r.err.splitlines() if "cannot be written" in ln]
    return r.code == 0 and len(said) == 1, (said or [f"exit {r.code}"])[0][:200]


for _cmd, _args, _needle in [
    ("frag", ("--capacity", "0"), "--capacity 0: only --simulate reads this"),
    (
        "plan",
        ("--model", "tiny", "--gpu", "mi210", "--seq-len", "64", "--hip-version", "6.2"),
        "--hip-version 6.2: only",
    ),
]:

    @probe("26", f"{_cmd} {' '.join(_args)} without --simulate: one line (ignored in silence)")
    def _(tmp, _cmd=_cmd, _args=_args, _needle=_needle):
        target = (str(REPO / "tests" / "fixtures" / "h200-llama2-7b-lora-ffn-bf16pure-step3.pickle.gz"), "--out", "o")
        r = memfit(_cmd, *(target if _cmd == "frag" else ()), *_args, cwd=tmp)
        ok, line = one_error_line(r, _needle)
        return ok and not (tmp / "o").exists(), line


@probe("26", "SIGTERM to a 2-rank launcher: one line, exit 143, the job resumes (a torchrun traceback, exit 1)")
def _(tmp):
    cmd = [sys.executable, "-m", "memfit.cli", "train", "tiny-cpu", *TINY, "train.max_steps=100000"]
    cmd += [f"output.dir={tmp / 'run'}", "--nproc-per-node", "2"]
    job = subprocess.Popen(cmd, cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = tmp / "run" / "metrics.jsonl"
    deadline = time.time() + 180
    while job.poll() is None and time.time() < deadline:
        if metrics.is_file() and metrics.read_text().count('"kind": "step"') >= 2:
            break
        time.sleep(0.2)
    job.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=120)
    ok, line = one_error_line(Result(job.returncode, "", err), "interrupted by SIGTERM after step", code=143)
    step = int(line.split("after step ")[1].split()[0]) if ok else 0
    more = train(tmp, f"train.max_steps={step + 1}", "train.resume=true", "--nproc-per-node", "2")
    return ok and more.code == 0 and f"resuming from step_{step:07d}" in more.out, line


@probe("26", "a checkpoint directory whose weights are other tensors: one line (trained from random weights)")
def _(tmp):
    import torch
    from safetensors.torch import save_file

    from memfit.models.presets import preset_config

    model = tmp / "model"
    model.mkdir()
    preset_config("tiny").save_pretrained(model)
    save_file({"x": torch.zeros(1)}, model / "model.safetensors")
    cache = Path(os.environ.get("MEMFIT_CACHE") or Path.home() / ".cache" / "memfit") / "smollm2-135m-instruct"
    for f in cache.glob("tokenizer*"):
        (model / f.name).write_bytes(f.read_bytes())
    ok, line = one_error_line(train(tmp, f"model.source={model}"), "lacks 21 of the weights its config.json describes")
    return ok and empty_or_absent(tmp / "run"), line


for _overrides, _needle in [
    (("model.source=random:/no/such/config.json",), "'/no/such/config.json' does not exist; give random:<preset>"),
    (("strategy.loss_chunks=1000",), "strategy.loss_chunks 1000 is more than data.seq_len 64 positions"),
    (("data.packing=auto",), "data.packing must be true, false or null"),
]:

    @probe("26", f"train {' '.join(_overrides)}: one line that names it")
    def _(tmp, _overrides=_overrides, _needle=_needle):
        ok, line = one_error_line(train(tmp, *_overrides), _needle)
        return ok and empty_or_absent(tmp / "run"), line


@probe("26", "output.dir=~/x in a config file is the home directory (a directory named ~ was made)")
def _(tmp):
    home = tmp / "home"
    home.mkdir()
    (tmp / "c.yaml").write_text("output:\n  dir: ~/x\n")
    r = memfit("train", str(tmp / "c.yaml"), *TINY, cwd=tmp, env={"HOME": str(home)})
    return r.code == 0 and (home / "x" / "config.yaml").is_file() and not (tmp / "~").exists(), f"exit {r.code}"


@probe("26", "a 2-rank DDP run: no FutureWarning from torch (broadcast_buffers)")
def _(tmp):
    r = train(tmp, "distributed.zero_stage=0", "--nproc-per-node", "2")
    return r.code == 0 and "FutureWarning" not in r.err, f"exit {r.code}: {r.err.strip()[-200:]}"


# -- 33: the thirty-third session's round ----------------------------------------------------------------------


def _supervised_share(r: Result) -> float:
    """The share of positions that take a loss, from the run's packing note (-1 where there is none)."""
    words = " ".join(r.out.split())
    at = words.find("% of the positions supervised")
    return float(words[:at].rsplit(" ", 1)[-1]) if at > 0 else -1.0


def _talks(tmp: Path, name: str = "talks.jsonl") -> Path:
    turn = [{"role": "user", "content": "q " * 5}, {"role": "assistant", "content": "a " * 20}]
    path = tmp / name
    path.write_text("\n".join(json.dumps({"messages": turn * 3}) for _ in range(12)) + "\n")
    return path


@probe(
    "33", "multi-turn chat: every assistant message takes the loss (only the last did); data.loss_on=last keeps that"
)
def _(tmp):
    every = train(tmp, f"data.source={_talks(tmp)}", "data.max_documents=null", "data.seq_len=256")
    last = memfit(
        "train",
        "tiny-cpu",
        *TINY,
        f"output.dir={tmp / 'last'}",
        f"data.source={_talks(tmp)}",
        "data.max_documents=null",
        "data.seq_len=256",
        "data.loss_on=last",
        cwd=tmp,
    )
    shares = _supervised_share(every), _supervised_share(last)
    return every.code == last.code == 0 and shares[0] > 2.5 * shares[1] > 0, f"supervised {shares[0]}% / {shares[1]}%"


@probe("33", "ShareGPT conversations and a gzipped .jsonl train (refused as lacking 'messages' / as binary)")
def _(tmp):
    turns = [{"from": "human", "value": "q " * 5}, {"from": "gpt", "value": "a " * 20}]
    (tmp / "sg.jsonl").write_text("\n".join(json.dumps({"conversations": turns}) for _ in range(12)) + "\n")
    gz = tmp / "talks.jsonl.gz"
    gz.write_bytes(gzip.compress(_talks(tmp).read_bytes()))
    codes = [
        train(tmp, f"data.source={src}", "data.max_documents=null", f"output.dir={tmp / ('run-' + src.name)}").code
        for src in (tmp / "sg.jsonl", gz)
    ]
    return codes == [0, 0], f"exits {codes}"


@probe("33", "m.gguf as model.source: named, with the conversion")
def _(tmp):
    (tmp / "m.gguf").write_bytes(b"GGUF" + bytes(64))
    ok, line = one_error_line(train(tmp, f"model.source={tmp / 'm.gguf'}"), "is a GGUF model (llama.cpp's format)")
    return ok and empty_or_absent(tmp / "run"), line


@probe("33", "a Parquet file of records trains on its rows ('binary, not text ... iconv -f latin1')")
def _(tmp):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in _talks(tmp).read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist(rows), tmp / "train.parquet")
    r = train(tmp, f"data.source={tmp / 'train.parquet'}", "data.max_documents=null")
    return r.code == 0 and "packed 12 records" in " ".join(r.out.split()), f"exit {r.code}: {r.err.strip()[-200:]}"


@probe("33", "Hub names as sources: said as such, with the command that fetches them")
def _(tmp):
    ok1, line = one_error_line(train(tmp, "model.source=meta-llama/Llama-2-7b-hf"), "hf download meta-llama")
    ok2, _ = one_error_line(train(tmp, "data.source=tatsu-lab/alpaca"), "datasets.load_dataset('tatsu-lab/alpaca'")
    return ok1 and ok2, line


@probe("33", "config.json with rope_theta -1: one line (trained to a NaN loss blamed on the learning rate)")
def _(tmp):
    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "vocab_size": 1000,
        "rope_theta": -1,
    }
    (tmp / "config.json").write_text(json.dumps(config))
    ok, line = one_error_line(train(tmp, f"model.source=random:{tmp / 'config.json'}"), "has rope_theta -1")
    return ok and empty_or_absent(tmp / "run"), line


@probe("33", "LoRA on the tied output head, and all-linear: trained with the fit check (the planner failed)")
def _(tmp):
    runs = [
        train(tmp, "lora.enabled=true", f"lora.target_modules={t}", f"output.dir={tmp / str(i)}")
        for i, t in enumerate(("[q_proj,lm_head]", "all-linear"))
    ]
    ok = all(r.code == 0 and "planner failed" not in r.out + r.err and "planner: predicted" in r.out for r in runs)
    return ok, f"exits {[r.code for r in runs]}"


@probe("33", "a directory of .jsonl shards trains on their records ('holds no .txt files')")
def _(tmp):
    (tmp / "shards").mkdir()
    for i in range(2):
        os.replace(_talks(tmp), tmp / "shards" / f"train-0000{i}-of-00002.jsonl")
    r = train(tmp, f"data.source={tmp / 'shards'}", "data.max_documents=null")
    return r.code == 0 and "packed 24 records" in " ".join(r.out.split()), f"exit {r.code}: {r.err.strip()[-200:]}"


@probe("33", "plan --top 0: every row (an empty table)")
def _(tmp):
    r = memfit("plan", "--model", "tiny", "--gpu", "h100", "--seq-len", "64", "--top", "0", cwd=tmp)
    rows = sum(line.startswith("│") and line[1:].strip().split(" ")[0].isdigit() for line in r.out.splitlines())
    return r.code == 0 and rows > 10, f"exit {r.code}, {rows} rows"


@probe("34", "/dev/null as the config, the data, a snapshot and a report: 'not a regular file' (said not to exist)")
def _(tmp):
    runs = [
        memfit("train", "/dev/null", cwd=tmp),
        train(tmp, "data.source=/dev/null"),
        memfit("frag", "/dev/null", cwd=tmp),
        memfit("report", "/dev/null", cwd=tmp),
    ]
    checks = [one_error_line(r, "'/dev/null' is not a regular file") for r in runs]
    return all(ok for ok, _ in checks), next((line for ok, line in checks if not ok), checks[0][1])


@probe("34", "a checkpoint with a broken generation_config.json: said, trained, its export's KV cache on (silent; off)")
def _(tmp):
    model = _tiny_checkpoint(tmp)
    (model / "generation_config.json").write_text("{nope")
    r = train(tmp, f"model.source={model}", "output.export=true")
    said = "generation_config.json' is not readable JSON" in r.err
    exported = json.loads((tmp / "run" / "export" / "config.json").read_text()) if r.code == 0 else {}
    ok = r.code == 0 and said and exported.get("use_cache") is True
    return ok, f"exit {r.code}, said {said}, export use_cache {exported.get('use_cache')}"


@probe("34", "{'text': ...} records train as documents (refused as lacking 'messages')")
def _(tmp):
    (tmp / "docs.jsonl").write_text("\n".join(json.dumps({"text": "word " * (20 + i)}) for i in range(12)) + "\n")
    r = train(tmp, f"data.source={tmp / 'docs.jsonl'}", "data.max_documents=null")
    return r.code == 0 and "packed 12 records" in " ".join(r.out.split()), f"exit {r.code}: {r.err.strip()[-200:]}"


@probe("34", "preference pairs (chosen/rejected): named as such (as lacking 'response')")
def _(tmp):
    pair = {"prompt": "q", "chosen": "a", "rejected": "b"}
    (tmp / "dpo.jsonl").write_text("\n".join(json.dumps(pair) for _ in range(4)) + "\n")
    ok, line = one_error_line(
        train(tmp, f"data.source={tmp / 'dpo.jsonl'}"), "a preference pair ('chosen' and 'rejected'"
    )
    return ok and empty_or_absent(tmp / "run"), line


@probe("34", "train --auto --mem above this machine's memory: noted (planned for it without a word)")
def _(tmp):
    r = memfit("train", "tiny-cpu", "--auto", "--mem", "100000GiB", *TINY, f"output.dir={tmp / 'run'}", cwd=tmp)
    return r.code == 0 and "note: --mem 100000GiB is more than this machine's" in r.out, f"exit {r.code}"


def _tool_call_dropped(tmp: Path, question: str) -> tuple[bool, str]:
    """Chat records whose answer calls add_numbers (OpenAI's tool_calls, content null) after ``question``, trained on
    SmolLM2's template, which renders content only: one line naming the call, no run directory."""
    call = {"type": "function", "function": {"name": "add_numbers", "arguments": {"a": 2, "b": 3}}}
    talk = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "5."},
    ]
    (tmp / "tools.jsonl").write_text("\n".join(json.dumps({"messages": talk}) for _ in range(12)) + "\n")
    r = train(tmp, f"data.source={tmp / 'tools.jsonl'}", "data.max_documents=null")
    ok, line = one_error_line(r, "message 2 calls add_numbers, but the model's chat template leaves its tool_calls")
    return ok and empty_or_absent(tmp / "run"), line


@probe(
    "34", "OpenAI tool calls, content null, on a template without tools: one line (refused for null / trained empty)"
)
def _(tmp):
    return _tool_call_dropped(tmp, "2+3?")


# -- 35: the thirty-fifth session's round (architectures beyond Llama) ----------------------------------------

_SMALL = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=49152, max_position_embeddings=512,
)  # fmt: skip
_ARCHS = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)),
    "phi3": ("Phi3Config", dict(pad_token_id=0)),
    "llama": ("LlamaConfig", {}),
}


def _config(tmp: Path, arch: str) -> Path:
    """A small random ``config.json`` of ``arch`` (written by transformers, as a user's would be)."""
    cls, extra = _ARCHS[arch]
    code = f"import sys, transformers as T; T.{cls}(**{_SMALL!r}, **{extra!r}).save_pretrained(sys.argv[1])"
    subprocess.run([sys.executable, "-c", code, str(tmp / arch)], check=True, capture_output=True)
    return tmp / arch / "config.json"


for _arch in ("mixtral", "qwen3_moe"):

    @probe("35", f"plan a {_arch} config.json (a traceback: the grouped matmul's fake kernel refused fp32)")
    def _(tmp, arch=_arch):
        r = memfit("plan", "--model", str(_config(tmp, arch)), "--gpu-mem", "8GiB", "--seq-len", "64", cwd=tmp)
        return r.code == 0 and "Traceback" not in r.err and "candidates fit" in r.out, f"exit {r.code}"


@probe("35", "train a mixtral config.json: the fit check runs (the planner failed, a traceback logged)")
def _(tmp):
    r = train(tmp, f"model.source=random:{_config(tmp, 'mixtral')}")
    ok = r.code == 0 and "planner: predicted step peak" in r.out and "planner failed" not in r.out
    return ok and "Traceback" not in r.err, f"exit {r.code}"


@probe("35", "LoRA on a Phi-3 and a mixtral with the default targets (refused: no module q_proj / gate_proj)")
def _(tmp):
    archs = ("phi3", "mixtral")
    runs = [
        train(tmp, f"model.source=random:{_config(tmp, a)}", "lora.enabled=true", f"output.dir={tmp / a}-run")
        for a in archs
    ]
    return all(r.code == 0 for r in runs), f"exits {[r.code for r in runs]}"


@probe("35", "LoRA on a mixtral's expert weights (lora.target_parameters): trained, exported; a bad name one line")
def _(tmp):
    model = f"model.source=random:{_config(tmp, 'mixtral')}"
    experts = "lora.target_parameters=experts.gate_up_proj,experts.down_proj"
    r = train(tmp, model, "lora.enabled=true", experts, "output.export=true")
    exported = tmp / "run" / "export" / "adapter_config.json"
    adapted = json.loads(exported.read_text()).get("target_parameters") if exported.is_file() else None
    bad = train(tmp, model, "lora.enabled=true", "lora.target_parameters=gate_upp", f"output.dir={tmp / 'bad'}")
    ok, line = one_error_line(bad, "'gate_upp' is no weight of this model")
    adapted = set(adapted or ())  # PEFT keeps them as a set: its order is the process's string hashing
    return r.code == 0 and adapted == {"experts.gate_up_proj", "experts.down_proj"} and ok, line


@probe("35", "a tool call named in the user's text, on a template that drops calls: one line (trained as empty)")
def _(tmp):
    return _tool_call_dropped(tmp, "Use add_numbers: 2+3?")


# -- 36: the thirty-sixth session's round (files nested past the parsers' recursion) ---------------------------

_DEEP = "[" * 100_000  # a hostile or broken file: json and PyYAML recurse once a bracket


@probe("36", "a JSON or YAML file nested 100,000 deep (config, data, config.json, DeepSpeed JSON, report): one line")
def _(tmp):
    (tmp / "deep.yaml").write_text("model:\n  source: " + _DEEP + "\n")
    (tmp / "deep.jsonl").write_text(_DEEP + "\n")
    (tmp / "deep.json").write_text(_DEEP)
    (tmp / "ckpt").mkdir()
    (tmp / "ckpt" / "config.json").write_text(_DEEP)
    runs = [
        memfit("train", "deep.yaml", cwd=tmp),
        train(tmp, f"data.source={tmp / 'deep.jsonl'}"),
        memfit("plan", "--model", "ckpt", "--gpu", "h100", cwd=tmp),
        memfit("plan", "--model", "tiny", "--gpu", "h100", "--deepspeed", "deep.json", cwd=tmp),
        memfit("report", "deep.json", cwd=tmp),
    ]
    said = [one_error_line(r, "nested too deeply to read") for r in runs]
    bad = [line for ok, line in said if not ok]
    return not bad and empty_or_absent(tmp / "run"), (bad or [said[-1][1]])[0]


@probe("36", "a model whose chat template is no Jinja (broken; nested 5,000 deep): one line naming the model's")
def _(tmp):
    model = _tiny_checkpoint(tmp)
    (tmp / "chat.jsonl").write_text((json.dumps({"prompt": "a", "response": "b"}) + "\n") * 4)
    said = []
    for template in ("{% if %}", "{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}"):
        (model / "chat_template.jinja").write_text(template)
        r = train(tmp, f"model.source={model}", f"data.source={tmp / 'chat.jsonl'}", "data.max_documents=null")
        said.append(one_error_line(r, "model.source: the model's chat template is not a usable Jinja"))
    bad = [line for ok, line in said if not ok]
    return not bad and empty_or_absent(tmp / "run"), (bad or [said[-1][1]])[0]


@probe("36", "LoRA on a mixtral's expert weights on 2 ranks, FSDP2 ZeRO-3 and DeepSpeed ZeRO-2: trained, exported")
def _(tmp):
    (tmp / "ds.json").write_text('{"zero_optimization": {"stage": 2}}')
    lora = ["lora.enabled=true", "lora.target_parameters=experts.gate_up_proj,experts.down_proj", "output.export=true"]
    engines = {
        "fsdp2": ["distributed.zero_stage=3"],
        "deepspeed": ["distributed.engine=deepspeed", f"distributed.deepspeed_config={tmp / 'ds.json'}"],
    }
    model = f"model.source=random:{_config(tmp, 'mixtral')}"
    said = []
    for engine, extra in engines.items():
        r = memfit(
            "train", "tiny-cpu", "--nproc-per-node", "2", *TINY, model, *lora, *extra, f"output.dir={tmp / engine}",
            cwd=tmp, env={"DS_ACCELERATOR": "cpu"},
        )  # fmt: skip
        export = tmp / engine / "export" / "adapter_model.safetensors"
        said.append((r.code == 0 and export.is_file() and b"experts.base_layer.lora_A" in export.read_bytes(), r))
    bad = [f"exit {r.code}: {(r.err.strip().splitlines() or [''])[-1]}" for ok, r in said if not ok]
    return not bad, (bad or ["both trained and exported the experts' adapters"])[0][:300]


@probe("36", "plan --lora-rank 100000 on a 7B, train lora.rank=65 on tiny: one line (traced a minute, then 'no fit')")
def _(tmp):
    plan = memfit("plan", "--model", "llama2-7b", "--gpu", "h100", "--lora", "--lora-rank", "100000", cwd=tmp)
    said = [one_error_line(plan, "lora.rank 100000 is above every adapted weight's smaller side (at most 4096")]
    said.append(one_error_line(train(tmp, "lora.enabled=true", "lora.rank=65"), "give lora.rank <= 64"))
    bad = [line for ok, line in said if not ok]
    return not bad and empty_or_absent(tmp / "run"), (bad or [said[0][1]])[0]


@probe("36", "plan --lora where nothing fits: the hint names --lora-rank and --seq-len (it said 'try LoRA')")
def _(tmp):
    r = memfit("plan", "--model", "llama2-70b", "--gpu-mem", "8GiB", "--lora", "--seq-len", "64", cwd=tmp)
    said = r.out + r.err
    ok = r.code != 0 and "Traceback" not in r.err and "--lora-rank" in said and "try LoRA" not in said
    return ok, (said.strip().splitlines() or [""])[-1][:300]


# -- 37: impossible model sizes and routing; QLoRA on a mixture of experts -------------------------------------


@probe("37", "config.json with 0 attention heads, or experts per token 0 / past the experts: one line (tracebacks)")
def _(tmp):
    said = []
    cases = {"heads": ("llama", {"num_attention_heads": 0}, "has num_attention_heads 0; every size must be")}
    cases["past"] = ("mixtral", {"num_experts_per_tok": 9}, "routes each token to num_experts_per_tok 9 of its")
    cases["none"] = ("mixtral", {"num_experts_per_tok": 0}, "routes each token to num_experts_per_tok 0 of its")
    for name, (arch, change, needle) in cases.items():
        config = json.loads(_config(tmp, arch).read_text()) | change
        (tmp / name).mkdir()
        (tmp / name / "config.json").write_text(json.dumps(config))
        said.append(
            one_error_line(memfit("plan", "--model", name, "--gpu", "h100", "--seq-len", "64", cwd=tmp), needle)
        )
        said.append(one_error_line(train(tmp, f"model.source=random:{tmp / name}"), needle))
    bad = [line for ok, line in said if not ok]
    return not bad and empty_or_absent(tmp / "run"), (bad or [said[-1][1]])[0]


@probe("37", "QLoRA on a mixtral: its experts are NF4 (they stayed bf16); trains, resumes to the same losses")
def _(tmp):
    model = f"model.source=random:{_config(tmp, 'mixtral').parent}"
    run = [model, "lora.enabled=true", "lora.quantize_base=nf4", "train.max_steps=4", "train.checkpoint_every=2"]
    first = train(tmp, *run)
    shutil.rmtree(tmp / "run" / "checkpoints" / "step_0000004", ignore_errors=True)
    again = train(tmp, *run, "train.resume=true")

    def losses(r: Result) -> list[str]:  # each step's line: "step 3  loss 10.8  lr ..." (not the eval lines)
        return [line.split()[3] for line in r.out.splitlines() if line.startswith("step") and " lr " in line]

    def params(base: str) -> int | None:  # the smallest parameter bytes a fitting candidate holds
        flags = ["--lora", "--quantize-base", base, "--seq-len", "64", "--json"]
        r = memfit("plan", "--model", str(tmp / "mixtral"), "--gpu", "h100", *flags, cwd=tmp)
        fitting = json.loads(r.out)["fitting"] if r.code == 0 else []
        return min((c["peak_by_category_bytes"]["params"] for c in fitting), default=None)

    params = [params("nf4"), params("none")]
    ok = first.code == again.code == 0 and losses(first)[2:] == losses(again) and None not in params
    experts = 2 * 4 * 3 * 64 * 96 * 2  # bf16 bytes of the experts (layers x experts x 3 projections): NF4 holds ~1/4
    ok = ok and params[1] - params[0] > 0.6 * experts  # attention alone in NF4 saved 36 kB of these 295
    return ok, f"losses {losses(first)} / resumed {losses(again)}; plan params nf4 / bf16: {params} bytes"


@probe("37", "plan a copy of a config.json after the first copy planned was deleted (it read the deleted path)")
def _(tmp):
    env = {"MEMFIT_CONFIG_CACHE": str(tmp / "configs"), "MEMFIT_PLAN_CACHE": "off", "MEMFIT_TRACE_CACHE": "off"}
    first = _config(tmp, "llama").parent
    shutil.copytree(first, tmp / "copy")
    plans = [memfit("plan", "--model", "llama", "--gpu", "h100", "--seq-len", "64", cwd=tmp, env=env)]
    shutil.rmtree(first)
    plans.append(memfit("plan", "--model", "copy", "--gpu", "h100", "--seq-len", "64", cwd=tmp, env=env))
    ok = all(r.code == 0 and "candidates fit" in r.out for r in plans)
    return ok, f"exit {plans[-1].code}: {(plans[-1].err.strip().splitlines() or [''])[-1][:250]}"


# -- 38: chat records as Hub datasets keep them ----------------------------------------------------------------


@probe("38", "'conversations' of roles, 'messages' of ShareGPT speakers or human/gpt roles, 'conversation': trains")
def _(tmp):
    ask, answer = "Who wrote Hamlet?", "Shakespeare."
    shapes = {
        "roles": {"conversations": [{"role": "user", "content": ask}, {"role": "assistant", "content": answer}]},
        "speakers": {"messages": [{"from": "human", "value": ask}, {"from": "gpt", "value": answer}]},
        "aliases": {"messages": [{"role": "human", "content": ask}, {"role": "gpt", "content": answer}]},
        "lmsys": {"conversation": [{"role": "user", "content": ask}, {"role": "assistant", "content": answer}]},
    }
    (tmp / "records").mkdir()
    for name, record in shapes.items():  # a directory of JSON lines files: the records of all of them
        (tmp / "records" / f"{name}.jsonl").write_text((json.dumps(record) + "\n") * 4)
    r = train(tmp, f"data.source={tmp / 'records'}", "data.max_documents=null")
    return r.code == 0, f"exit {r.code}: {(r.err.strip().splitlines() or [''])[-1][:250]}"


@probe("38", "plan a mixtral config.json asking experts_implementation eager: planned, with a note (a traceback)")
def _(tmp):
    config = json.loads(_config(tmp, "mixtral").read_text()) | {"experts_implementation": "eager"}
    (tmp / "loop").mkdir()
    (tmp / "loop" / "config.json").write_text(json.dumps(config))
    r = memfit("plan", "--model", "loop", "--gpu", "h100", "--seq-len", "64", cwd=tmp)
    ok = r.code == 0 and "note: the config asks for experts_implementation 'eager'" in r.out
    return ok, f"exit {r.code}: {(r.err.strip().splitlines() or r.out.strip().splitlines() or [''])[-1][:250]}"


@probe("38", "plan and train a GPT-OSS config.json (no sdpa in transformers): eager attention, said (a traceback)")
def _(tmp):
    config = f"T.GptOssConfig(**{_SMALL!r}, num_local_experts=4, num_experts_per_tok=2)"
    code = f"import transformers as T; {config}.save_pretrained({str(tmp / 'oss')!r})"
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    runs = [memfit("plan", "--model", "oss", "--gpu", "h100", "--seq-len", "64", cwd=tmp)]
    runs.append(train(tmp, f"model.source=random:{tmp / 'oss'}"))
    ok = all(r.code == 0 and "gpt_oss has no sdpa attention" in " ".join(r.out.split()) for r in runs)
    return ok, "; ".join(f"exit {r.code}: {(r.err.strip().splitlines() or [''])[-1][:120]}" for r in runs)


@probe("39", "lora.modules_to_save naming no module, an adapted one, or without LoRA: one line (PEFT trained nothing)")
def _(tmp):
    runs = [
        (train(tmp, "lora.enabled=true", "lora.modules_to_save=[embedding]"), "'embedding' is no module of this model"),
        (train(tmp, "lora.enabled=true", "lora.modules_to_save=[q_proj]"), "'q_proj' gets adapters"),
        (train(tmp, "lora.modules_to_save=[lm_head]"), "set lora.enabled=true or leave lora.modules_to_save empty"),
    ]
    checks = [one_error_line(r, needle) for r, needle in runs]
    ok = all(good for good, _ in checks) and empty_or_absent(tmp / "run")
    return ok, "; ".join(why for _, why in checks)


@probe("39", "lora.trainable_tokens past the vocabulary, a word, one id: one line, or trains (IndexError, refused)")
def _(tmp):
    runs = [
        (train(tmp, "lora.enabled=true", "lora.trainable_tokens=[5, 49152]"), "token id 49152 is past this model's"),
        (train(tmp, "lora.enabled=true", "lora.trainable_tokens=[eos]"), "must be a list of integers"),
    ]
    checks = [one_error_line(r, needle) for r, needle in runs]
    one = train(tmp, "lora.enabled=true", "lora.trainable_tokens=2", "train.max_steps=2")
    ok = all(good for good, _ in checks) and one.code == 0 and "(1 token row trained)" in " ".join(one.out.split())
    return ok, "; ".join([*(why for _, why in checks), f"one id: exit {one.code}"])


@probe("39", "plan --lora-trainable-tokens 1,x and --lora-modules-to-save without --lora: one line each")
def _(tmp):
    a = memfit("plan", "--model", "tiny", "--device", "cpu", "--lora", "--lora-trainable-tokens", "1,x", cwd=tmp)
    b = memfit("plan", "--model", "tiny", "--device", "cpu", "--lora-modules-to-save", "lm_head", cwd=tmp)
    checks = [one_error_line(a, "takes comma-separated token ids"), one_error_line(b, "give --lora too")]
    return all(good for good, _ in checks), "; ".join(why for _, why in checks)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="run the probes whose name contains this, or of this item (e.g. 23)")
    ap.add_argument("--json", help="write the results here")
    ns = ap.parse_args()
    ITEMS.update(item for item, _, _ in PROBES)
    rows = []
    for item, name, fn in PROBES:
        if ns.only and (ns.only != item if ns.only in ITEMS else ns.only not in name):
            continue  # an item's probes by its id ("25" is not "256 KiB"), else the names holding the text
        with tempfile.TemporaryDirectory() as d:
            start = time.perf_counter()
            try:
                ok, detail = fn(Path(d))
            except Exception as e:  # a probe that crashes is a failed probe
                ok, detail = False, f"probe crashed: {type(e).__name__}: {e}"[:300]
            rows.append({"item": item, "probe": name, "ok": ok, "detail": detail, "s": time.perf_counter() - start})
        r = rows[-1]
        print(f"| {item} | {name} | {'pass' if ok else 'FAIL'} | {r['detail'].replace('|', '/')} |", flush=True)
    passed = sum(r["ok"] for r in rows)
    print(f"\n{passed} of {len(rows)} probes passed")
    if ns.json:
        Path(ns.json).write_text(json.dumps(rows, indent=1))
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
