"""One strategy vocabulary: every lever is one field of ``Strategy`` and flows through config, planner and bench."""

import dataclasses

import pytest

from memfit.config.loader import load_config
from memfit.config.schema import LoraConfig, RunConfig, run_strategy
from memfit.config.strategy import CheckpointPolicy, Strategy, candidates, levers
from memfit.errors import UserError
from memfit.models.presets import preset_config
from memfit.planner.hardware import gpu_preset
from memfit.planner.search import Cluster, Pins, Workload, search, search_space
from memfit.telemetry.bench import matrix


def test_every_strategy_field_is_a_lever_whose_config_key_exists():
    cfg = RunConfig()
    assert list(levers()) == [f.name for f in dataclasses.fields(Strategy)]
    for name, lever in levers().items():
        section, key = lever.config_key.split(".")
        assert hasattr(getattr(cfg, section), key), (name, lever.config_key)


def test_a_strategy_round_trips_through_train_overrides():
    strategy = Strategy(
        activation_checkpointing=CheckpointPolicy("every_k", 3),
        precision="bf16-pure",
        loss_chunks=8,
        optimizer="for-loop",
        micro_batch_size=4,
        zero_stage=2,
        grad_accum_steps=3,
    )
    cfg = load_config(None, strategy.overrides())
    assert run_strategy(cfg, cfg.strategy.precision, cfg.optimizer.implementation, world_size=2) == strategy
    in_backward = strategy.replace(optimizer_in_backward=True, zero_stage=0, grad_accum_steps=1)
    cfg = load_config(None, in_backward.overrides())  # with what it implies: no global-norm clipping
    assert cfg.optimizer.grad_clip == 0
    assert run_strategy(cfg, cfg.strategy.precision, cfg.optimizer.implementation, world_size=1) == in_backward


def test_one_process_runs_zero_stage_0_whatever_the_config_says():
    cfg = load_config(None, ["distributed.zero_stage=3"])
    assert run_strategy(cfg, "fp32", "foreach", world_size=1).zero_stage == 0


@pytest.mark.parametrize(
    "name, bad",
    [
        ("activation_checkpointing", "some"),
        ("precision", "auto"),
        ("optimizer", "adam"),
        ("optimizer_name", "adam8bit"),
        ("quantize_base", "int4"),
        ("micro_batch_size", "0"),
        ("zero_stage", "4"),
    ],
)
def test_each_lever_parses_user_text_and_names_the_flag_on_error(name, bad):
    lever = levers()[name]
    with pytest.raises(UserError, match=lever.flag or lever.config_key):
        lever.parse(bad, lever.flag or lever.config_key)


def test_candidates_walk_searched_levers_in_field_order_last_fastest():
    combos = list(candidates({"precision": "fp32"}, {"micro_batch_size": (1, 2), "zero_stage": (0,)}))
    given = {"precision": 1, "micro_batch_size": 2, "zero_stage": 1}  # pinned, or narrowed by the caller
    expected = 1
    for name, lever in levers().items():
        expected *= given.get(name, len(lever.searched) or 1)
    # ac, precision, base storage, chunks, activation offload, AdamW, AdamW states, in bwd, optimizer offload,
    # micro, zero
    assert expected == 4 * 1 * 2 * 2 * 2 * 3 * 3 * 2 * 2 * 2 * 1
    assert len(combos) == expected
    assert [c["micro_batch_size"] for c in combos[:2]] == [1, 2]
    assert {c["precision"] for c in combos} == {"fp32"}


