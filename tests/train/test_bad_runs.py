"""Bad input and bad numbers end in one clear line, with nothing half-written."""

import pathlib
import subprocess

import pytest
import torch
from safetensors.torch import save_file

from memfit.cli import main
from memfit.config.loader import load_config
from memfit.errors import UserError
from memfit.train.disk import guarded_write
from memfit.train.loop import Trainer


@pytest.mark.parametrize("override", ["optimizer.lr=inf", "optimizer.lr=.nan", "optimizer.eps=inf", "lora.alpha=inf"])
def test_non_finite_hyperparameters_are_refused_at_config_load(override):
    with pytest.raises(UserError, match=rf"{override.split('=')[0]} must be"):
        load_config(None, [override])


def test_a_run_that_goes_non_finite_stops_before_checkpointing_or_exporting_it(tiny_cfg, tmp_path):
    trainer = Trainer(
        tiny_cfg("optimizer.lr=1e30", "optimizer.warmup_steps=0", "train.checkpoint_every=1", "output.export=true")
    )
    with pytest.raises(UserError, match=r"step \d+: the loss is .* nothing of it is checkpointed or exported"):
        trainer.fit()
    trainer.close()
    run = trainer.run
    assert not run.export.exists()
    steps = sorted(p.name for p in run.checkpoints.glob("step_*")) if run.checkpoints.exists() else []
    assert all(int(name.split("_")[1]) < 3 for name in steps), steps  # none of a non-finite step


