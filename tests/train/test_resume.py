"""Resume always finds its run: however its directory is spelled or wherever it moved, past damaged
checkpoints, with settings that do not change the math changed (issue 19, items 1, 2, 11, 12)."""

import json
import os
import shutil

import pytest
import yaml
from support.tiny import fitted

from memfit.errors import UserError
from memfit.train.checkpoint import latest_intact, remove_partial, verify_checkpoint
from memfit.train.loop import Trainer

RUN = ("train.max_steps=6", "train.checkpoint_every=2", "train.keep_checkpoints=3", "train.eval_every=0")


def _losses(result):
    return {r["step"]: r["loss"] for r in result.steps}


@pytest.fixture
def whole(tiny_cfg, tmp_path):
    """A finished 6-step run with checkpoints at steps 2, 4 and 6, and its losses."""
    _, result = fitted(tiny_cfg(*RUN, f"output.dir={tmp_path}/runs/k1"))
    return tmp_path / "runs" / "k1", _losses(result)


def _cut_back_to(run_dir, step):
    """Make the run look killed after ``step``: later checkpoints removed."""
    for ckpt in (run_dir / "checkpoints").glob("step_*"):
        if int(ckpt.name.split("_")[1]) > step:
            shutil.rmtree(ckpt)


def test_resume_finds_its_run_however_the_directory_is_spelled_or_wherever_it_moved(
    tiny_cfg, whole, tmp_path, monkeypatch
):
    run_dir, losses = whole
    _cut_back_to(run_dir, 4)
    monkeypatch.chdir(tmp_path)
    trainer, rest = fitted(tiny_cfg(*RUN, "train.resume=true", "output.dir=./runs/../runs/k1"))
    assert trainer.resume_from.name == "step_0000004"
    assert _losses(rest) == {s: losses[s] for s in (5, 6)}
    moved = tmp_path / "elsewhere" / "k1"
    moved.parent.mkdir()
    os.replace(run_dir, moved)
    _cut_back_to(moved, 4)
    trainer, rest = fitted(tiny_cfg(*RUN, "train.resume=true", f"output.dir={moved}"))
    assert _losses(rest) == {s: losses[s] for s in (5, 6)}


def _small_checkpoint(root):
    import torch

    from memfit.train.checkpoint import TrainerState, save_checkpoint

    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return save_checkpoint(root, model, opt, sched, TrainerState(step=1, micro_batches=1, tokens_seen=8), keep=2)


@pytest.mark.parametrize("damage", ["truncated", "emptied", "deleted", "garbage-state"])
def test_verify_names_what_is_damaged(tmp_path, damage):
    ckpt = _small_checkpoint(tmp_path)
    assert verify_checkpoint(ckpt) is None
    if damage == "truncated":
        path = ckpt / "trainable.safetensors"
        path.write_bytes(path.read_bytes()[:-10])
        expected = "trainable.safetensors has"
    elif damage == "emptied":
        (ckpt / "optimizer.pt").write_bytes(b"")
        expected = "optimizer.pt has 0 bytes"
    elif damage == "deleted":
        (ckpt / "rng.pt").unlink()
        expected = "rng.pt is missing"
    else:
        state = ckpt / "trainer_state.json"
        state.write_text(state.read_text()[:-3] + "xyz")
        expected = "trainer_state.json changed since it was written"
    assert expected in verify_checkpoint(ckpt)


def test_a_damaged_latest_checkpoint_is_passed_over_for_the_newest_intact_one(tiny_cfg, whole):
    run_dir, losses = whole
    _cut_back_to(run_dir, 4)
    path = run_dir / "checkpoints" / "step_0000004" / "trainable.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    trainer, rest = fitted(tiny_cfg(*RUN, "train.resume=true", f"output.dir={run_dir}"))
    assert trainer.resume_from.name == "step_0000002"
    assert any(n.startswith("step_0000004 is damaged (") and "resuming from step_0000002" in n for n in trainer.notes)
    assert _losses(rest) == {s: losses[s] for s in (3, 4, 5, 6)}  # the identical sequence from step 2 on


def test_no_intact_checkpoint_is_one_line_and_nothing_is_deleted(tiny_cfg, whole):
    run_dir, _ = whole
    for ckpt in (run_dir / "checkpoints").glob("step_*"):
        (ckpt / "optimizer.pt").write_bytes(b"garbage")
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    with pytest.raises(UserError) as e:
        Trainer(tiny_cfg(*RUN, "train.resume=true", f"output.dir={run_dir}"))
    message = str(e.value)
    assert "\n" not in message and "no checkpoint is intact" in message and "step_0000006 is damaged" in message
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before


def test_leftovers_of_a_kill_during_rotation_are_removed_and_never_counted(whole):
    run_dir, _ = whole
    root = run_dir / "checkpoints"
    (root / "step_0000008").mkdir()  # a deletion caught before it was renamed away (older memfit)
    (root / ".tmp-step_0000001").mkdir()  # a checkpoint renamed away for deletion, or being written
    remove_partial(root)
    assert sorted(p.name for p in root.iterdir()) == ["step_0000002", "step_0000004", "step_0000006"]
    assert latest_intact(root) == (root / "step_0000006", [])
    manifest = json.loads((root / "step_0000006" / "manifest.json").read_text())["files"]
    assert {"trainable.safetensors", "optimizer.pt", "rng.pt", "trainer_state.json"} <= set(manifest)