def test_planner_candidates_and_bench_cells_are_strategies():
    w = Workload(preset_config("tiny"), "tiny", 64, 8)
    space = search_space(w, Cluster(gpu_preset("h100"), 2), Pins({"optimizer": "fused"}))
    assert all(isinstance(s, Strategy) and s.micro_batch_size * s.grad_accum_steps * 2 == 8 for s in space)
    assert {s.zero_stage for s in space} == {0, 1, 2, 3}
    cells, _ = matrix(
        {"activation_checkpointing": [CheckpointPolicy("ffn")], "precision": ["fp32"], "micro_batch_size": [2]},
        [False],
        [None, 3],
    )
    assert [c.name for c in cells] == ["ac-ffn_fp32_mb2_full", "ac-ffn_fp32_mb2_full_zero3x2"]
    assert cells[1].strategy.zero_stage == 3 and cells[1].nproc == 2


def test_the_search_space_holds_only_strategies_that_combine_on_their_engine():
    """A lever pinned where only some ZeRO stages take it is searched on those alone; the engine decides."""
    w = Workload(preset_config("tiny"), "tiny", 64, 8, LoraConfig(enabled=True))
    two = Cluster(gpu_preset("h100"), 2)
    space = search_space(w, two, Pins({"quantize_base": "nf4"}))
    assert space and {s.zero_stage for s in space} == {0}  # DDP; FSDP2 and ZeroRedundancyOptimizer cannot
    offloaded = search_space(w, two, Pins({"optimizer_offload": True}))
    assert {s.zero_stage for s in offloaded} == {2, 3}  # FSDP2's CPUOffloadPolicy
    for pins in (Pins({"activation_offload": True}, "deepspeed"), Pins({"optimizer_offload": True, "zero_stage": 0})):
        assert search_space(w, two, pins) == []


@pytest.mark.parametrize(
    "levers, engine, gpus, why",
    [
        ({"activation_offload": True}, "deepspeed", 2, "strategy.activation_offload does not reach into DeepSpeed"),
        ({"optimizer_offload": True, "zero_stage": 0}, "fsdp2", 16, "got ddp (16 GPUs, ZeRO-0"),
        ({"optimizer_in_backward": True, "precision": "fp16-mixed"}, "fsdp2", 1, "fp16-mixed's GradScaler"),
    ],
)
def test_pins_that_leave_nothing_to_plan_are_one_line_naming_the_conflict(levers, engine, gpus, why):
    w = Workload(preset_config("tiny"), "tiny", 64, 16)
    with pytest.raises(UserError, match="nothing to plan: ") as e:
        search(w, Cluster(gpu_preset("h100"), gpus), Pins(levers, engine))
    assert why in str(e.value) and "\n" not in str(e.value)


def test_a_switch_is_spelled_alike_in_levers_bench_and_cache_variables(tmp_path, monkeypatch, capsys):
    """``memfit bench --lora yes`` was refused where ``--packing yes`` was taken, and the cache variables kept their
    own list of words: one ``memfit.units.switch`` answers for all of them."""
    from memfit.cache import cache_root
    from memfit.cli import main
    from memfit.units import switch

    packing = levers()["packing"]
    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path))
    for word, on in [("yes", True), (" On", True), ("TRUE", True), ("1", True), ("no", False), ("OFF ", False)]:
        assert switch(word) is on and packing.parse(word, "--packing") is on
        monkeypatch.setenv("MEMFIT_PLAN_CACHE", word)
        assert cache_root("MEMFIT_PLAN_CACHE", "plans") == (tmp_path / "plans" if on else None)
    for word in ("maybe", "2", "", "y"):
        assert switch(word) is None
    with pytest.raises(UserError, match="--packing must be true or false"):
        packing.parse("maybe", "--packing")
    # the --lora list is read before --zero: a refused --zero shows --lora's words were taken
    assert main(["bench", "tiny-cpu", "--lora", "yes,no", "--zero", "9", "--out", str(tmp_path / "b")]) == 2
    assert main(["bench", "tiny-cpu", "--lora", "yes,maybe", "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert "--zero must be comma-separated stages 0-3 or none (got '9')" in err[0]
    assert "--lora must be a comma-separated list of true/false or yes/no (got 'yes,maybe')" in err[1]
    assert not (tmp_path / "b").exists()