def test_a_loss_that_is_not_finite_before_any_update_blames_the_model_not_the_learning_rate(tiny_cfg):
    """Weights that compute NaN (a broken checkpoint, a config.json field out of range) were reported as "lower
    optimizer.lr (0.001), keep optimizer.grad_clip > 0": no update has happened when step 1's loss is taken."""
    trainer = Trainer(tiny_cfg("train.eval_every=0"))
    with torch.no_grad():
        trainer.model.get_input_embeddings().weight.fill_(float("nan"))
    with pytest.raises(UserError, match=r"^step 1: the loss is nan before any update, so the model as loaded") as e:
        trainer.fit()
    trainer.close()
    assert "optimizer.lr plays no part yet" in str(e.value) and "lower optimizer.lr" not in str(e.value)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--steps", "0"], "--steps must be >= 1"),
        (["--micro-batch", "0"], "--micro-batch must be > 0"),
        (["--ac", ","], "--ac needs at least one value"),
        (["--precision", "fp8"], "--precision must be one of"),
        (["--micro-batch", "3", "--global-batch", "4"], "--global-batch 4 is not a positive multiple of micro-batch 3"),
        (["--zero", "5"], "--zero must be comma-separated stages 0-3 or none (got '5')"),
        (["--zero", "two"], "--zero must be comma-separated stages 0-3 or none (got 'two')"),
        (["--zero", "2", "--nproc-per-node", "1"], "--nproc-per-node must be >= 2 for the --zero cells (got 1)"),
        (["--quantize-base", "nf4", "--lora", "false"], "can run: ac-none_fp32_nf4_mb2_full: --quantize-base nf4"),
        (["--optimizer-offload", "true", "--zero", "1"], "ac-none_fp32_opthost_mb2_lora_zero1x2: optimizer.offload"),
        (["--optimizer-name", "adamw8bit", "--zero", "2"], "runs on one process or DDP without ZeRO (got fsdp2"),
    ],
)
def test_bench_refuses_a_bad_matrix_before_writing_anything(tmp_path, capsys, args, message):
    out = tmp_path / "bench"
    assert main(["bench", "tiny-cpu", *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not out.exists()


def test_bench_refuses_an_out_directory_that_cannot_be_made(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert main(["bench", "tiny-cpu", "--out", str(tmp_path / "file" / "bench")]) == 2
    assert main(["bench", "tiny-cpu", "--out", "/proc/memfit-bench"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "--out" in err[0] and "is a file" in err[0] and "cannot be created" in err[1]


def test_plan_refuses_a_zero_sequence_length(capsys):
    assert main(["plan", "--model", "tiny", "--gpu", "mi210", "--seq-len", "0"]) == 2
    assert "--seq-len and --global-batch must be > 0 (got 0" in capsys.readouterr().err


def test_train_overrides_may_follow_an_option_and_zero_ranks_are_refused(capsys):
    assert main(["train", "tiny-cpu", "--print-config", "train.max_steps=7"]) == 0
    assert "max_steps: 7" in capsys.readouterr().out
    assert main(["train", "tiny-cpu", "--nproc-per-node", "0"]) == 2
    assert main(["train", "tiny-cpu", "--nnodes", "0"]) == 2
    assert main(["train", "tiny-cpu", "--node-rank", "-1"]) == 2  # trained one process before
    assert main(["train", "tiny-cpu", "--rdzv-endpoint", ":::"]) == 2  # trained one process, the flag unread
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "memfit: error: --nproc-per-node must be >= 1 (got 0)",
        "memfit: error: --nnodes must be >= 1 (got 0)",
        "memfit: error: --node-rank must be in 0..0 (got -1)",
        "memfit: error: --rdzv-endpoint is where torchrun's ranks meet: give --nproc-per-node (and --nnodes) too",
    ]


def test_exporter_refuses_a_port_out_of_range_and_a_host_that_is_not_here(capsys):
    assert main(["exporter", "--port", "70000"]) == 2
    assert "--port must be in 0..65535 (got 70000)" in capsys.readouterr().err
    assert main(["exporter", "--host", "192.0.2.1", "--port", "0"]) == 2  # TEST-NET-1: never a local address
    assert "--host 192.0.2.1: not an address of this machine" in capsys.readouterr().err


def test_resume_with_nothing_to_resume_says_so(tiny_cfg):
    trainer = Trainer(tiny_cfg("train.resume=true", "train.max_steps=1"))
    try:
        assert any("train.resume=true but" in n and "holds no checkpoint yet" in n for n in trainer.notes)
    finally:
        trainer.close()


@pytest.mark.parametrize("where", ["under-a-file", "/proc", "/sys"])
def test_an_output_dir_that_cannot_be_created_is_one_line(tiny_cfg, tmp_path, where):
    if where == "under-a-file":
        (tmp_path / "a-file").write_text("x")
        out = tmp_path / "a-file" / "run"
    else:
        out = pathlib.Path(where) / "memfit-run"
    with pytest.raises(UserError) as e:
        Trainer(tiny_cfg(f"output.dir={out}"))
    assert "\n" not in str(e.value) and str(e.value).startswith(f"output.dir '{out}' cannot be created")
    assert not out.exists()


def _tmpfs(path, options: str):
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a small tmpfs here to fill ({done.stderr.decode().strip()})")
    return path


@pytest.fixture
def small_disk(tmp_path):
    disk = _tmpfs(tmp_path / "disk", "size=256k")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)  # lazy: a leaked handle cannot block it


def test_a_full_disk_refuses_the_checkpoint_in_one_line_and_leaves_nothing_half_written(tiny_cfg, small_disk):
    trainer = Trainer(tiny_cfg("train.checkpoint_every=2", f"output.dir={small_disk}/run"))
    try:
        with pytest.raises(UserError) as e:
            trainer.fit()
    finally:
        trainer.close()
    message = str(e.value)
    assert message.startswith(f"checkpoint step 2: no space left for {small_disk}/run/checkpoints/step_0000002")
    assert "MiB needed" in message and "MiB free" in message and "\n" not in message
    checkpoints = small_disk / "run" / "checkpoints"
    assert not checkpoints.exists() or not any(checkpoints.iterdir())  # not even a temporary directory


def test_a_disk_that_fills_midway_is_one_line(small_disk):
    with pytest.raises(UserError, match=rf"x: no space left for {small_disk}/f \(about 0 MiB needed, 0 MiB free\)"):
        with guarded_write("x", small_disk / "f", 0):
            (small_disk / "f").write_bytes(b"\0" * (1 << 20))  # errno ENOSPC from the filesystem
    with pytest.raises(UserError, match=r"no space left for .* \(torch: unexpected pos 12588416 vs 12588304\)"):
        with guarded_write("checkpoint step 3", small_disk / "g", 0):
            raise RuntimeError("unexpected pos 12588416 vs 12588304")  # how torch.save reports it
    with pytest.raises(RuntimeError, match="a bug"):  # anything else keeps its traceback
        with guarded_write("x", small_disk / "g", 0):
            raise RuntimeError("a bug")


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, embedded_dir):
    """A tiny random Llama saved as a Hugging Face directory (weights, config, the embedded tokenizer)."""
    from transformers import AutoTokenizer

    from memfit.models.load import ModelSource, build_model

    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    build_model(ModelSource("preset", preset="tiny"), None, torch.float32, 0).save_pretrained(out)
    AutoTokenizer.from_pretrained(embedded_dir).save_pretrained(out)
    return out


@pytest.mark.parametrize(
    "damage, message",
    [
        ("truncated", r"model.safetensors' is damaged \(truncated: \d+ bytes, its header describes \d+\)"),
        ("emptied", r"model.safetensors' is damaged \(0 bytes, no safetensors header\)"),
        ("garbage", r"model.safetensors' is damaged \(\d+ bytes, no safetensors header\)"),
        ("config-garbage", r"config.json' is not a usable model config \(.*not a valid JSON file"),
        ("config-unknown-type", r"config.json' is not a usable model config \(.*model type `nonsense`"),
        # was: trained from random weights and exited 0, transformers' load report the only sign
        (
            "other-tensors",
            r"lacks 21 of the weights its config.json describes \(lm_head.weight, .* and 18 more\); "
            r"its files hold x instead",
        ),
    ],
)
def test_a_bad_model_directory_is_one_line(tiny_cfg, tiny_checkpoint, tmp_path, damage, message):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_checkpoint, model)
    weights, config = model / "model.safetensors", model / "config.json"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:-1000])
    elif damage == "emptied":
        weights.write_bytes(b"")
    elif damage == "garbage":
        weights.write_bytes(b"\xff" * 5000)
    elif damage == "other-tensors":
        save_file({"x": torch.zeros(1)}, weights)
    elif damage == "config-garbage":
        config.write_text("{not json")
    else:
        config.write_text('{"model_type": "nonsense"}')
    with pytest.raises(UserError, match=message) as e:
        Trainer(tiny_cfg(f"model.source={model}", "train.max_steps=1"))
    assert "\n" not in str(e.value)
    if damage.startswith("config"):
        assert main(["plan", "--model", str(config), "--gpu", "mi210"]) == 2


