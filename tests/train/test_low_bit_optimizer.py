"""Low-bit AdamW states (optimizer.name adamw8bit | adamw4bit, torchao): the planner's trace against the profiler
on real tensors, the bytes torchao's format implies, the loss against 32-bit AdamW, resume, and the refusals."""

import dataclasses
import shutil
import sys

import pytest
import torch
from support.tiny import wide_tiny_config

import memfit.planner.tracker as tracker_module
import memfit.strategies.optimizer as optimizer_module
from memfit.config.schema import OptimizerConfig
from memfit.config.strategy import CheckpointPolicy, Strategy
from memfit.errors import UserError
from memfit.models.presets import preset_config
from memfit.planner.categories import Category
from memfit.planner.hardware import gpu_preset
from memfit.planner.measure import measured_steady_step
from memfit.planner.search import Cluster, Pins, Workload, predict_run, search, search_space
from memfit.planner.trace import StepSpec, _traced
from memfit.strategies.optimizer import LOW_BIT_BLOCK, build_optimizer
from memfit.strategies.tensors import state_tensors
from memfit.train.loop import Trainer

CPU = torch.device("cpu")
CODE_BITS = {"adamw8bit": 8, "adamw4bit": 4}


def _spec(name: str, precision: str = "fp32") -> StepSpec:
    strategy = Strategy(precision=precision, optimizer="for-loop", optimizer_name=name, micro_batch_size=2)
    return StepSpec(wide_tiny_config(6), 128, strategy, host_is_device=True)


@pytest.mark.parametrize(
    "name, precision, sliced",
    [
        ("adamw8bit", "fp32", False),
        ("adamw8bit", "bf16-mixed", False),
        ("adamw4bit", "fp32", False),
        ("adamw4bit", "bf16-mixed", False),
        ("adamw8bit", "fp32", True),
        ("adamw4bit", "bf16-mixed", True),
    ],
)
def test_the_planner_predicts_low_bit_states_as_the_profiler_measures_them(name, precision, sliced, monkeypatch):
    """A full fine-tune of a 6-layer wide tiny model: the planner's prediction as the trainer asks for it
    (shallow traces extrapolated to 6 layers, the optimizer step traced on its own) against torch.profiler on
    real tensors, every category within 3% (measured: equal to the byte), the optimizer step's eager
    temporaries included; the state is a quarter (8-bit) or an eighth (4-bit) of 32-bit AdamW's at most.
    ``sliced``: parameters above 32K values stepped in slices (as a real model's above 16M values are), which
    holds the optimizer step's temporaries to a slice's."""
    if sliced:
        monkeypatch.setattr(optimizer_module, "SLICE_VALUES", 1 << 15)
    spec = _spec(name, precision)
    predicted = predict_run(spec.model_config, spec.seq_len, spec.strategy, None, on_gpu=False).peak
    measured = measured_steady_step(spec)
    for c in Category:
        assert abs(predicted[c] - measured[c]) <= 0.03 * measured[c], (c, predicted.as_dict(), measured.as_dict())
    full = measured_steady_step(_spec("adamw", precision))[Category.OPTIMIZER]
    assert measured[Category.OPTIMIZER] <= full * (0.26 if name == "adamw8bit" else 0.14)
    if sliced:  # the largest parameter (the 2048 x 256 embedding) is stepped in 16 slices
        monkeypatch.setattr(optimizer_module, "SLICE_VALUES", 1 << 30)
        whole = measured_steady_step(spec)
        assert measured[Category.TEMPORARIES] < 0.5 * whole[Category.TEMPORARIES]


@pytest.mark.parametrize("name, precision", [("adamw8bit", "bf16-mixed"), ("adamw4bit", "fp32")])
def test_a_replayed_slice_update_records_what_tracing_it_records(name, precision, monkeypatch):
    """The planner traces a low-bit update slice once per shape in a process and replays what it allocated for every
    later slice of those shapes: the update's timeline and its allocation events are the same as tracing every slice
    (here 16 slices of the embedding and one per decoder projection, at 32K values a slice, two layers)."""
    monkeypatch.setattr(optimizer_module, "SLICE_VALUES", 1 << 15)
    spec = dataclasses.replace(_spec(name, precision), part="update", round_to=512)
    replayed = []
    replay = tracker_module.StepTracker._replay
    monkeypatch.setattr(tracker_module.StepTracker, "_replay", lambda self, *a: (replayed.append(1), replay(self, *a)))

    def traced(replaying: bool):
        monkeypatch.setattr(tracker_module, "REPLAY_SLICE_UPDATES", replaying)
        monkeypatch.setattr(tracker_module, "_replays", {})
        tracker = _traced(spec, 2)
        timeline = tracker.timeline()
        return timeline.phases, [tuple(r) for r in timeline.rows], tracker.allocation_events()

    every_slice = traced(False)
    assert not replayed
    assert traced(True) == every_slice and len(replayed) >= 15
    assert optimizer_module._update_runners == []  # the tracker's runner is gone with the trace
    assert tracker_module._replay_key((torch.zeros(4), 0.1)) is None  # a real step is run, never replayed


