"""QLoRA (lora.quantize_base=nf4, torchao's NF4 weights): the planner's trace against the profiler on real tensors,
the bytes NF4 stores, training, resume and export, and the one-line refusals."""

import shutil
import warnings

import pytest
import torch
from support.measured import assert_within_3pct_per_category
from support.tiny import wide_tiny_config

from memfit.config.schema import LoraConfig
from memfit.config.strategy import CheckpointPolicy, Strategy
from memfit.errors import UserError
from memfit.models.presets import preset_config
from memfit.planner.categories import DEVICE_CATEGORIES, Category
from memfit.planner.hardware import gpu_preset
from memfit.planner.measure import measured_steady_step
from memfit.planner.search import Cluster, Pins, Workload, predict_run, search
from memfit.planner.trace import StepSpec, trace_step
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


MOE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
MOE |= dict(vocab_size=256, max_position_embeddings=256)


def _moe(family: str, **sizes):
    import transformers

    if family == "mixtral":
        return transformers.MixtralConfig(**(MOE | sizes), num_local_experts=4, num_experts_per_tok=2)
    return transformers.Qwen3MoeConfig(**(MOE | sizes), num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)


@pytest.mark.parametrize("family", ["mixtral", "qwen3-moe"])
@pytest.mark.parametrize("precision, ac", [("fp32", "none"), ("bf16-pure", "none"), ("fp32", "ffn")])
def test_an_nf4_base_quantizes_a_mixture_of_experts_stacks_and_traces_as_measured(family, precision, ac):
    """A mixture of experts' experts are 3-D weights, not Linear modules: NF4 left them (most of a Mixtral's bytes)
    in bf16. Each expert of each stack is now an NF4 tensor behind a parametrization that dequantizes the stack where
    the model reads it. The planner's trace against the profiler on real tensors, every category within 3%, and the
    parameters under half of the bf16 base's (they were 0.93x of them: only attention was quantized)."""
    strategy = Strategy(
        precision=precision,
        activation_checkpointing=CheckpointPolicy.parse(ac),
        quantize_base="nf4",
        micro_batch_size=4,
    )
    spec = StepSpec(_moe(family), 128, strategy, LORA)
    measured = measured_steady_step(spec)
    assert_within_3pct_per_category(trace_step(spec).peak, measured)
    plain = measured_steady_step(StepSpec(_moe(family), 128, strategy.replace(quantize_base="none"), LORA))
    assert measured[Category.PARAMS] < 0.5 * plain[Category.PARAMS]


def _frozen_moe(family: str, **sizes):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_moe(family, **sizes)).to(torch.bfloat16)
    for p in model.parameters():
        p.requires_grad_(False)
    model.model.embed_tokens.weight.requires_grad_(True)
    return model


