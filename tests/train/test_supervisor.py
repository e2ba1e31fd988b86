"""`train.on_oom = next`: the ladder of configurations after an out-of-memory exit (the global batch kept), and a
real OOM (an address-space cap, as `memfit bench --mem-limit` injects it) recovered from the last checkpoint with
the loss sequence of an uninterrupted run of the configuration it ended on (integration tier)."""

import resource
import subprocess
import sys

import pytest
import yaml
from support.address_space import address_space_cap
from support.tiny import tiny_config, tiny_overrides

from memfit.config.loader import load_config
from memfit.config.schema import grad_accum_steps
from memfit.telemetry.metrics_file import read_metrics
from memfit.train.loop import Trainer
from memfit.train.supervisor import next_after_oom


def _cfg(*overrides):
    return load_config(None, list(overrides))


@pytest.mark.parametrize(
    "overrides, world, expected",
    [
        (["train.micro_batch_size=16"], 1, (["train.micro_batch_size=8", "train.grad_accum_steps=2"], "16 x accum 1")),
        (["train.micro_batch_size=6", "train.grad_accum_steps=2"], 1, (["train.micro_batch_size=3"], "6 x accum 2")),
        (["train.micro_batch_size=4", "train.global_batch_size=16"], 2, (["train.micro_batch_size=2"], "4 x accum 2")),
        (["train.micro_batch_size=1"], 1, (["strategy.activation_checkpointing=ffn"], "none -> ffn")),
        (
            ["train.micro_batch_size=1", "strategy.activation_checkpointing=every_k:2"],
            1,
            (["strategy.activation_checkpointing=full"], "every_k:2 -> full"),
        ),
        (["train.micro_batch_size=1", "strategy.activation_checkpointing=full"], 1, None),
    ],
)
def test_the_ladder_keeps_the_global_batch_then_checkpoints_more(overrides, world, expected):
    cfg = _cfg(*overrides)
    got = next_after_oom(cfg, world)
    if expected is None:
        assert got is None
        return
    extra, change = got
    assert extra[: len(expected[0])] == expected[0] and expected[1] in change
    after = _cfg(*overrides, *extra)
    per_rank = cfg.train.micro_batch_size * grad_accum_steps(cfg, world)
    assert after.train.micro_batch_size * grad_accum_steps(after, world) == per_rank


def test_the_step_in_backward_cannot_accumulate_so_it_checkpoints_instead():
    cfg = _cfg("train.micro_batch_size=4", "optimizer.in_backward=true", "optimizer.grad_clip=0")
    assert next_after_oom(cfg, 1)[0] == ["strategy.activation_checkpointing=ffn"]


def test_on_oom_is_validated_in_one_line():
    from memfit.errors import UserError

    with pytest.raises(UserError, match=r"train.on_oom must be stop \| next \(got 'retry'\)"):
        _cfg("train.on_oom=retry")


def test_max_restarts_zero_starts_the_run_without_its_restart_condition(monkeypatch, tmp_path):
    """No restart allowed: the one child never acts on ``train.restart_on`` (it restarted once before)."""
    from memfit.train import supervisor

    started = []
    monkeypatch.setattr(supervisor, "_run_child", lambda args, env: started.append(args) or 0)
    overrides = ["train.restart_on=every:1steps", "train.max_restarts=0", f"output.dir={tmp_path}"]
    assert supervisor.supervise(["tiny-cpu"], overrides, lambda more: _cfg(*more), 1, print) == 0
    assert len(started) == 1 and started[0][-1] == "train.restart_on=null"
    assert _cfg(*started[0][started[0].index("train.restart_on=every:1steps") :]).train.restart_on is None


def _train(*overrides, cap_bytes=None):
    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (cap_bytes, cap_bytes))

    return subprocess.run(
        [sys.executable, "-m", "memfit.cli", "train", "tiny-cpu", *overrides],
        capture_output=True,
        text=True,
        preexec_fn=cap if cap_bytes else None,
        timeout=600,
    )


def _losses(run):
    return [r["loss"] for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "step"]