@pytest.mark.parametrize("name", ["adamw8bit", "adamw4bit"])
def test_a_parameter_stepped_in_slices_is_stepped_to_the_bit_as_a_whole(name, monkeypatch):
    """Block-aligned row slices of a quantized state are views of its codes and scales: three steps of a
    (1000, 96) parameter in slices of 9,600 values leave the parameter and every state tensor bit-equal."""

    def three_steps(slice_values: int) -> list[torch.Tensor]:
        monkeypatch.setattr(optimizer_module, "SLICE_VALUES", slice_values)
        p = torch.nn.Parameter(torch.randn(1000, 96, generator=torch.Generator().manual_seed(0)))
        opt = build_optimizer([p], OptimizerConfig(name=name, lr=1e-2, weight_decay=0.1), CPU)
        for i in range(3):
            p.grad = torch.randn(1000, 96, generator=torch.Generator().manual_seed(1 + i))
            opt.step()
        return [p.detach().clone(), *(t.clone() for t in state_tensors(opt))]

    whole, sliced = three_steps(1 << 30), three_steps(9600)
    assert len(whole) == len(sliced) and all(torch.equal(a, b) for a, b in zip(whole, sliced))


@pytest.mark.parametrize("name", ["adamw8bit", "adamw4bit"])
def test_the_state_is_the_bytes_of_torchaos_block_format(name):
    """Each quantized moment: codes of 8 or 4 bits per value, one fp32 scale per block and its code map;
    a parameter under 4,096 values or not a whole number of blocks keeps fp32 moments; one fp32 step count."""
    shapes = [(512, 64), (4096,), (100, 7), (64,)]  # quantized, quantized, too small, too small
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    opt = build_optimizer(params, OptimizerConfig(name=name), CPU)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    block, bits = LOW_BIT_BLOCK[name], CODE_BITS[name]
    want = 0
    for p in params:
        n = p.numel()
        quantized = n >= 4096 and n % block == 0
        want += 2 * (n * bits // 8 + n // block * 4 + 2**bits * 4) if quantized else 2 * n * 4
        want += 4  # the step count
    assert sum(t.numel() * t.element_size() for t in state_tensors(opt)) == want


def _losses(cfg) -> list[float]:
    trainer = Trainer(cfg)
    try:
        return [r["loss"] for r in trainer.fit().steps]
    finally:
        trainer.close()


def test_low_bit_states_train_within_a_stated_tolerance_of_32_bit_adamw(tiny_cfg, tmp_path):
    """20 steps of the tiny preset's full fine-tune (lr 1e-3): every loss within 1% (8-bit) and 2% (4-bit) of
    32-bit AdamW's. A moment is stored to within half a code step of its block's range (256 codes, or 16), so
    each update is off by up to a few percent of its size, and those errors average out over steps and
    weights: measured 0.23% (8-bit) and 0.83% (4-bit) at worst here; on the default model over 30 steps
    5e-5 and 0.6% (benchmarks/RESULTS.md). The bars leave about twice the measured deviation."""
    run = ("train.max_steps=20", "train.eval_every=0", "train.checkpoint_every=0")
    base = _losses(tiny_cfg(*run, f"output.dir={tmp_path}/adamw"))
    assert base[-1] < base[0] - 0.1  # it trains
    for name, bar in (("adamw8bit", 0.01), ("adamw4bit", 0.02)):
        got = _losses(tiny_cfg(*run, f"optimizer.name={name}", f"output.dir={tmp_path}/{name}"))
        assert got != base and all(abs(a - b) <= bar * a for a, b in zip(base, got)), (name, base, got)


def test_a_low_bit_run_resumes_exactly(tiny_cfg, tmp_path):
    """The quantized moments (codes, scales, code maps) are checkpointed and loaded with weights_only=True
    (torchao registers its tensor classes as safe): the resumed steps' losses equal the uninterrupted run's."""
    run = ("optimizer.name=adamw8bit", "train.max_steps=6", "train.checkpoint_every=2", "train.eval_every=0")
    whole = _losses(tiny_cfg(*run, f"output.dir={tmp_path}/k"))
    shutil.rmtree(tmp_path / "k" / "checkpoints" / "step_0000006")
    rest = _losses(tiny_cfg(*run, "train.resume=true", f"output.dir={tmp_path}/k"))
    assert rest == whole[4:]


def test_impossible_combinations_are_one_line(tiny_cfg, monkeypatch):
    with pytest.raises(UserError, match=r"optimizer.name adamw8bit .* set optimizer.implementation auto or for-loop"):
        tiny_cfg("optimizer.name=adamw8bit", "optimizer.implementation=fused")
    with pytest.raises(UserError, match=r"optimizer.name must be one of adamw \| adamw8bit \| adamw4bit"):
        tiny_cfg("optimizer.name=adamw16bit")
    low = Strategy(optimizer_name="adamw4bit", optimizer="for-loop")
    assert "one process or DDP without ZeRO (got fsdp2, ZeRO-3)" in low.replace(zero_stage=3).conflict(
        world_size=2, engine="fsdp2"
    )
    cfg = preset_config("tiny")
    w, two = Workload(cfg, "tiny", 64, 4), Cluster(gpu_preset("a100-80g"), gpus_per_node=2)
    with pytest.raises(UserError, match=r"adamw8bit .* one process or DDP without ZeRO \(got fsdp2, ZeRO-2\)"):
        search(w, two, Pins({"optimizer_name": "adamw8bit", "zero_stage": 2}))
    # the stage left to the search: DDP (ZeRO-0) takes low-bit states (a 2-rank gloo run trains so), the others not
    space = search_space(w, two, Pins({"optimizer_name": "adamw8bit"}))
    assert space and {s.zero_stage for s in space} == {0}
    monkeypatch.setitem(sys.modules, "torchao.optim", None)  # as if torchao were not installed
    with pytest.raises(UserError, match=r"optimizer.name adamw8bit needs torchao: pip install 'memfit\[lowbit\]'"):
        build_optimizer([torch.nn.Parameter(torch.ones(4))], OptimizerConfig(name="adamw8bit"), CPU)


def test_the_search_tries_low_bit_states_only_where_32_bit_adamw_does_not_fit():
    """A full fine-tune of a 12-layer wide tiny model (its embedding a tenth of its weights) on a GPU without
    bf16 (fp16-mixed: fp32 master weights and moments), micro-batch 1 under full checkpointing: with room for
    32-bit AdamW no low-bit candidate is traced; with room for the 8-bit step but not the 32-bit one, 8-bit
    states fit (the safer of the two at the same speed: 4-bit, their relative, is then not traced); with room
    for the 4-bit step only, 4-bit states fit."""
    w = Workload(wide_tiny_config(12), "wide-tiny", 128, 2)
    pins = {"activation_checkpointing": CheckpointPolicy("full"), "loss_chunks": 0, "micro_batch_size": 1}
    pins["optimizer_offload"] = False  # the optimizer in host memory, the other fallback for the state, aside

    def plan(memory_bytes: int, **more):
        gpu = dataclasses.replace(gpu_preset("t4"), memory_bytes=int(memory_bytes))
        return search(w, Cluster(gpu), Pins({**pins, **more}), headroom=0.0)

    roomy = plan(16 << 30)
    assert {c.strategy.optimizer_name for c in roomy.fitting + roomy.pruned} == {"adamw"}
    need = {n: min(c.reserved_bytes for c in plan(16 << 30, optimizer_name=n).fitting) for n in CODE_BITS}
    need["adamw"] = min(c.reserved_bytes for c in roomy.fitting)
    assert need["adamw4bit"] < need["adamw8bit"] < need["adamw"]
    tight = plan(need["adamw"] - 1)
    assert tight.fitting and {c.strategy.optimizer_name for c in tight.fitting} == {"adamw8bit"}
    tighter = plan(need["adamw8bit"] - 1)
    assert tighter.fitting and {c.strategy.optimizer_name for c in tighter.fitting} == {"adamw4bit"}
    assert "adamw8bit" in {c.strategy.optimizer_name for c in tighter.pruned}
