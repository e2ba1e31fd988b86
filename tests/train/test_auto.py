"""`memfit train --auto`: the job and the command line's levers stay, every other memory lever is the plan's; a
replay that runs out passes a row over; nothing that fits is one line and nothing written. The default model with
a memory cap that rules out the default config trains what --auto chose (integration tier)."""

import json
import os
import subprocess
import sys

import pytest
import yaml
from support.tiny import tiny_overrides

from memfit.config.loader import load_config
from memfit.errors import UserError
from memfit.planner.auto import auto_plan, choose, cpu_cluster, pinned_levers
from memfit.units import GIB, MIB


def test_levers_given_on_the_command_line_are_pins_and_auto_is_none():
    cfg = load_config(None, ["optimizer.grad_clip=0"])
    pins = pinned_levers(["strategy.precision=bf16-mixed", "strategy.loss_chunks=auto", "train.max_steps=3"], cfg)
    assert pins == {"precision": "bf16-mixed"}
    clipped = load_config(None, [])  # grad_clip 1.0: the step in backward cannot clip
    assert pinned_levers(["train.micro_batch_size=2"], clipped) == {
        "micro_batch_size": 2,
        "optimizer_in_backward": False,
    }
    with pytest.raises(UserError, match="override strategy.precision=fp8"):
        pinned_levers(["strategy.precision=fp8"], cfg)


FEW = ["strategy.precision=fp32", "strategy.loss_chunks=0", "optimizer.name=adamw"]  # a small search


def _tiny(tmp_path, *extra):
    return load_config(None, tiny_overrides(tmp_path / "run", *extra))


def test_auto_plan_keeps_the_job_and_searches_the_rest(tmp_path):
    cfg = _tiny(tmp_path, "data.seq_len=128", "train.micro_batch_size=4", "train.grad_accum_steps=2")
    overrides = ["strategy.activation_checkpointing=full"]
    result = auto_plan(cfg, overrides, cpu_cluster(1 * GIB, 0))
    w = result.workload
    assert (w.seq_len, w.global_batch, w.lora) == (128, 8, None) and w.model_name == "random:tiny"
    every = result.fitting + result.pruned
    assert {str(c.strategy.activation_checkpointing) for c in every} == {"full"}  # the command line's pin
    assert {c.strategy.micro_batch_size for c in every} == {1, 2, 4, 8}  # the YAML's micro-batch is searched
    assert {c.strategy.precision for c in every} >= {"fp32", "bf16-mixed"}
    assert not any(c.strategy.optimizer_in_backward for c in every)  # the job clips at 1.0
    choice = choose(result)
    assert choice.chosen is result.fitting[0] and choice.row == 1
    again = load_config(None, tiny_overrides(tmp_path / "run") + choice.overrides)
    assert again.train.micro_batch_size * again.train.grad_accum_steps == 8  # the global batch kept
    assert str(again.strategy.activation_checkpointing) == "full"


def test_a_row_the_replay_sees_run_out_gives_way_to_the_next(tmp_path):
    result = auto_plan(_tiny(tmp_path), FEW, cpu_cluster(1 * GIB, 0))
    refused = result.fitting[0].strategy
    choice = choose(result, lambda c: "peak reserved 9 GiB, out of memory" if c.strategy == refused else None)
    assert choice.row == 2 and choice.chosen.strategy != refused
    assert choice.passed_over == [f"row 1 ({refused.label()}): peak reserved 9 GiB, out of memory"]
    with pytest.raises(UserError, match="runs out of memory replaying the first 3 rows"):
        choose(result, lambda c: "out of memory")


def test_nothing_that_fits_is_one_line_with_the_closest_and_its_shortfall(tmp_path):
    result = auto_plan(_tiny(tmp_path), FEW, cpu_cluster(8 * MIB, 0))
    with pytest.raises(UserError) as e:
        choose(result)
    text = str(e.value)
    assert "--auto: nothing fits on cpu" in text and "misses by" in text and "\n" not in text


def _train(*args, traces=None, timeout=900):
    env = dict(os.environ, MEMFIT_TRACE_CACHE=str(traces)) if traces else None  # a cache of this test's own
    return subprocess.run(
        [sys.executable, "-m", "memfit.cli", "train", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.mark.integration
def test_auto_trains_what_fits_a_cap_the_default_config_does_not(tmp_path, embedded_dir):
    """The default job (SmolLM2-135M LoRA, micro-batch 4, fp32, no checkpointing) in 1.5 GiB: its own levers are
    predicted not to fit; --auto picks a row that does, writes the plan and the chosen config, and trains it."""
    run = tmp_path / "run"
    common = [f"output.dir={run}", "train.max_steps=1", "train.eval_every=0", "train.eval_batches=1"]
    narrow = ["strategy.loss_chunks=0", "optimizer.name=adamw", "lora.quantize_base=none"]  # a shorter search
    traces = tmp_path / "traces"  # the second search reads the first's traces
    done = _train("--auto", "--mem", "1.5GiB", *common, *narrow, "train.threads=2", traces=traces)
    assert done.returncode == 0, done.stderr[-2000:]
    plan = json.loads((run / "auto-plan.json").read_text())
    chosen = plan["fitting"][plan["chosen_row"] - 1]
    assert chosen["predicted_reserved_bytes"] <= chosen["usable_bytes"]
    default = [
        c
        for c in plan["fitting"] + plan["pruned"]
        if (c["activation_checkpointing"], c["precision"], c["micro_batch_size"], c["loss_chunks"], c["optimizer"])
        == ("none", "fp32", 4, 0, "foreach")
        and c["optimizer_name"] == "adamw"
    ]
    assert default and not default[0]["fits"]  # the cap rules out the default config
    ran = yaml.safe_load((run / "config.yaml").read_text())
    assert ran["train"]["micro_batch_size"] == chosen["micro_batch_size"]
    assert ran["strategy"]["activation_checkpointing"] == chosen["activation_checkpointing"]
    assert ran["train"]["micro_batch_size"] * ran["train"]["grad_accum_steps"] == 4  # the default's global batch
    assert "--auto: training row" in done.stdout and "--auto: step time predicted" in done.stdout
    assert plan["predicted_step_time_s"] > 0 and plan["measured_median_step_time_s"] > 0

    nothing = tmp_path / "nothing"
    refused = _train("--auto", "--mem", "300MiB", f"output.dir={nothing}", "train.max_steps=1", *FEW, traces=traces)
    assert refused.returncode == 2 and "--auto: nothing fits on cpu" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and not nothing.exists()
    assert any(traces.rglob("*")), "the searches shared no trace cache"


def test_auto_mem_above_this_machines_memory_is_noted():
    """``--auto --mem 64GiB`` on a 24 GiB machine planned for 64 GiB without a word; a run it chose could not fit."""
    from memfit.commands.train import more_than_here

    said = more_than_here("64GiB", 64 * GIB, 24 * GIB)
    assert (
        said
        == "note: --mem 64GiB is more than this machine's 24.0 GiB: a candidate planned to fit in it may not fit here"
    )
    assert more_than_here("8GiB", 8 * GIB, 24 * GIB) is None and more_than_here("8GiB", 8 * GIB, 0) is None
