"""`memfit plan --max-seq-len / --max-micro-batch` and the table's merged rows: the limits the search finds are
the edge of fitting (the value fits, one step above does not, each checked by a fresh search at that value), and
rows merge only candidates the plan predicts alike."""

import json
import re

import pytest

from memfit.cli import main
from memfit.models.presets import preset_config
from memfit.planner.hardware import cpu_device, custom_gpu
from memfit.planner.limits import SEQ_STEP, largest_fitting, max_micro_batches, max_seq_lens, run_lockstep
from memfit.planner.search import Cluster, Pins, Workload, search, table_rows
from memfit.units import MIB


def _answer(threshold: int, good: int, bad: int | None, ceiling: int, step: int) -> tuple[int, list[int]]:
    probes: list[int] = []

    def fits(asked):
        probes.extend(v for _, v in asked)
        return [(v <= threshold, (threshold - v) * 1000) for _, v in asked]

    return run_lockstep([largest_fitting(good, bad, ceiling, step)], fits)[0], probes


@pytest.mark.parametrize(
    "threshold, good, bad, ceiling, step, expected",
    [
        (1000, 256, None, 4096, 128, 896),  # doubles to 512, 1024 (fails), then halves the gap in steps of 128
        (5000, 2048, None, 4096, 128, 4096),  # fits at the ceiling: stops there
        (100, 0, 256, 4096, 128, 0),  # does not fit at the requested 256 nor at 128: none
        (300, 0, 1024, 4096, 128, 256),  # searched downwards
        (13, 1, None, 1024, 1, 13),  # micro-batches: every integer
        (2047, 2000, None, 4096, 128, 2000),  # the requested value itself is the answer
    ],
)
def test_largest_fitting_finds_the_edge_of_a_monotone_fit(threshold, good, bad, ceiling, step, expected):
    answer, probes = _answer(threshold, good, bad, ceiling, step)
    assert answer == expected
    assert all(p % step == 0 or p == ceiling for p in probes) and len(probes) == len(set(probes))