def test_tensors_a_checkpoint_holds_beyond_its_model_are_said_in_one_line_and_ignored(capsys):
    from memfit.models.load import check_loaded

    check_loaded(pathlib.Path("m"), {"missing_keys": set(), "unexpected_keys": {"a", "b", "c", "d", "e"}})
    err = capsys.readouterr().err
    assert err == "memfit: model.source: 'm' holds 5 tensors the model does not use (a, b, c and 2 more); ignored\n"


@pytest.mark.parametrize(
    "content, why",
    [("{nope", "not readable JSON (Expecting property name"), ("[1]", "a JSON list, not an object"), (None, None)],
    ids=["broken", "list", "absent"],
)
def test_a_generation_config_transformers_would_drop_is_said_in_one_line(tmp_path, capsys, content, why):
    """transformers ignores a broken generation_config.json without a word; the run trained and its export carried
    settings made from config.json."""
    from memfit.models.load import check_generation_config

    (tmp_path / "config.json").write_text("{}")
    if content is not None:
        (tmp_path / "generation_config.json").write_text(content)
    check_generation_config(tmp_path)
    err = capsys.readouterr().err
    if why is None:
        assert err == ""
    else:
        assert err.count("\n") == 1 and err.startswith(
            f"memfit: model.source: '{tmp_path}/generation_config.json' is {why}"
        )
        assert "the export carries generation settings made from config.json" in err


