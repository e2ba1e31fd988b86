"""Distributed pieces that need no second process: launch checks, torchrun arguments, DeepSpeed JSON
reconciliation, checkpoint compatibility, and the FSDP2 root-group share."""

from __future__ import annotations

import json
import signal
import sys

import pytest
import torch

from memfit.cli import main
from memfit.config.loader import load_config
from memfit.config.schema import grad_accum_steps
from memfit.config.shipped import shipped_configs
from memfit.distributed.deepspeed_engine import reconcile, require_deepspeed, resolve_ds_path
from memfit.distributed.launch import LaunchSpec, check_launch, describe_failure, torchrun_args
from memfit.errors import UserError
from memfit.models.presets import preset_config
from memfit.planner.sharding import root_fraction
from memfit.strategies.precision import precision_policy
from memfit.train.checkpoint import TrainerState
from memfit.train.sharded_checkpoint import check_compatible


def _cfg(*overrides):
    return load_config(shipped_configs()["tiny-cpu"], list(overrides))


def test_global_batch_sets_accumulation_per_world_size():
    cfg = _cfg("train.micro_batch_size=2", "train.global_batch_size=16")
    assert [grad_accum_steps(cfg, n) for n in (1, 2, 4, 8)] == [8, 4, 2, 1]
    with pytest.raises(
        UserError,
        match=r"train.global_batch_size 16 is not divisible by world size 3 x "
        r"train.micro_batch_size 2 = 6",
    ):
        grad_accum_steps(cfg, 3)
    conflicting = _cfg("train.micro_batch_size=2", "train.global_batch_size=16", "train.grad_accum_steps=3")
    with pytest.raises(UserError, match="train.grad_accum_steps 3 disagrees with train.global_batch_size 16"):
        grad_accum_steps(conflicting, 2)
    assert grad_accum_steps(_cfg("train.grad_accum_steps=3"), 4) == 3  # no global batch: per rank as given


def test_launch_checks_fail_before_any_rank_starts(capsys):
    cfg = _cfg("train.micro_batch_size=4", "train.global_batch_size=12")
    with pytest.raises(UserError, match="not divisible by world size 2"):
        check_launch(LaunchSpec(2), cfg)
    with pytest.raises(UserError, match="--rdzv-endpoint"):
        check_launch(LaunchSpec(1, nnodes=2), _cfg())
    with pytest.raises(UserError, match="--node-rank must be in 0..1"):
        check_launch(LaunchSpec(1, nnodes=2, node_rank=2, rdzv_endpoint="127.0.0.1:29400"), _cfg())
    for endpoint in (
        "nonsense",
        "127.0.0.1:99999",
        ":29400",
        "host:port",
        "127.0.0.1:0",
    ):  # 99999 was torchrun's traceback
        with pytest.raises(
            UserError, match=f"--rdzv-endpoint must be HOST:PORT with a port in 1..65535 \\(got '{endpoint}'"
        ):
            check_launch(LaunchSpec(2, rdzv_endpoint=endpoint), _cfg())
    code = main(
        ["train", "tiny-cpu", "train.micro_batch_size=4", "train.global_batch_size=12", "--nproc-per-node", "2"]
    )
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("memfit: error: train.global_batch_size 12 is not divisible")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["optimizer.in_backward=true", "optimizer.grad_clip=0"], "on 2 ranks (fsdp2) the gradient is not reduced"),
        (["distributed.zero_stage=3", "lora.enabled=true", "lora.quantize_base=nf4"], "(got fsdp2, ZeRO-3)"),
        (["train.device=cuda:7"], "train.device is 'cuda:7' but"),
        (
            ["distributed.engine=deepspeed", "distributed.deepspeed_config=ds-zero2-article"],
            "train_micro_batch_size_per_gpu is 1 but train.micro_batch_size is 4",
        ),
    ],
    ids=["step-in-backward", "nf4-zero3", "no-such-gpu", "deepspeed-json"],
)
def test_levers_every_rank_would_refuse_are_refused_once_before_torchrun(capsys, overrides, message):
    if torch.cuda.device_count() > 7 and overrides == ["train.device=cuda:7"]:
        pytest.skip("this machine has a cuda:7")
    assert main(["train", "tiny-cpu", *overrides, "--nproc-per-node", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_torchrun_arguments_for_one_and_several_nodes(tmp_path):
    cfg = _cfg(f"output.dir={tmp_path}")
    one = torchrun_args(LaunchSpec(2), cfg, tmp_path / "c.yaml", ["train.max_steps=3"])
    assert "--standalone" in one and one[-4:] == ["-m", "memfit.train", str(tmp_path / "c.yaml"), "train.max_steps=3"]
    assert one[one.index("--max-restarts") + 1] == "0"
    two = torchrun_args(LaunchSpec(1, 2, 1, "10.0.0.1:29400"), cfg, tmp_path / "c.yaml", [])
    assert "--standalone" not in two
    assert two[two.index("--rdzv-backend") + 1] == "c10d"
    assert two[two.index("--rdzv-endpoint") + 1] == "10.0.0.1:29400"
    assert two[two.index("--node-rank") + 1] == "1"
    # every node derives the same rendezvous id from the run directory
    assert (
        two[two.index("--rdzv-id") + 1]
        == torchrun_args(LaunchSpec(1, 2, 0, "10.0.0.1:29400"), cfg, tmp_path, [])[two.index("--rdzv-id") + 1]
    )


def test_failure_descriptions_name_rank_pid_and_signal():
    assert describe_failure(1, -signal.SIGKILL, 4242) == "rank 1 (pid 4242) was killed by SIGKILL"
    assert describe_failure(0, 1, 7) == "rank 0 (pid 7) exited with code 1"


def _ds_cfg(*overrides):
    return load_config(shipped_configs()["llama2-7b-full-ds-zero2"], list(overrides))


def test_the_articles_deepspeed_json_reconciles_with_its_config():
    path = resolve_ds_path("ds-zero2-article")
    ds = reconcile(path, _ds_cfg(), precision_policy("bf16-mixed"), world_size=4, accum=4)
    assert ds["train_batch_size"] == 16  # filled in: 4 ranks x micro-batch 1 x accumulation 4
    assert ds["zero_optimization"]["contiguous_gradients"] is True and ds["zero_optimization"]["overlap_comm"] is False
    assert ds["bf16"]["enabled"] is True and ds["fp16"]["enabled"] is False
    assert json.loads(path.read_text())["gradient_accumulation_steps"] == 4  # the user's file is not touched


@pytest.mark.parametrize(
    "change, message",
    [
        ({"train_micro_batch_size_per_gpu": 2}, "train_micro_batch_size_per_gpu is 2 but train.micro_batch_size is 1"),
        ({"gradient_accumulation_steps": 8}, "gradient_accumulation_steps is 8 but train.grad_accum_steps"),
        ({"bf16": {"enabled": False}}, "bf16.enabled is false but strategy.precision bf16-mixed means true; make"),
        ({"zero_optimization": {"stage": 1}}, "zero_optimization.stage is 1 but distributed.zero_stage is 2"),
        ({"gradient_clipping": 0.5}, "gradient_clipping is 0.5 but optimizer.grad_clip is 1.0"),
        ({"scheduler": {"type": "WarmupLR"}}, "'scheduler' section (WarmupLR)"),
        (
            {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}},
            "optimizer.params.lr is 0.0001 but optimizer.lr is 2e-05",
        ),
        ({"optimizer": {"type": "SGD"}}, "optimizer.type is 'sgd'"),
        ({"zero_optimization": 2}, "zero_optimization must be a JSON object (got 2)"),
        ({"optimizer": {"type": "AdamW", "params": []}}, "optimizer.params must be a JSON object (got [])"),
    ],
)
def test_deepspeed_json_conflicts_name_both_values(tmp_path, change, message):
    ds = json.loads(resolve_ds_path("ds-zero2-article").read_text())
    ds.update(change)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    with pytest.raises(UserError) as e:
        reconcile(path, _ds_cfg(), precision_policy("bf16-mixed"), world_size=4, accum=4)
    assert message in str(e.value) and str(path) in str(e.value)


def test_deepspeed_auto_values_are_filled_and_stage_0_is_sent_to_ddp(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": "auto",
                "zero_optimization": {"stage": "auto"},
                "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": [0.9, 0.95]}},
            }
        )
    )
    ds = reconcile(path, _ds_cfg(), precision_policy("bf16-mixed"), world_size=2, accum=4)
    assert ds["train_micro_batch_size_per_gpu"] == 1 and ds["zero_optimization"]["stage"] == 2
    assert "optimizer" not in ds  # checked, then memfit's own AdamW is the client optimizer
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    assert (
        reconcile(path, _ds_cfg("distributed.zero_stage=3"), precision_policy("bf16-mixed"), world_size=2, accum=4)[
            "zero_optimization"
        ]["stage"]
        == 3
    )
    path.write_text(json.dumps({"zero_optimization": {"stage": 0}}))
    with pytest.raises(UserError, match="distributed.engine=fsdp2 distributed.zero_stage=0"):
        reconcile(path, _ds_cfg("distributed.zero_stage=0"), precision_policy("bf16-mixed"), world_size=2, accum=4)


