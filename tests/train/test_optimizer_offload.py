"""The offloaded optimizer (optimizer.offload): the planner's device and host bytes against the profiler on real
tensors, the losses against the optimizer on the device, resume, the plan's host-memory check, and the refusals."""

import pytest
import torch
from support.tiny import wide_tiny_config

from memfit.config.schema import LoraConfig, OptimizerConfig
from memfit.config.strategy import CheckpointPolicy, Strategy
from memfit.errors import UserError
from memfit.models.presets import preset_config
from memfit.planner.categories import DEVICE_CATEGORIES, Category
from memfit.planner.hardware import gpu_preset
from memfit.planner.measure import measured_steady_step
from memfit.planner.predict import Predictor
from memfit.planner.search import Cluster, Pins, Workload, search
from memfit.planner.trace import StepSpec, trace_step
from memfit.strategies.host_optimizer import HostOffloadOptimizer, host_tensors
from memfit.strategies.optimizer import build_optimizer
from memfit.train.loop import Trainer

CPU = torch.device("cpu")


def _strategy(precision: str, optimizer: str, **more) -> Strategy:
    return Strategy(precision=precision, optimizer=optimizer, optimizer_offload=True, micro_batch_size=2, **more)


@pytest.mark.parametrize(
    "precision, optimizer, lora, more",
    [
        ("fp32", "foreach", False, {}),
        ("bf16-mixed", "fused", False, {}),
        ("bf16-pure", "for-loop", False, {"grad_accum_steps": 2}),
        ("bf16-mixed", "foreach", True, {"activation_checkpointing": CheckpointPolicy("full")}),
    ],
)
def test_the_planner_predicts_device_and_host_bytes_as_the_profiler_measures_them(precision, optimizer, lora, more):
    """A 6-layer wide tiny model, predicted as ``memfit plan`` predicts a GPU (shallow traces extrapolated, the
    optimizer step traced on its own, host storages apart) against torch.profiler on real CPU tensors with the
    host's blocks set apart: every device category within 1% (measured: equal to the byte but for LoRA's
    temporaries, 224 bytes), the host state (masters, gradient copies, AdamW state) equal, and the host peak
    (with the host step's temporaries: foreach makes some, fused none) within 1%. On the device there is no
    optimizer state at all."""
    cfg = wide_tiny_config(6)
    strategy = _strategy(precision, optimizer, **more)
    spec = StepSpec(cfg, 128, strategy, lora=LoraConfig() if lora else None, round_to=1, host_is_device=False)
    predicted = Predictor(spec).predict(strategy)
    measured = measured_steady_step(spec)
    for c in DEVICE_CATEGORIES:
        assert abs(predicted.peak[c] - measured[c]) <= 0.01 * max(measured[c], 1 << 10), (c, predicted.peak, measured)
    assert predicted.peak[Category.OPTIMIZER] == measured[Category.OPTIMIZER] == 0
    assert predicted.peak[Category.HOST_STATE] == measured[Category.HOST_STATE] > 0
    assert abs(predicted.host_peak_bytes - measured.host_bytes) <= 0.01 * measured.host_bytes


def test_on_a_cpu_run_the_host_state_is_counted_in_the_one_memory_there_is():
    """A CPU run offloads into the memory it already uses: the planner (host_is_device) counts the masters,
    gradient copies and state as optimizer bytes of that memory, with no host column, as the profiler does."""
    strategy = _strategy("fp32", "fused")
    spec = StepSpec(wide_tiny_config(4), 128, strategy, host_is_device=True)
    predicted, measured = trace_step(spec), measured_steady_step(spec)
    assert predicted.host_peak_bytes == 0 and measured.host_bytes == 0
    for c in Category:
        assert abs(predicted.peak[c] - measured[c]) <= 0.01 * max(measured[c], 1 << 10), (c, predicted.peak, measured)
    on_device = measured_steady_step(StepSpec(wide_tiny_config(4), 128, strategy.replace(optimizer_offload=False)))
    # the state itself plus a host master and a gradient copy of every (trainable) weight
    assert measured[Category.OPTIMIZER] == on_device[Category.OPTIMIZER] + 2 * on_device[Category.PARAMS]


