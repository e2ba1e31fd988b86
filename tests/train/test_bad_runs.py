"""Bad input and bad numbers end in one clear line, with nothing half-written."""

import pytest

from memfit.cli import main
from memfit.config.loader import load_config
from memfit.errors import UserError
from memfit.train.loop import Trainer


@pytest.mark.parametrize("override", ["optimizer.lr=inf", "optimizer.lr=.nan", "optimizer.eps=inf", "lora.alpha=inf"])
def test_non_finite_hyperparameters_are_refused_at_config_load(override):
    with pytest.raises(UserError, match=rf"{override.split('=')[0]} must be"):
        load_config(None, [override])


def test_a_run_that_goes_non_finite_stops_before_checkpointing_or_exporting_it(tiny_cfg, tmp_path):
    trainer = Trainer(tiny_cfg("optimizer.lr=1e30", "optimizer.warmup_steps=0", "train.checkpoint_every=1"))
    with pytest.raises(UserError, match=r"step \d+: the loss is .* nothing of it is checkpointed or exported"):
        trainer.fit()
    trainer.close()
    run = trainer.run
    assert not run.export.exists()
    steps = sorted(p.name for p in run.checkpoints.glob("step_*")) if run.checkpoints.exists() else []
    assert all(int(name.split("_")[1]) < 3 for name in steps), steps  # none of a non-finite step


@pytest.mark.parametrize(
    "args, message",
    [
        (["--steps", "0"], "--steps must be >= 1"),
        (["--micro-batch", "0"], "--micro-batch must be > 0"),
        (["--ac", ","], "--ac needs at least one value"),
        (["--precision", "fp8"], "--precision must be one of"),
        (["--micro-batch", "3", "--global-batch", "4"], "--global-batch 4 is not a positive multiple of micro-batch 3"),
    ],
)
def test_bench_refuses_a_bad_matrix_before_writing_anything(tmp_path, capsys, args, message):
    out = tmp_path / "bench"
    assert main(["bench", "tiny-cpu", *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not out.exists()


def test_plan_refuses_a_zero_sequence_length(capsys):
    assert main(["plan", "--model", "tiny", "--gpu", "mi210", "--seq-len", "0"]) == 2
    assert "--seq-len and --global-batch must be > 0 (got 0" in capsys.readouterr().err


def test_exporter_refuses_a_port_out_of_range(capsys):
    assert main(["exporter", "--port", "70000"]) == 2
    assert "--port must be in 0..65535 (got 70000)" in capsys.readouterr().err


def test_resume_with_nothing_to_resume_says_so(tiny_cfg):
    trainer = Trainer(tiny_cfg("train.resume=true", "train.max_steps=1"))
    try:
        assert any("train.resume=true but" in n and "holds no checkpoint yet" in n for n in trainer.notes)
    finally:
        trainer.close()