def test_missing_deepspeed_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed now raises ImportError
    with pytest.raises(UserError, match=r"pip install 'memfit\[deepspeed\]'"):
        require_deepspeed()
    with pytest.raises(UserError, match="memfit.deepspeed"):
        check_launch(LaunchSpec(2), _ds_cfg())


def test_resume_refuses_another_world_size_or_engine(tmp_path):
    TrainerState(step=4, micro_batches=8, tokens_seen=100, world_size=2, engine="fsdp2").write(tmp_path)
    assert check_compatible(tmp_path, 2, "fsdp2").step == 4
    with pytest.raises(UserError, match=r"written by 2 rank\(s\) but this run has 4.*--nnodes = 2"):
        check_compatible(tmp_path, 4, "fsdp2")
    with pytest.raises(UserError, match="written by engine 'fsdp2' but this run uses 'zero1'"):
        check_compatible(tmp_path, 2, "zero1")


@pytest.mark.parametrize("preset", ["llama2-7b", "llama3-8b", "smollm2-135m"])
def test_root_group_share_matches_the_built_model(preset):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(preset_config(preset))
    total = sum(p.numel() for p in model.parameters())  # tied weights are listed once
    in_layers = sum(p.numel() for p in model.model.layers.parameters())
    assert root_fraction(model.config) == pytest.approx((total - in_layers) / total, rel=1e-9)


def test_a_conflict_with_what_a_setting_means_is_written_as_json(tmp_path):
    """``offload_optimizer.device is 'none' but optimizer.offload (true) is 'cpu'`` mixed Python's quoting into a JSON
    file's values (and ``True``/``False`` for its booleans)."""
    ds = json.loads(resolve_ds_path("ds-zero2-article").read_text())
    ds["zero_optimization"]["offload_optimizer"] = {"device": "none"}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    with pytest.raises(UserError) as e:
        reconcile(path, _ds_cfg("optimizer.offload=true"), precision_policy("bf16-mixed"), world_size=4, accum=4)
    assert str(e.value) == (
        f'{path}: zero_optimization.offload_optimizer.device is "none" but optimizer.offload true means "cpu"; make '
        "them agree (or drop it from the JSON)"
    )