@pytest.mark.parametrize(
    "name, content, message",
    [
        (
            "chat.jsonl",
            b'{"prompt": "a", "response": "b"}\n{"prompt": "\xff"}\n',
            r"not UTF-8 text \(byte 0xff .* line 2\)",
        ),
        ("latin1.txt", "Fran\u00e7ois ".encode("latin-1") * 200, r"not UTF-8 text \(byte 0xe7 at offset 4, line 1\)"),
        ("binary.txt", bytes(range(256)) * 50, r"is binary, not text \(a NUL byte at offset 0\)"),
        ("wide.jsonl", '{"prompt": "a", "response": "b"}\n'.encode("utf-16"), r"is UTF-16 text \(iconv -f utf-16"),
    ],
)
def test_data_that_is_not_utf8_text_is_one_line(tiny_cfg, tmp_path, name, content, message):
    data = tmp_path / name
    data.write_bytes(content)
    with pytest.raises(UserError, match=message) as e:
        Trainer(tiny_cfg(f"data.source={data}", "train.max_steps=1"))
    assert str(e.value).startswith(f"data.source: '{data}'") and "\n" not in str(e.value)


def test_a_byte_order_mark_before_utf8_records_or_text_is_left_out(tmp_path):
    """Windows tools write UTF-8 with a byte order mark: its JSON lines were refused ("Unexpected UTF-8 BOM") and its
    text trained on the mark as a character."""
    from memfit.config.loader import read_utf8

    record = '{"prompt": "a", "response": "b"}\n'
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + record.encode() * 3)
    assert read_utf8(tmp_path / "bom.jsonl", "data.source", "") == record * 3
    (tmp_path / "inner.txt").write_bytes(b"a\xef\xbb\xbfb")  # one inside the text is the text's: kept
    assert read_utf8(tmp_path / "inner.txt", "data.source", "") == "a\ufeffb"


def test_a_step_to_profile_or_snapshot_after_the_last_one_is_said(tiny_cfg):
    settings = ("train.max_steps=2", "train.profile_step=5", "train.snapshot_at_step=3", "optimizer.warmup_steps=3")
    trainer = Trainer(tiny_cfg(*settings))
    trainer.close()
    assert any(
        n.startswith("optimizer.warmup_steps 3 reaches past train.max_steps 2: the learning rate never")
        for n in trainer.notes
    )
    assert "train.profile_step 5 is after the last step (train.max_steps 2): no step is profiled" in trainer.notes
    assert (
        "train.snapshot_at_step 3 is after the last step (train.max_steps 2): no snapshot is written" in trainer.notes
    )


def test_too_few_records_for_the_global_batch_are_refused_before_the_run_directory_is_made(tiny_cfg, tmp_path):
    data = tmp_path / "few.jsonl"
    data.write_text('{"prompt": "q", "response": "a"}\n' * 3)
    cfg = tiny_cfg(f"data.source={data}", "train.max_steps=1", "train.micro_batch_size=4")
    with pytest.raises(UserError, match=r"a global batch of 4 sequences .* larger than the \d training rows"):
        Trainer(cfg)
    assert not pathlib.Path(cfg.output.dir).exists()


