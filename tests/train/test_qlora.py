"""QLoRA (lora.quantize_base=nf4, torchao's NF4 weights): the planner's trace against the profiler on real tensors,
the bytes NF4 stores, training, resume and export, and the one-line refusals."""

import shutil
import warnings

import pytest
import torch
from support.tiny import wide_tiny_config

from memfit.config.schema import LoraConfig
from memfit.config.strategy import CheckpointPolicy, Strategy
from memfit.errors import UserError
from memfit.models.presets import preset_config
from memfit.planner.categories import Category
from memfit.planner.hardware import gpu_preset
from memfit.planner.measure import measured_steady_step
from memfit.planner.search import Cluster, Pins, Workload, predict_run, search
from memfit.planner.trace import StepSpec
from memfit.strategies.lora import quantize_base
from memfit.strategies.tensors import held_bytes
from memfit.train.loop import Trainer

LORA = LoraConfig(enabled=True)


@pytest.mark.parametrize("ac", ["none", "full"])
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_the_planner_predicts_a_qlora_step_as_the_profiler_measures_it(precision, ac):
    """A 6-layer wide tiny model, LoRA on all seven projections with every decoder Linear in NF4: the planner's
    prediction as the trainer asks for it against torch.profiler on real tensors, every category within 3%
    (measured: parameters to the byte, every category within 0.72%, as without NF4), and the stored base smaller."""
    cfg = wide_tiny_config(6)
    strategy = Strategy(
        precision=precision,
        activation_checkpointing=CheckpointPolicy.parse(ac),
        quantize_base="nf4",
        micro_batch_size=2,
    )
    predicted = predict_run(cfg, 128, strategy, LORA, on_gpu=False).peak
    measured = measured_steady_step(StepSpec(cfg, 128, strategy, LORA, host_is_device=True))
    for c in Category:
        assert abs(predicted[c] - measured[c]) <= 0.03 * measured[c], (c, predicted.as_dict(), measured.as_dict())
    plain = measured_steady_step(StepSpec(cfg, 128, strategy.replace(quantize_base="none"), LORA, host_is_device=True))
    assert measured[Category.PARAMS] < 0.6 * plain[Category.PARAMS]


@pytest.mark.parametrize("model", ["tiny", "wide"])
def test_an_nf4_base_built_from_remembered_layouts_traces_as_quantizing_every_weight(monkeypatch, model):
    """In a trace, a weight shape's NF4 tensors after the first are built from fresh inner tensors of the first one's
    sizes, strides and storage bytes (``lora._fake_nf4``; a small weight's quantization factor is a strided view of a
    larger storage, which the first version missed: 696 bytes of a tiny trace). The step's timeline, op by op and
    byte by byte, is that of quantizing every weight, whether the first of each shape was quantized in this trace or
    an earlier one, and the shortcut did run."""
    from memfit.models.planning import config_for_planning
    from memfit.planner.trace import steady_timeline
    from memfit.strategies import lora

    cfg = config_for_planning("tiny") if model == "tiny" else wide_tiny_config(3)
    spec = StepSpec(cfg, 64, Strategy(precision="bf16-mixed", quantize_base="nf4"), LORA, 1)
    built = []
    monkeypatch.setattr(lora, "_NF4_LAYOUTS", {})
    fake_nf4 = lora._fake_nf4
    monkeypatch.setattr(lora, "_fake_nf4", lambda w: built.append(fake_nf4(w)) or built[-1])
    first = steady_timeline(spec, 2)  # each shape's first weight quantized here
    again = steady_timeline(spec, 2)  # every weight from a remembered layout
    assert sum(t is not None for t in built) >= 14 + 8  # 2 layers x 7 weights, then again all of them
    monkeypatch.setattr(lora, "_fake_nf4", lambda w: None)
    every = steady_timeline(spec, 2)

    def rows(timeline):
        return timeline.phases, [tuple(map(int, r)) for r in timeline.rows]

    assert rows(first) == rows(every) and rows(again) == rows(every)


def test_nf4_stores_half_a_byte_per_weight_and_its_block_scales():
    """Every decoder Linear of the tiny preset (its 64 x 32 K/V projections too: the scaler block shrinks to
    divide their 32 code blocks) becomes an NF4Tensor of 4-bit codes plus an int8 absmax per 64 values and
    their scales: 0.5 + 1/64 byte per weight and a few bytes per tensor; embeddings, norms and head stay."""
    from memfit.config.schema import ModelConfig
    from memfit.models.load import ModelSource, build_model
    from memfit.strategies.lora import apply_lora
    from memfit.strategies.precision import precision_policy

    model = build_model(ModelSource("preset", preset="tiny"), ModelConfig(), torch.float32, seed=0)
    model = apply_lora(model, LORA, precision_policy("bf16-mixed"))
    linears = {n: m.weight.numel() for n, m in model.named_modules() if type(m) is torch.nn.Linear and "lora_" not in n}
    decoder = {n: k for n, k in linears.items() if ".layers." in n}
    assert quantize_base(model, "nf4") == len(decoder) == 2 * 7
    modules = dict(model.named_modules())
    for name, n in decoder.items():
        stored = held_bytes(modules[name].weight)
        assert n * (0.5 + 1 / 64) <= stored <= n * (0.5 + 1 / 64) + 128, (name, n, stored)
    assert type(model.get_output_embeddings().weight) is torch.nn.Parameter  # the head is not quantized