@pytest.mark.parametrize("shape", ["linear", "quadratic", "step"])
def test_largest_fitting_is_exact_for_any_monotone_slack(shape):
    """Over many edges and slack curves, the answer is the largest fitting multiple of the step; where memory is
    linear in the value (as tokens are, nearly), the guesses need at most four probes after the doubling."""
    need = {"linear": lambda v: 3 * v, "quadratic": lambda v: v * v // 50, "step": lambda v: 0 if v < 3000 else 10**9}
    for usable in range(500, 60_000, 977):
        truth = max((v for v in range(128, 4097, 128) if need[shape](v) <= usable), default=0)
        probes: list[int] = []

        def fits(asked):
            probes.extend(v for _, v in asked)
            return [(need[shape](v) <= usable, usable - need[shape](v)) for _, v in asked]

        good = 256 if need[shape](256) <= usable else 0
        bad = None if good else 256
        (answer,) = run_lockstep([largest_fitting(good, bad, 4096, 128)], fits)
        assert answer == truth  # where 256 does not fit, the truth is 128 or none, searched downwards
        if shape == "linear" and good and truth < 4096:
            doublings = sum(1 for p in probes if p in (512, 1024, 2048, 4096))
            assert len(probes) - doublings <= 4


def test_lockstep_answers_each_search_as_alone():
    searches = [largest_fitting(1, None, 1024, 1) for _ in range(3)]
    thresholds = [5, 17, 2000]
    rounds = []

    def fits(asked):
        rounds.append(len(asked))
        return [(v <= thresholds[i], thresholds[i] - v) for i, v in asked]

    assert run_lockstep(searches, fits) == [5, 17, 1024]
    assert rounds[0] == 3  # the first probes of all three are asked together


@pytest.fixture(scope="module")
def cpu_plan():
    """A tiny model planned for 1 GiB of CPU memory (no runtime share, so the edge is the tensors' own)."""
    w = Workload(preset_config("tiny"), "tiny", 128, 4)
    pins = Pins({"precision": "fp32", "optimizer": "fused", "optimizer_name": "adamw", "loss_chunks": 0})
    return search(w, Cluster(cpu_device(600 * MIB)), pins, headroom=0.0)


def _fits_alone(r, strategy, seq_len: int) -> bool:
    """A fresh search of exactly this strategy at ``seq_len``: whether it fits."""
    w = Workload(r.workload.model_config, "tiny", seq_len, strategy.micro_batch_size * strategy.grad_accum_steps)
    pins = {name: getattr(strategy, name) for name in ("precision", "optimizer", "optimizer_name", "loss_chunks")}
    pins |= {
        "activation_checkpointing": strategy.activation_checkpointing,
        "micro_batch_size": strategy.micro_batch_size,
        "optimizer_in_backward": strategy.optimizer_in_backward,
    }
    alone = search(w, r.cluster, Pins(pins), headroom=r.headroom)
    (c,) = [c for c in alone.fitting + alone.pruned if c.strategy == strategy]
    return c.fits


def test_max_seq_len_fits_and_one_step_more_does_not(cpu_plan):
    rows = table_rows(cpu_plan.fitting)
    chosen = [rows[0].first, next(r.first for r in rows if str(r.first.strategy.activation_checkpointing) == "full")]
    limits = max_seq_lens(cpu_plan, chosen)
    for c, limit in zip(chosen, limits):
        assert limit.value >= cpu_plan.workload.seq_len and limit.value % SEQ_STEP == 0 and not limit.at_ceiling
        assert _fits_alone(cpu_plan, c.strategy, limit.value)
        assert not _fits_alone(cpu_plan, c.strategy, limit.value + SEQ_STEP)


def test_max_micro_batch_fits_and_one_more_does_not(cpu_plan):
    from memfit.planner.search import evaluate

    chosen = [row.first for row in table_rows(cpu_plan.fitting)[:3]]
    for c, limit in zip(chosen, max_micro_batches(cpu_plan, chosen)):
        assert limit.value >= c.strategy.micro_batch_size and not limit.at_ceiling
        edge = c.strategy.replace(micro_batch_size=limit.value)
        assert evaluate(edge, cpu_plan, cpu_plan.predictor).fits
        assert not evaluate(edge.replace(micro_batch_size=limit.value + 1), cpu_plan, cpu_plan.predictor).fits


def test_rows_merge_only_candidates_predicted_alike(cpu_plan):
    w = Workload(preset_config("tiny"), "tiny", 128, 4)
    r = search(w, Cluster(custom_gpu(1 << 30)), Pins({"precision": "bf16-mixed", "loss_chunks": 0}))
    rows = table_rows(r.fitting)
    members = [c for row in rows for c in row.candidates]
    assert sorted(map(id, members)) == sorted(map(id, r.fitting)) and len(rows) < len(r.fitting)
    assert [row.first for row in rows] == [c for c in r.fitting if any(c is row.first for row in rows)]  # ranked
    for row in rows:
        first = row.first
        differing = {
            name
            for c in row.candidates
            for name, v in c.strategy.as_dict().items()
            if v != first.strategy.as_dict()[name]
        }
        assert len(differing) <= 1
        for c in row.candidates:
            assert (c.reserved_bytes, c.memory.peak, c.host_node_bytes) == (
                first.reserved_bytes,
                first.memory.peak,
                first.host_node_bytes,
            )


def test_plan_cli_shows_the_limits_in_the_table_and_the_json(capsys):
    args = ["plan", "--model", "tiny", "--gpu-mem", "2GiB", "--seq-len", "128", "--global-batch", "2"]
    args += ["--precision", "fp32", "--ac", "full", "--optimizer", "fused", "--optimizer-name", "adamw"]
    assert main([*args, "--max-seq-len", "--max-micro-batch", "--top", "2", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    shown = [c for c in plan["fitting"] if "max_seq_len" in c]
    assert 1 <= len(shown) <= 2 and all(c["max_micro_batch"]["value"] >= c["micro_batch_size"] for c in shown)
    assert all(c["max_seq_len"]["value"] >= 128 for c in shown)
    assert main([*args, "--max-seq-len", "--top", "1"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "max seq" in out and f"in steps of {SEQ_STEP} tokens" in out


def test_plan_cli_says_at_which_length_the_closest_would_fit(capsys):
    args = ["plan", "--model", "tiny", "--gpu-mem", "800MiB", "--seq-len", "1024", "--global-batch", "1"]
    args += ["--precision", "fp32", "--ac", "full", "--optimizer", "fused", "--optimizer-name", "adamw"]
    main([*args, "--max-seq-len"])
    out = " ".join(capsys.readouterr().out.split())
    shorter = [int(n) for n in re.findall(r"it fits at seq (\d+)", out)]
    assert shorter and all(128 <= n < 1024 and n % SEQ_STEP == 0 for n in shorter)


def test_plan_cli_refuses_a_negative_top(capsys):
    args = ["plan", "--model", "tiny", "--device", "cpu", "--seq-len", "64", "--ac", "none", "--top", "-1"]
    assert main(args) == 2 and "--top must be >= 0 (got -1)" in capsys.readouterr().err