def test_a_deepspeed_json_that_is_not_utf8_is_one_line(tmp_path, capsys):
    ds = tmp_path / "ds.json"
    ds.write_bytes(b'{"zero_optimization": {"stage": 2}, "note": "\xe9"}')
    assert main(["plan", "--model", "tiny", "--gpu", "mi210", "--deepspeed", str(ds)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--deepspeed: " in err[0] and "is not UTF-8 text (byte 0xe9" in err[0], err
    ds.write_text("[1, 2]")
    assert main(["plan", "--model", "tiny", "--gpu", "mi210", "--deepspeed", str(ds)]) == 2
    assert "the top level must be a JSON object (got list)" in capsys.readouterr().err


def test_a_missing_deepspeed_config_is_one_line_even_in_a_one_process_run(tiny_cfg, tmp_path):
    with pytest.raises(UserError, match=r"distributed.deepspeed_config: '.*none.json' does not exist"):
        Trainer(tiny_cfg(f"distributed.deepspeed_config={tmp_path / 'none.json'}", "train.max_steps=1"))
    trainer = Trainer(tiny_cfg("distributed.deepspeed_config=ds-zero2-article", "train.max_steps=1"))
    try:
        assert "distributed.deepspeed_config is not read: this run's engine is single" in trainer.notes
    finally:
        trainer.close()


def test_an_output_dir_on_a_read_only_mount_is_one_line(tiny_cfg, tmp_path):
    ro = _tmpfs(tmp_path / "ro", "ro,size=1m")
    try:
        with pytest.raises(UserError, match=rf"output.dir '{ro}/run' cannot be created or written \({ro}: Read-only"):
            Trainer(tiny_cfg(f"output.dir={ro}/run"))
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=True)


def test_a_bench_matrix_leaves_out_the_combinations_that_cannot_run_and_names_each():
    """``--optimizer-name adamw,adamw8bit --zero none,2`` refused the whole bench for its adamw8bit x ZeRO-2 cell
    while ``--optimizer-offload`` x ZeRO-1 was dropped without a word: both are left out now, each named with
    ``Strategy.conflict``'s reason, as the planner's search space leaves them out."""
    from memfit.cli import build_parser
    from memfit.commands.bench import axes
    from memfit.config.loader import load_config
    from memfit.config.shipped import resolve_config_path
    from memfit.telemetry.bench import matrix

    argv = ["bench", "tiny-cpu", "--ac", "none", "--optimizer-name", "adamw,adamw8bit", "--zero", "none,2"]
    ns = build_parser().parse_args(argv)
    cells, skipped = matrix(axes(ns, load_config(str(resolve_config_path("tiny-cpu")))), [True], [None, 2])
    assert [(c.strategy.optimizer_name, c.nproc) for c in cells] == [("adamw", 1), ("adamw", 2), ("adamw8bit", 1)]
    assert len(skipped) == 1 and skipped[0].startswith("ac-none_fp32_adamw8bit_mb2_lora_zero2x2: optimizer.name")
    assert "runs on one process or DDP without ZeRO (got fsdp2, ZeRO-2)" in skipped[0]


def test_a_value_given_twice_on_a_bench_axis_is_one_cell():
    """``--micro-batch 2,2`` ran two cells of one name into one directory, the second overwriting the first."""
    from memfit.cli import build_parser
    from memfit.commands.bench import axes
    from memfit.config.loader import load_config
    from memfit.config.shipped import resolve_config_path
    from memfit.telemetry.bench import matrix

    ns = build_parser().parse_args(["bench", "tiny-cpu", "--micro-batch", "2,2", "--ac", "full,none,full"])
    cells, _ = matrix(axes(ns, load_config(str(resolve_config_path("tiny-cpu")))), [True])
    names = [c.name for c in cells]
    assert len(names) == len(set(names)) == 2 and names[0].startswith("ac-full")


@pytest.mark.parametrize(
    "args, flag",
    [
        (["plan", "--model", "tiny", "--gpu", "mi210", "--seq-len", "64", "--write-config", ""], "--write-config"),
        (["plan", "--model", "tiny", "--gpu", "mi210", "--seq-len", "64", "--html", " "], "--html"),
        (["plan", "--model", "", "--gpu", "mi210"], "--model"),
        (["plan", "--model", "tiny", "--gpu", "mi210", "--config", ""], "--config"),
        (["bench", "tiny-cpu", "--out", ""], "--out"),
        (["frag", "x.pickle", "--out", ""], "--out"),
        (["report", "run", "--out", ""], "--out"),
    ],
)
def test_an_empty_path_is_refused_not_taken_as_left_out(tmp_path, monkeypatch, capsys, args, flag):
    """``--write-config "$UNSET"`` wrote nothing and said nothing; ``--out ''`` wrote to the default place."""
    monkeypatch.chdir(tmp_path)
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert f"{flag} is empty: give a path or a name, or leave the option out" in err and "\n" not in err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    "args, message",
    [
        (["report", ""], "memfit report needs a path, not an empty one"),
        (["frag", ""], "the snapshot path is empty"),
        # argparse took ``-5GiB`` for an option and said only "argument --mem: expected one argument"
        (
            ["plan", "--model", "tiny", "--gpu-mem", "-5GiB"],
            "--gpu-mem must look like 64GiB, 80GB or 512MiB (got '-5GiB')",
        ),
        (["train", "--auto", "--mem", "-5GiB"], "--mem must look like 64GiB, 80GB or 512MiB (got '-5GiB')"),
        (["frag", "x.pickle", "--top", "-3"], "--top must be"),
    ],
)
def test_an_empty_input_path_or_a_value_that_looks_negative_is_named_in_one_line(
    tmp_path, monkeypatch, capsys, args, message
):
    monkeypatch.chdir(tmp_path)
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_a_cache_directory_that_cannot_be_made_is_one_line(tiny_cfg, tmp_path, monkeypatch):
    """``MEMFIT_CACHE`` where no directory can be made (under a file; a read-only mount) was a FileNotFoundError
    traceback from the embedded model's conversion; now one line, before the conversion, and for the chat records."""
    from memfit.train.plays import plays_chat_file

    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path / "afile" / "cache"))
    with pytest.raises(UserError, match=r"cannot write the de-quantized SmolLM2 checkpoint into '.*afile/cache'") as e:
        Trainer(tiny_cfg(f"output.dir={tmp_path / 'run'}"))
    assert "set MEMFIT_CACHE to a writable directory" in str(e.value) and not (tmp_path / "run").exists()
    with pytest.raises(UserError, match=r"cannot write the shakespeare-chat records into"):
        plays_chat_file()