def _fit(cfg):
    trainer = Trainer(cfg)
    try:
        return trainer.fit()
    finally:
        trainer.close()


def test_a_qlora_run_trains_resumes_exactly_and_exports_the_adapter(tiny_cfg, tmp_path):
    """bf16-mixed QLoRA on the tiny preset: the losses stay within 2% of bf16 LoRA's (4-bit weights: each
    weight within half a code step of its block's absmax; measured 2e-4 here), a resume from step 4 repeats
    steps 5 and 6 exactly (the base is quantized again from the same weights), and the export is the PEFT
    adapter alone, written without PEFT looking for the base's config (a random preset has none: it warned)."""
    run = ("lora.enabled=true", "strategy.precision=bf16-mixed", "train.max_steps=6", "train.checkpoint_every=2")
    run += ("train.eval_every=0", "output.export=true")
    plain = [r["loss"] for r in _fit(tiny_cfg(*run, f"output.dir={tmp_path}/plain")).steps]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        whole = [r["loss"] for r in _fit(tiny_cfg(*run, "lora.quantize_base=nf4", f"output.dir={tmp_path}/q")).steps]
    assert not [w for w in seen if "config file" in str(w.message)], [str(w.message) for w in seen]
    assert whole != plain and all(abs(a - b) <= 0.02 * a for a, b in zip(plain, whole)), (plain, whole)
    exported = sorted(p.name for p in (tmp_path / "q" / "export").iterdir())
    assert "adapter_model.safetensors" in exported and "model.safetensors" not in exported
    shutil.rmtree(tmp_path / "q" / "checkpoints" / "step_0000006")
    rest = _fit(tiny_cfg(*run, "lora.quantize_base=nf4", "train.resume=true", f"output.dir={tmp_path}/q"))
    assert [r["loss"] for r in rest.steps] == whole[4:]


def test_impossible_qlora_combinations_are_one_line(tiny_cfg):
    with pytest.raises(UserError, match=r"lora.quantize_base nf4 quantizes the frozen base of a LoRA run"):
        tiny_cfg("lora.enabled=false", "lora.quantize_base=nf4")
    with pytest.raises(UserError, match=r"lora.quantize_base must be one of none \| nf4 \(got 'int4'\)"):
        tiny_cfg("lora.enabled=true", "lora.quantize_base=int4")
    nf4 = Strategy(quantize_base="nf4", zero_stage=3)
    assert "one process or DDP without ZeRO (got fsdp2, ZeRO-3)" in nf4.conflict(world_size=2, engine="fsdp2")
    cfg = preset_config("tiny")
    with pytest.raises(UserError, match=r"--quantize-base nf4 quantizes the frozen base of a LoRA run: add --lora"):
        search(Workload(cfg, "tiny", 64, 4), Cluster(gpu_preset("a100-80g")), Pins({"quantize_base": "nf4"}))


def test_the_search_lists_qlora_where_lora_does_not_fit():
    """A 12-layer wide tiny model, LoRA, on a GPU with room for the NF4 base but not the bf16 one: every
    fitting candidate is QLoRA; with room for both, no NF4 candidate is traced."""
    import dataclasses

    w = Workload(wide_tiny_config(12), "wide-tiny", 128, 2, LORA)
    pins = {"activation_checkpointing": CheckpointPolicy("full"), "loss_chunks": 0, "micro_batch_size": 1}
    pins["optimizer_offload"] = False  # the adapters' state in host memory would save a few bytes too: aside
    pins["optimizer_name"] = "adamw"  # ... and so would low-bit states of the adapters: aside

    def plan(memory_bytes: int, **more):
        gpu = dataclasses.replace(gpu_preset("a100-80g"), memory_bytes=int(memory_bytes))
        return search(w, Cluster(gpu), Pins({**pins, **more}), headroom=0.0)

    roomy = plan(16 << 30)
    assert {c.strategy.quantize_base for c in roomy.fitting + roomy.pruned} == {"none"}
    need = min(c.reserved_bytes for c in roomy.fitting)
    tight = plan(need - 1)
    assert tight.fitting and {c.strategy.quantize_base for c in tight.fitting} == {"nf4"}