@pytest.mark.parametrize("group", ["whole", "uneven"])
@pytest.mark.parametrize("family", ["mixtral", "qwen3-moe"])
def test_nf4_experts_compute_what_their_dequantized_weights_compute(family, group, monkeypatch):
    """Every expert stack stores 0.5 + 1/64 byte per weight (NF4 codes, block scales) and a few bytes per expert;
    the loss and the gradient through the experts equal, bit for bit, those of the same model whose stacks hold
    the dequantized weights (the grouped matmul sees the same bf16 tensor; backward dequantizes it again), with the
    stack in one NF4 tensor (these small ones) or in groups of 3 experts, the last one shorter."""
    from memfit.strategies import lora

    if group == "uneven":
        monkeypatch.setattr(lora, "NF4_GROUP_VALUES", 3 * 2 * 96 * 64)  # 3 of a tiny Mixtral's gate_up experts
    model = _frozen_moe(family)
    reference = _frozen_moe(family)
    assert quantize_base(model, "nf4") == 2 * (4 + 2)  # per layer: q, k, v, o and the two expert stacks
    counts = []
    for quantized, plain in zip(model.model.layers, reference.model.layers):
        experts = quantized.mlp.experts
        for name in ("gate_up_proj", "down_proj"):
            stored = sum(held_bytes(p) for p in experts.parametrizations[name].parameters())
            n = getattr(plain.mlp.experts, name).numel()
            assert n * (0.5 + 1 / 64) <= stored <= n * (0.5 + 1 / 64) + 128 * len(experts.gate_up_proj), (name, stored)
            stack = getattr(plain.mlp.experts, name)
            per = max(1, min(len(stack), lora.NF4_GROUP_VALUES // stack[0].numel()))
            held = len(list(experts.parametrizations[name].parameters()))
            assert held == -(-len(stack) // per)
            counts.append(held)
            stack.data = getattr(experts, name).detach().clone()
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(plain.self_attn, name).weight.data = getattr(quantized.self_attn, name).weight.to(torch.bfloat16)
    assert max(counts) == (2 if (family, group) == ("mixtral", "uneven") else 1), counts  # 3 experts and 1
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    losses = []
    for m in (model, reference):
        loss = m(ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == losses[1]
    assert torch.equal(model.model.embed_tokens.weight.grad, reference.model.embed_tokens.weight.grad)


def test_a_step_holds_one_layers_dequantized_experts_at_a_time(monkeypatch):
    """Autograd saves each matmul's weight for backward: the dequantized stacks of every layer would be held until
    backward (measured: 8 layers' worth, 296 MB where one layer's is 25 MB). They are saved as their NF4 groups and
    dequantized again in backward; every other tensor the experts save still goes to the hooks outside them (here
    the profiler's marker, which counted them as temporaries while these hooks hid them)."""
    from memfit.strategies import lora

    monkeypatch.setattr(lora, "NF4_GROUP_VALUES", 1)  # expert by expert: a transient of one expert's codes
    cfg = _moe("mixtral", hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8)
    cfg.num_local_experts = 8
    layer_stacks = 8 * 3 * 512 * 1024 * 2  # bf16 bytes of one layer's experts
    strategy = Strategy(precision="bf16-pure", quantize_base="nf4", micro_batch_size=1)
    nf4 = measured_steady_step(StepSpec(cfg, 16, strategy, LORA))
    plain = measured_steady_step(StepSpec(cfg, 16, strategy.replace(quantize_base="none"), LORA))
    # the experts' saved tensors still counted as activations (1.0 MB of the bf16 step's 2.8 MB while hidden; the
    # peak's moment moves a little: 2.6 MB)
    assert nf4[Category.ACTIVATIONS] > 0.85 * plain[Category.ACTIVATIONS], (nf4.as_dict(), plain.as_dict())
    assert nf4[Category.TEMPORARIES] < 1.5 * layer_stacks, nf4.as_dict()
    assert nf4.total_bytes < 0.5 * plain.total_bytes


def test_expert_weights_that_carry_adapters_stay_as_they_are_under_nf4():
    """PEFT adapts an expert stack (lora.target_parameters) through a parametrization of its own, which it adds and
    removes around each forward: such a stack is not quantized (the rest of the layer is), and the step trains."""
    from memfit.config.schema import LoraConfig as Lora
    from memfit.strategies.lora import apply_lora
    from memfit.strategies.precision import precision_policy

    model = _frozen_moe("mixtral")
    adapted = Lora(enabled=True, target_parameters=["experts.gate_up_proj"])
    model = apply_lora(model, adapted, precision_policy("bf16-pure"))
    assert quantize_base(model, "nf4") == 2 * (4 + 1)
    nf4 = {n for n, p in model.named_parameters() if type(p.data).__name__ == "NF4Tensor"}
    assert not any("gate_up_proj" in n for n in nf4) and any("down_proj" in n for n in nf4)
    ids = torch.randint(0, 256, (2, 32))
    model(ids, labels=ids).loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad and "lora" in n)


def test_nf4_experts_with_activations_offloaded_trace_as_measured():
    """The experts' own saved-tensor hooks pass every saved tensor but the dequantized stacks to the offloading
    hooks outside them: the device categories within 3% of the profiler, the host copies within 5%."""
    from memfit.planner.predict import Predictor

    strategy = Strategy(precision="fp32", quantize_base="nf4", activation_offload=True, micro_batch_size=4)
    predicted = Predictor(StepSpec(_moe("mixtral"), 128, lora=LORA)).predict(strategy)
    measured = measured_steady_step(StepSpec(_moe("mixtral"), 128, strategy, LORA))
    for c in DEVICE_CATEGORIES:
        assert abs(predicted.peak[c] - measured[c]) <= 0.03 * measured[c], (c, predicted.peak.as_dict(), measured)
    assert measured[Category.HOST] > 0
    assert abs(predicted.host_peak_bytes - measured[Category.HOST]) <= 0.05 * measured[Category.HOST]


def test_an_experts_forward_dequantizes_each_stack_once_and_backward_each_saved_expert_alone(monkeypatch):
    """transformers' eager experts loop reads ``self.gate_up_proj[expert]`` once per expert hit: each read
    dequantized the whole stack again (4 experts, 2 layers: 16 dequantizations in a forward, now 4), and backward
    dequantized the whole stack for each expert's saved weight (64 experts' worth, now 16: each its own group where
    groups hold one expert). The loss and gradients stay bit-equal to the dequantized weights'."""
    from memfit.strategies import lora

    monkeypatch.setattr(lora, "NF4_GROUP_VALUES", 1)
    model, reference = _frozen_moe("mixtral"), _frozen_moe("mixtral")
    quantize_base(model, "nf4")
    for quantized, plain in zip(model.model.layers, reference.model.layers):
        for name in ("gate_up_proj", "down_proj"):
            getattr(plain.mlp.experts, name).data = getattr(quantized.mlp.experts, name).detach().clone()
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(plain.self_attn, name).weight.data = getattr(quantized.self_attn, name).weight.to(torch.bfloat16)
    experts = []
    dequantized = lora._Dequantized._dequantized
    monkeypatch.setattr(
        lora._Dequantized, "_dequantized", lambda self, g, n: experts.append(n) or dequantized(self, g, n)
    )
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    losses = []
    for m in (model, reference):
        m.config._experts_implementation = "eager"
        loss = m(ids, labels=ids).loss
        if m is model:
            assert experts == [4] * 4  # each stack once
        loss.backward()
        losses.append(loss.item())
    assert experts[4:] == [1] * 16  # one expert per saved weight: 2 layers x 2 stacks x 4 experts
    assert losses[0] == losses[1]
    assert torch.equal(model.model.embed_tokens.weight.grad, reference.model.embed_tokens.weight.grad)


def test_a_saved_view_of_nf4_experts_is_the_same_view_of_the_whole_dequantized_stack():
    """Backward reads each saved view from the groups it covers: an expert, its transpose, a run of experts across
    groups (3 experts a group, the last group shorter), the whole stack and an empty view equal the view of the stack
    dequantized whole, value for value."""
    from torchao.quantization import to_nf4

    from memfit.strategies import lora

    stack = torch.randn(7, 32, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    part = lora._Dequantized(stack.shape, stack.dtype, to_nf4)
    part.group = 3
    groups = part.right_inverse(stack)
    whole = part(*groups)
    assert len(groups) == 3
    views = [whole[4], whole[6].t(), whole[2:5], whole[1:7].transpose(-2, -1), whole, whole[7:], whole[5, 3:9, ::2]]
    for view in views:
        got = part.view_of(groups, view.size(), view.stride(), view.storage_offset())
        assert got.shape == view.shape and torch.equal(got, view)