def test_more_threads_than_cpus_is_said_with_the_count_that_fits(tiny_cfg, monkeypatch):
    """``train.threads=999`` on 2 CPUs trained without a word, each step several times slower than with 2."""
    import os

    from memfit.config.schema import oversubscribed_threads

    assert oversubscribed_threads(None, 2, 1) == [] and oversubscribed_threads(2, 2, 1) == []
    assert oversubscribed_threads(999, 2, 1) == [
        "train.threads 999 is more than the 2 CPUs this process may run on: threads that share a CPU wait on each "
        "other; train.threads=2 gives each its own"
    ]
    assert oversubscribed_threads(4, 16, 4) == []
    assert oversubscribed_threads(8, 16, 4)[0].startswith("train.threads 8 x 4 ranks on this node is more than the 16")
    assert oversubscribed_threads(8, 16, 4)[0].endswith("train.threads=4 gives each its own")
    assert oversubscribed_threads(2, 2, 4)[0].endswith("train.threads=1 gives each its own")
    cpus = len(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    try:  # the trainer sets torch's threads for the process: this worker's other tests get theirs back
        trainer = Trainer(tiny_cfg("train.max_steps=1", f"train.threads={cpus + 1}"))
        trainer.close()
    finally:
        torch.set_num_threads(before)
    assert oversubscribed_threads(cpus + 1, cpus, 1)[0] in trainer.notes


@pytest.mark.parametrize(
    "args, said",
    [
        (["train", "{p}"], "config '{p}' {why}; give a YAML file or a shipped config"),
        (["train", "tiny-cpu", "data.source={p}"], "data.source: '{p}' {why}; give 'shakespeare'"),
        (["train", "tiny-cpu", "distributed.deepspeed_config={p}"], "distributed.deepspeed_config: '{p}' {why}"),
        (["plan", "--model", "llama2-7b", "--gpu", "h100", "--deepspeed", "{p}"], "--deepspeed: '{p}' {why}"),
        (["frag", "{p}"], "snapshot '{p}' {why}; write one with"),
        (["report", "{p}"], "'{p}' {why}; give a run directory"),
    ],
    ids=["config", "data", "deepspeed-config", "plan-deepspeed", "frag", "report"],
)
def test_a_path_that_is_no_regular_file_is_said_as_what_it_is(args, said, tmp_path, capsys, monkeypatch):
    """/dev/null (and, where a directory is not read as one, a directory) was said not to exist."""
    from memfit.cli import main

    monkeypatch.chdir(tmp_path)
    cases = [("/dev/null", "is not a regular file")]
    if args == ["train", "{p}"]:  # a config name that is not here may be a shipped one misspelt: said as such
        cases.append((str(tmp_path), "is a directory"))
    else:
        cases.append((str(tmp_path / "gone"), "does not exist"))
    if "--deepspeed" in args or "distributed.deepspeed_config={p}" in args:
        cases.append((str(tmp_path), "is a directory"))
    for path, why in cases:
        assert main([a.format(p=path) for a in args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said.format(p=path, why=why) in err, err