def test_offloading_moves_the_whole_state_and_the_step_off_the_device():
    """Predicted for a GPU (the wide tiny model, full fine-tune in fp32): the device peak loses the AdamW state
    (two fp32 moments per weight, and a step count per tensor) and the host holds the state, a master and a
    gradient copy per weight."""
    cfg = wide_tiny_config(6)
    base = StepSpec(cfg, 128, round_to=1)
    on = Predictor(base).predict(_strategy("fp32", "fused"))
    off = Predictor(base).predict(_strategy("fp32", "fused").replace(optimizer_offload=False))
    weights = off.phase_peaks["optimizer"][Category.PARAMS]
    counts = off.phase_peaks["forward"][Category.OPTIMIZER] - 2 * weights
    assert 0 < counts <= 4 * 64  # one fp32 step count per tensor
    assert on.phase_peaks["forward"][Category.OPTIMIZER] == 0
    assert on.peak[Category.HOST_STATE] == 4 * weights + counts
    assert on.peak_bytes < off.peak_bytes - 2 * weights * 0.9


def _losses(tiny_cfg, out, *extra):
    trainer = Trainer(tiny_cfg("train.max_steps=4", "train.eval_every=0", f"output.dir={out}", *extra))
    try:
        result = trainer.fit()
        assert result.summary.predicted_peak_bytes and result.summary.predicted_step_time_s  # the fit check ran
        return [r["loss"] for r in result.steps]
    finally:
        trainer.close()


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_offloaded_steps_give_the_losses_of_the_optimizer_on_the_device(tiny_cfg, precision, tmp_path):
    """The same AdamW update, run on host copies: with the same implementation (for-loop) the tiny model's
    losses over four clipped steps are equal to the bit, in fp32 and in bf16-mixed."""
    common = ("lora.enabled=false", f"strategy.precision={precision}", "optimizer.implementation=for-loop")
    offloaded = _losses(tiny_cfg, tmp_path / "host", *common, "optimizer.offload=true")
    assert offloaded == _losses(tiny_cfg, tmp_path / "device", *common)