def test_settings_that_do_not_change_the_math_may_change_on_resume_and_a_run_can_train_longer(tiny_cfg, whole):
    run_dir, losses = whole
    more_steps = ("train.resume=true", "train.max_steps=8", "train.log_every=2", f"output.dir={run_dir}")
    trainer, more = fitted(tiny_cfg(*RUN, *more_steps))
    assert trainer.resume_from.name == "step_0000006"
    assert "changed on resume: train.max_steps: 6 there, 8 here" in trainer.notes
    assert "changed on resume: train.log_every: 1 there, 2 here" in trainer.notes
    assert [r["step"] for r in more.steps][-1] == 8  # trained on past the recorded end
    with pytest.raises(UserError, match=r"holds a different run \(train\.seed: 1234 there, 7 here\)"):
        Trainer(tiny_cfg(*RUN, "train.resume=true", "train.seed=7", f"output.dir={run_dir}"))
    # without train.resume, a change a resume would take says so
    hint = r"already holds this run up to step_0000008; pass train.resume=true to continue it with train.max_steps: 8"
    with pytest.raises(UserError, match=hint):
        Trainer(tiny_cfg(*RUN, "train.max_steps=10", f"output.dir={run_dir}"))


def test_the_same_global_batch_split_differently_resumes_the_same_steps(tiny_cfg, whole):
    """After an out-of-memory exit a user retries with a smaller micro-batch and more accumulation: the same
    global batch, so the same rows in every step and the same losses (to float summation order)."""
    run_dir, losses = whole
    _cut_back_to(run_dir, 4)
    split = ("train.micro_batch_size=2", "train.grad_accum_steps=2")
    trainer, rest = fitted(tiny_cfg(*RUN, *split, "train.resume=true", f"output.dir={run_dir}"))
    assert trainer.resume_from.name == "step_0000004"
    assert "changed on resume: train.micro_batch_size: 4 there, 2 here" in trainer.notes
    assert _losses(rest) == pytest.approx({s: losses[s] for s in (5, 6)}, rel=1e-5)
    # recorded now as 2 x 2: half the global batch is another run
    with pytest.raises(UserError, match=r"holds a different run \(train\.grad_accum_steps: 2 there, 1 here\)"):
        Trainer(tiny_cfg(*RUN, "train.micro_batch_size=2", "train.resume=true", f"output.dir={run_dir}"))


def test_a_resume_past_max_steps_is_one_line_and_a_renamed_checkpoint_is_not_one(tiny_cfg, whole):
    run_dir, _ = whole
    with pytest.raises(UserError, match=r"is at step 6 \(step_0000006\), past train.max_steps 4: raise"):
        Trainer(tiny_cfg(*RUN, "train.resume=true", "train.max_steps=4", f"output.dir={run_dir}"))
    (run_dir / "checkpoints" / "step_0000006").rename(run_dir / "checkpoints" / "step_final")  # by hand
    assert latest_intact(run_dir / "checkpoints") == (run_dir / "checkpoints" / "step_0000004", [])