@pytest.mark.integration
def test_an_oom_restarts_from_the_checkpoint_down_the_ladder_with_the_same_losses(tmp_path):
    """Two steps at micro-batch 16 (seq 256) and a checkpoint; then, under a 1.9 GiB address-space cap in which
    16 and 8 run out of memory and 4 does not, the resumed run goes 16 -> 8 -> 4 and finishes; its four losses are
    an uninterrupted micro-batch 4 x accum 4 run's (fp32). The cap sits mid-window: on a 2-core VM with one thread
    micro-batch 4 ran out of memory at 1.45 GiB and not at 1.65, micro-batch 8 at 2.2 and not at 2.3 GiB."""
    run = tmp_path / "run"
    common = ["data.seq_len=256", "train.eval_every=0", "train.eval_batches=1"]
    common += ["train.threads=1", "train.checkpoint_every=2"]
    Trainer(tiny_config(run, *common, "train.micro_batch_size=16", "train.max_steps=2")).fit()  # in this process
    resumed = _train(
        *tiny_overrides(run, *common, "train.micro_batch_size=16", "train.max_steps=4"),
        "train.resume=true",
        "train.on_oom=next",
        cap_bytes=address_space_cap(1900 << 20),
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    records = read_metrics(run / "metrics.jsonl")
    switches = [r for r in records if r["kind"] == "on_oom"]
    assert [s["change"] for s in switches] == ["micro-batch 16 x accum 1 -> 8 x 2", "micro-batch 8 x accum 2 -> 4 x 4"]
    assert all(s["step"] == 3 for s in switches) and "GiB failed" in switches[0]["failed"]
    (summary,) = [r for r in records if r["kind"] == "on_oom_summary"]
    assert summary["restarts"] == 2
    assert "on_oom: step 3: an allocation of" in resumed.stdout
    ran = yaml.safe_load((run / "config.yaml").read_text())["train"]
    assert (ran["micro_batch_size"], ran["grad_accum_steps"]) == (4, 4)

    ref = tmp_path / "ref"  # uninterrupted, in this process
    split = ("train.micro_batch_size=4", "train.grad_accum_steps=4", "train.max_steps=4")
    Trainer(tiny_config(ref, *common, *split)).fit()
    assert _losses(run) == pytest.approx(_losses(ref), rel=1e-5) and len(_losses(run)) == 4


@pytest.mark.parametrize(
    "text, kind, threshold",
    [
        ("fragmentation>0.5", "fragmentation", 0.5),
        ("retries > 0", "retries", 0.0),
        ("every:2h", "seconds", 7200.0),
        ("every:30m", "seconds", 1800.0),
        ("every:500steps", "steps", 500.0),
    ],
)
def test_restart_conditions_parse_to_typed_values(text, kind, threshold):
    from memfit.config.restart import RestartCondition

    c = RestartCondition.parse(text)
    assert (c.kind, c.threshold) == (kind, threshold)


def test_restart_conditions_say_why_and_bad_ones_are_one_line():
    from memfit.config.restart import RestartCondition
    from memfit.errors import UserError

    frag = RestartCondition.parse("fragmentation>0.5")
    assert frag.due({"fragmentation_ratio": 0.62}, 1, 1.0) == "fragmentation 0.62 > 0.5"
    assert frag.due({"fragmentation_ratio": 0.4}, 1, 1.0) is None and frag.due({}, 99, 1e9) is None  # CPU: no reading
    assert RestartCondition.parse("retries>0").due({"alloc_retries": 2}, 1, 1.0) == "retries 2 > 0"
    steps = RestartCondition.parse("every:3steps")
    assert steps.due({}, 2, 0.0) is None and "3 steps in this process" in steps.due({}, 3, 0.0)
    assert RestartCondition.parse("every:1m").due({}, 1, 61.0) == "1.0 min in this process (every 1 min)"
    for bad in ("fragmentation<0.5", "every:0h", "every:2d", "sometimes"):
        with pytest.raises(UserError, match="train.restart_on must be fragmentation>X, retries>N"):
            _cfg(f"train.restart_on={bad}")
    with pytest.raises(UserError, match="train.keep_checkpoints must be > 0"):
        _cfg("train.restart_on=every:2h", "train.keep_checkpoints=0")
    with pytest.raises(UserError, match=r"'fragmentation>2' never restarts: the fragmentation ratio is below 1"):
        _cfg("train.restart_on=fragmentation>2")  # was taken, and never due


@pytest.mark.integration
def test_restarts_resume_in_fresh_processes_with_the_losses_of_one_run(tmp_path):
    """every:3steps over 8 steps with max_restarts 2: restarts after steps 3 and 6, then the bound is reached and
    the last process trains on without restarting; the losses equal an uninterrupted run's to the bit."""
    common = ["train.max_steps=8", "train.eval_every=0", "train.checkpoint_every=0"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    Trainer(tiny_config(ref, *common)).fit()  # uninterrupted, in this process
    done = _train(*tiny_overrides(run, *common, "train.restart_on=every:3steps", "train.max_restarts=2"))
    assert done.returncode == 0, done.stderr[-2000:]
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records if r["kind"] == "restart"] == [3, 6]
    assert _losses(run) == _losses(ref) and len(_losses(run)) == 8
    assert "2 restart(s) used (train.max_restarts)" in done.stdout and "restarted 2 time(s)" in done.stdout
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["restart_on"] is None