def test_an_offloaded_run_resumes_exactly_and_its_state_dict_is_the_plain_optimizers(tiny_cfg, tmp_path):
    """Six steps with checkpoints every two; cut back to step 4 and resumed, steps 5 and 6 repeat to the bit.
    The saved state has the layout of the same AdamW on the device (the state of each parameter by index)."""
    run = ("lora.enabled=false", "optimizer.offload=true", "train.max_steps=6", "train.eval_every=0")
    out = f"output.dir={tmp_path}/k"
    trainer = Trainer(tiny_cfg(*run, "train.checkpoint_every=2", out))
    try:
        whole = {r["step"]: r["loss"] for r in trainer.fit().steps}
        saved = trainer.optimizer.state_dict()
    finally:
        trainer.close()
    for ckpt in (tmp_path / "k" / "checkpoints").glob("step_*"):
        if int(ckpt.name.split("_")[1]) > 4:
            for f in ckpt.iterdir():
                f.unlink()
            ckpt.rmdir()
    trainer = Trainer(tiny_cfg(*run, "train.checkpoint_every=2", "train.resume=true", out))
    try:
        rest = {r["step"]: r["loss"] for r in trainer.fit().steps}
    finally:
        trainer.close()
    assert rest == {s: whole[s] for s in (5, 6)}
    assert set(saved["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert all(v.device.type == "cpu" for s in saved["state"].values() for v in s.values())


def test_load_state_dict_refuses_another_models_groups():
    params = [torch.nn.Parameter(torch.zeros(4, 4)), torch.nn.Parameter(torch.zeros(4))]
    opt = build_optimizer(params, OptimizerConfig(offload=True), CPU)
    assert isinstance(opt, HostOffloadOptimizer) and host_tensors(opt) == []
    other = build_optimizer(params[:1], OptimizerConfig(offload=True), CPU)
    with pytest.raises(ValueError, match="other parameter groups"):
        opt.load_state_dict(other.state_dict())


def test_the_plan_refuses_a_candidate_whose_host_memory_does_not_fit_naming_the_bytes():
    """Pinned to the offloaded optimizer, the tiny preset's full fine-tune fits a tiny GPU only while the host
    has room for its state: with a host smaller than that, nothing fits and the reason names both sizes."""
    w = Workload(preset_config("tiny"), "tiny", 64, 2)
    pins = Pins(
        {"optimizer_offload": True, "precision": "bf16-mixed", "activation_checkpointing": CheckpointPolicy("full")}
    )
    roomy = search(w, Cluster(gpu_preset("h100"), host_mem_bytes=64 << 30), pins)
    best = roomy.best
    assert best is not None and best.strategy.optimizer_offload and best.host_node_bytes > 0
    assert best.memory.peak[Category.OPTIMIZER] == 0
    tight = search(w, Cluster(gpu_preset("h100"), host_mem_bytes=best.host_node_bytes // 2), pins)
    assert tight.best is None
    reason = tight.pruned[0].why_not()
    assert "host memory per node" in reason and "--host-mem" in reason


@pytest.mark.parametrize(
    "strategy, world, engine, needle",
    [
        (Strategy(optimizer_offload=True, optimizer_in_backward=True), 1, "single", "optimizer.in_backward"),
        (Strategy(optimizer_offload=True), 2, "ddp", "CPUOffloadPolicy"),
        (Strategy(optimizer_offload=True, zero_stage=1), 2, "zero1", "offload_optimizer"),
    ],
)
def test_combinations_that_cannot_run_are_one_line(strategy, world, engine, needle):
    why = strategy.conflict(world_size=world, engine=engine)
    assert why is not None and needle in why and "\n" not in why
    for engine, stage in (("fsdp2", 2), ("fsdp2", 3), ("deepspeed", 2)):
        assert Strategy(optimizer_offload=True, zero_stage=stage).conflict(world_size=2, engine=engine) is None


def test_on_two_gpus_fsdp2_offloads_each_ranks_shards_and_ddp_is_not_searched():
    """Pinned to the offloaded optimizer on 2 GPUs: only ZeRO-2/3 candidates (FSDP2's CPUOffloadPolicy); each rank's
    device holds no optimizer state and none of its sharded weights in the step (the gathered ones come and go), and
    its host holds the shards: half of the single GPU's weights, gradients and state each."""
    w = Workload(preset_config("tiny"), "tiny", 64, 4)
    pins = Pins({"optimizer_offload": True, "precision": "fp32", "activation_checkpointing": CheckpointPolicy("none")})
    result = search(w, Cluster(gpu_preset("h100"), 2, host_mem_bytes=64 << 30), pins)
    assert result.fitting and {c.strategy.zero_stage for c in (*result.fitting, *result.pruned)} == {2, 3}
    one = search(
        w.__class__(w.model_config, "tiny", 64, 2),
        Cluster(gpu_preset("h100")),
        Pins({**pins.levers, "optimizer_offload": False}),
    ).best
    at_step = one.memory.phase_peaks["optimizer"]  # on one GPU, the state on the device
    single_state = sum(at_step[c] for c in (Category.PARAMS, Category.GRADS, Category.OPTIMIZER))
    for c in result.fitting:
        optimizer = c.memory.phase_peaks["optimizer"]
        assert optimizer[Category.OPTIMIZER] == optimizer[Category.PARAMS] == 0
        assert abs(optimizer[Category.HOST_STATE] - single_state / 2) <= 0.01 * single_state
        assert c.host_node_bytes == 2 * c.memory.host_peak_bytes


def test_an_offloaded_step_in_backward_is_refused_before_anything_starts(tiny_cfg):
    with pytest.raises(UserError, match="optimizer.offload"):
        Trainer(tiny_cfg("optimizer.offload=true", "optimizer.in_backward=true", "optimizer.grad_clip=0"))


def test_a_cpu_runs_summary_counts_the_offloaded_copies_as_optimizer_state():
    """On a CPU run the offloaded optimizer's masters and gradient copies are optimizer state of the one memory (as
    the planner counts them there): the state plus two copies of every trained weight, and nothing host-apart."""
    from memfit.telemetry.readings import state_bytes

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    opt = build_optimizer(list(model.parameters()), OptimizerConfig(offload=True), CPU)
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    held = state_bytes(model, opt)
    weights = sum(p.numel() * 4 for p in model.parameters())
    counts = 4 * 4  # one fp32 step count per tensor
    assert held.optimizer_bytes == 2 * weights + counts + 2 * weights
    assert held.host_bytes == held.host_counted_bytes == 0
    assert held.total_bytes == held.params_bytes + held.grads_bytes + held.optimizer_bytes
    plain = build_optimizer(list(model.parameters()), OptimizerConfig(), CPU)
    plain.step()
    assert state_bytes(model, plain).optimizer_bytes == 2 * weights + counts  # AdamW on the device: its state


def test_memfit_plan_names_the_host_memory_that_would_make_it_fit_and_writes_deepspeeds_offload(capsys, tmp_path):
    """The tiny preset pinned to the offloaded optimizer with 1 MiB of host memory: one line that names the host
    memory per node that would do (exit 2); with enough, the JSON carries each candidate's host bytes, and a
    DeepSpeed JSON written for the winner offloads its optimizer, which --deepspeed reads back as the pin."""
    import json

    from memfit.cli import main

    base = ["plan", "--model", "tiny", "--gpu", "h100", "--seq-len", "64", "--global-batch", "2"]
    assert main([*base, "--optimizer-offload", "true", "--host-mem", "1MiB"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "GiB of host memory per node >" in err and "with --host-mem 1GiB," in err
    ds = tmp_path / "ds.json"
    code = main([*base, "--optimizer-offload", "true", "--host-mem", "8GiB", "--json", "--write-deepspeed", str(ds)])
    out = capsys.readouterr().out
    assert code == 0
    plan = json.loads(out.splitlines()[0])
    assert plan["host_mem_bytes"] == 8 << 30
    assert all(c["host_node_bytes"] == c["host_peak_bytes"] > 0 for c in plan["fitting"])
    assert json.loads(ds.read_text())["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert main(["plan", "--model", "tiny", "--gpu", "h100", "--seq-len", "64", "--deepspeed", str(ds), "--json"]) == 0
    again = json.loads(capsys.readouterr().out.splitlines()[0])
    assert all(c["optimizer_offload"] for c in again["fitting"])


def test_planned_for_a_gpu_the_pinned_copies_are_rounded_as_pytorchs_pinned_allocator_rounds_them():
    """PyTorch's pinned host allocator rounds every block up to a power of two (CachingHostAllocator), and the
    offloaded optimizer pins its masters and gradient buffers: planned for a GPU (512-byte device rounding), each
    of those two per trained tensor is its power-of-two ceiling; the AdamW state (not pinned) is exact."""
    cfg = preset_config("tiny")  # its 49,152 x 64 embedding is not a power of two
    strategy = _strategy("fp32", "fused")
    exact = Predictor(StepSpec(cfg, 64, round_to=1)).predict(strategy).peak[Category.HOST_STATE]
    gpu = Predictor(StepSpec(cfg, 64, round_to=512)).predict(strategy).peak[Category.HOST_STATE]
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    sizes = [p.numel() * 4 for p in {id(p): p for p in model.parameters()}.values()]
    assert gpu - exact == sum(2 * ((1 << (n - 1).bit_length()) - n) for n in sizes) > 0


def test_the_trainers_fit_check_refuses_host_memory_the_node_has_not_got():
    """On a GPU the fit check sums the node's ranks' predicted host peaks against the memory available now."""
    from memfit.planner.categories import Breakdown, StepMemory
    from memfit.train.fit_check import check_host_fits

    step = StepMemory(Breakdown({}), {"optimizer": Breakdown({})}, "optimizer", host_peak_bytes=3 << 30)
    check_host_fits(step, 1, 5 << 30)
    check_host_fits(step, 8, None)  # not known: not checked
    with pytest.raises(UserError, match=r"6\.00 GiB of host memory \(2 rank\(s\) x 3\.00 GiB offloaded\).* 5\.00 GiB"):
        check_host_fits(step, 2, 5 << 30)


def test_the_search_tries_the_host_optimizer_only_where_the_state_on_the_device_does_not_fit():
    """The 12-layer wide tiny full fine-tune on a GPU without bf16, 32-bit AdamW pinned: with room for the state
    on the device no offloaded candidate is traced; with a byte less than the smallest plain candidate needs,
    only offloaded candidates fit."""
    import dataclasses

    w = Workload(wide_tiny_config(12), "wide-tiny", 128, 2)
    pins = Pins(
        {"activation_checkpointing": CheckpointPolicy("full"), "loss_chunks": 0, "micro_batch_size": 1}
        | {"optimizer_name": "adamw"}
    )

    def plan(memory_bytes: int):
        gpu = dataclasses.replace(gpu_preset("t4"), memory_bytes=int(memory_bytes))
        return search(w, Cluster(gpu, host_mem_bytes=64 << 30), pins, headroom=0.0)

    roomy = plan(16 << 30)
    assert not any(c.strategy.optimizer_offload for c in roomy.fitting + roomy.pruned)
    tight = plan(min(c.reserved_bytes for c in roomy.fitting) - 1)
    assert tight.fitting and all(c.strategy.optimizer_offload for c in tight.fitting)
    assert tight.best.memory.peak[Category.OPTIMIZER] == 0 and tight.best.host_node_bytes > 0


@pytest.mark.parametrize(
    "zero, want",
    [
        ({"cpu_offload": True}, (True, False)),  # deprecated booleans, read as DeepSpeed reads them
        ({"cpu_offload": False, "cpu_offload_param": True}, (False, True)),
        ({"offload_optimizer": {"device": "none"}, "offload_param": {}}, (False, False)),
        ({"offload_optimizer": {"device": "cpu", "ratio": 1.0}}, (True, False)),
    ],
)
def test_deepspeeds_offload_keys_are_read_as_deepspeed_reads_them(zero, want):
    from memfit.distributed.deepspeed_engine import modern_offload_keys, offloaded

    ds = {"zero_optimization": {"stage": 3, **zero}}
    assert offloaded(ds, "ds.json") == want
    modern_offload_keys(ds)
    assert not {"cpu_offload", "cpu_offload_param"} & ds["zero_optimization"].keys()
    assert offloaded(ds, "ds.json") == want  # the sections they stand for say the same


@pytest.mark.parametrize(
    "zero, needle",
    [
        ({"offload_optimizer": {"device": "CPU"}}, 'offload_optimizer.device is "CPU"; DeepSpeed takes none | cpu'),
        ({"offload_param": {"device": "nvme"}}, "offload_param.device nvme: memfit plans host memory only"),
        ({"cpu_offload": True, "offload_optimizer": {"device": "cpu"}}, "cpu_offload (deprecated) and zero_opt"),
        ({"cpu_offload_param": "yes"}, 'cpu_offload_param must be true or false (got "yes")'),
        ({"offload_optimizer": {"device": "cpu", "ratio": 0.3}}, "offload_optimizer.ratio 0.3: memfit plans"),
    ],
)
def test_deepspeed_offloads_memfit_cannot_plan_are_one_line_in_plan_and_train(tmp_path, capsys, zero, needle):
    import json

    from support.tiny import tiny_config

    from memfit.cli import main

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3, **zero}}))
    args = ["plan", "--model", "tiny", "--gpu", "h100", "--gpus-per-node", "2", "--seq-len", "64", "--deepspeed"]
    assert main([*args, str(ds)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and needle in err, err
    cfg = tiny_config(
        tmp_path / "run",
        "distributed.engine=deepspeed",
        "distributed.zero_stage=3",
        f"distributed.deepspeed_config={ds}",
    )
    from memfit.train.levers import run_levers

    with pytest.raises(UserError, match="ds.json: zero_optimization"):
        run_levers(cfg, CPU, 2)


def test_a_deprecated_cpu_offload_is_filled_in_as_its_section_and_agrees_with_optimizer_offload(tmp_path):
    """The JSON DeepSpeed is given: ``cpu_offload`` false beside optimizer.offload=true became both keys, which
    DeepSpeed refuses; now the section alone, offloading, as memfit's config asks."""
    import json

    from support.tiny import tiny_config

    from memfit.distributed.deepspeed_engine import reconcile
    from memfit.strategies.precision import precision_policy

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2, "cpu_offload": False}}))
    cfg = tiny_config(
        tmp_path / "run",
        "distributed.engine=deepspeed",
        "distributed.zero_stage=2",
        "optimizer.offload=true",
        f"distributed.deepspeed_config={ds}",
    )
    got = reconcile(ds, cfg, precision_policy("fp32"), 2, 1)["zero_optimization"]
    assert "cpu_offload" not in got and got["offload_optimizer"] == {"device": "cpu"}


def test_a_plan_says_deepspeed_ignores_offload_param_below_zero3_and_plans_it_so(tmp_path, capsys):
    import json

    from memfit.cli import main

    args = ["plan", "--model", "tiny", "--gpu", "h100", "--gpus-per-node", "2", "--seq-len", "64", "--json"]
    peaks = {}
    for name, zero in (("plain", {"stage": 2}), ("param", {"stage": 2, "offload_param": {"device": "cpu"}})):
        ds = tmp_path / f"{name}.json"
        ds.write_text(json.dumps({"zero_optimization": zero}))
        assert main([*args, "--deepspeed", str(ds)]) == 0
        out, err = capsys.readouterr()
        peaks[name] = json.loads(out)["fitting"]
        assert ("offload_param moves parameters at ZeRO-3 only; at stage 2 DeepSpeed ignores it" in err) == (
            name == "param"
        )
    assert peaks["param"] == peaks["plain"]