def test_a_second_start_into_a_directory_in_use_is_one_line_and_changes_nothing(tiny_cfg, whole):
    """Two starts into one output.dir (a resume launched twice) would delete each other's checkpoints in the
    making; the second is refused while the first holds the directory, and may start once it ended."""
    import subprocess
    import sys

    run_dir, _ = whole
    holder = subprocess.Popen(  # another process holding the directory, as a running memfit train does
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; from memfit.train.run_dir import hold; "
            "hold(Path(sys.argv[1])); print('held', flush=True); sys.stdin.read()",
            str(run_dir),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
        with pytest.raises(UserError, match=rf"is in use by another memfit run \(pid {holder.pid}\); wait for it"):
            Trainer(tiny_cfg(*RUN, "train.resume=true", "train.max_steps=8", f"output.dir={run_dir}"))
        assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before
    finally:
        holder.communicate("", timeout=60)
    trainer, more = fitted(tiny_cfg(*RUN, "train.resume=true", "train.max_steps=8", f"output.dir={run_dir}"))
    assert [r["step"] for r in more.steps] == [7, 8] and not (run_dir / ".memfit.lock").exists()


def test_memory_levers_may_change_on_resume_and_the_steps_stay_the_same(tiny_cfg, whole):
    """What an out-of-memory run changes to fit (checkpointing, a chunked loss, offloaded activations, the optimizer
    step's kernels, the optimizer in host memory) computes the same steps: the resumed losses are the uninterrupted
    run's (fp32, to rounding)."""
    run_dir, losses = whole
    _cut_back_to(run_dir, 4)
    levers = (
        "strategy.activation_checkpointing=full",
        "strategy.loss_chunks=2",
        "strategy.activation_offload=true",
        "optimizer.implementation=for-loop",
        "optimizer.offload=true",
    )
    trainer, rest = fitted(tiny_cfg(*RUN, *levers, "train.resume=true", f"output.dir={run_dir}"))
    assert trainer.resume_from.name == "step_0000004"
    assert "changed on resume: optimizer.implementation: 'auto' there, 'for-loop' here" in trainer.notes
    assert _losses(rest) == pytest.approx({s: losses[s] for s in (5, 6)}, rel=1e-5)


def test_a_start_refused_for_a_busy_port_writes_nothing_and_a_retry_may_change_it(tiny_cfg, tmp_path):
    import socket

    out = tmp_path / "runs" / "busy"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        trainer = Trainer(tiny_cfg(*RUN, f"train.metrics_port={port}", f"output.dir={out}"))
        try:
            with pytest.raises(UserError, match=rf"train.metrics_port {port}: cannot listen"):
                trainer.fit()
        finally:
            trainer.close()
    assert not out.exists() or not any(out.iterdir())
    trainer, _ = fitted(tiny_cfg(*RUN, "train.metrics_port=0", "train.max_steps=2", f"output.dir={out}"))
    assert trainer.resume_from is None


def test_a_restart_without_checkpoints_may_change_how_it_runs_but_not_what(tiny_cfg, tmp_path):
    """An OOM at the first step leaves config.yaml and no checkpoint: the retry with a smaller micro-batch (the
    same global batch) or another port starts over in the same directory; another model is still refused."""
    out = tmp_path / "runs" / "oom"
    fitted(tiny_cfg(*RUN, "train.max_steps=1", "train.keep_checkpoints=0", f"output.dir={out}"))
    split = ("train.micro_batch_size=2", "train.grad_accum_steps=2", "train.max_steps=1", "train.keep_checkpoints=0")
    trainer, result = fitted(tiny_cfg(*RUN, *split, f"output.dir={out}"))
    assert "changed since this run last started: train.micro_batch_size: 4 there, 2 here" in trainer.notes
    assert [r["step"] for r in result.steps] == [1]
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in evals if r["kind"] == "eval"] == [0, 1]  # the first start's records are gone
    with pytest.raises(UserError, match="holds a different run"):
        Trainer(tiny_cfg(*RUN, "optimizer.lr=2e-3", f"output.dir={out}"))


@pytest.mark.parametrize("received", ["SIGTERM", "SIGINT"])
def test_a_stop_signal_writes_a_final_checkpoint_and_says_which(tiny_cfg, whole, tmp_path, received):
    """A scheduler's SIGTERM (or Ctrl-C) at step 3 of a run that checkpoints only at its end: the step finishes,
    step_0000003 is written, the one line names it, and the resume continues the identical loss sequence."""
    import signal

    from memfit.errors import Interrupted

    _, losses = whole
    out = tmp_path / "runs" / "stopped"
    trainer = Trainer(tiny_cfg(*RUN, "train.checkpoint_every=0", f"output.dir={out}"))
    step = trainer.train_step

    def stopped_at_three(batches):
        if trainer.scheduler.last_epoch == 2:  # the third step
            os.kill(os.getpid(), getattr(signal, received))
        return step(batches)

    trainer.train_step = stopped_at_three
    try:
        with pytest.raises(Interrupted) as e:
            trainer.fit()
    finally:
        trainer.close()
    assert e.value.exit_code == 128 + getattr(signal, received)
    message = str(e.value)
    assert message.startswith(f"interrupted by {received} after step 3 of 6: checkpoint ")
    assert str(out / "checkpoints" / "step_0000003") in message and "train.resume=true" in message
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handlers are put back
    trainer, rest = fitted(tiny_cfg(*RUN, "train.checkpoint_every=0", "train.resume=true", f"output.dir={out}"))
    assert trainer.resume_from.name == "step_0000003"
    assert _losses(rest) == {s: losses[s] for s in (4, 5, 6)}


def test_a_run_whose_config_predates_a_setting_resumes_with_its_default(tiny_cfg, whole):
    """A run started by a memfit before ``data.loss_on`` existed has no such key in its ``config.yaml``; it read as
    None and the resume was refused as "a different run (data.loss_on: None there, 'assistant' here)"."""
    run_dir, losses = whole
    _cut_back_to(run_dir, 4)
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    del config["data"]["loss_on"]
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    trainer, rest = fitted(tiny_cfg(*RUN, "train.resume=true", f"output.dir={run_dir}"))
    assert trainer.resume_from.name == "step_0000004"
    assert not [n for n in trainer.notes if "loss_on" in n]
    assert _losses(rest) == {s: losses[s] for s in (5, 6)}
    with pytest.raises(UserError, match=r"holds a different run \(data\.loss_on: 'assistant' there, 'last' here\)"):
        Trainer(tiny_cfg(*RUN, "train.resume=true", "data.loss_on=last", f"output.dir={run_dir}"))
