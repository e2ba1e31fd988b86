"""Mixtures of experts (Mixtral, Qwen-MoE, OLMoE): traced as the profiler measures them, their experts read from
each config family, and their step-time model's FLOPs against a FLOP counter on real tensors."""

import json
from dataclasses import asdict

import pytest
import torch
import transformers
from support.measured import assert_within_3pct_per_category
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM

from memfit.cli import main
from memfit.config.schema import LoraConfig
from memfit.config.strategy import CheckpointPolicy, Strategy
from memfit.errors import UserError
from memfit.models.planning import (
    Experts,
    ReadConfig,
    asks_experts_loop,
    config_for_planning,
    experts,
    layer_prefix,
    transformers_config,
)
from memfit.models.presets import preset, preset_config
from memfit.planner.cost import Shape, step_flops
from memfit.planner.measure import measured_steady_step
from memfit.planner.predict import Predictor
from memfit.planner.trace import StepSpec, trace_step
from memfit.strategies.lora import apply_lora, target_names
from memfit.strategies.precision import precision_policy

SMALL = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,  # small, so that the experts' bytes are not lost beside the logits'
    max_position_embeddings=256,
)


def _moe(family: str):
    if family == "mixtral":
        return transformers.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2)
    if family == "qwen2-moe":  # a shared expert beside the routed ones
        return transformers.Qwen2MoeConfig(
            **SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=64
        )
    experts = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    return transformers.Qwen3MoeConfig(**SMALL, head_dim=16, **experts)


FAMILIES = ["mixtral", "qwen2-moe", "qwen3-moe"]


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """torch's FLOP counter has no formula for ``_grouped_mm``: 2 x rows x K x N, each row through one expert."""
    return 2 * a_shape[0] * a_shape[1] * b_shape[-1]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "precision, ac", [("fp32", "none"), ("bf16-mixed", "ffn"), ("fp32", "full"), ("bf16-pure", "none")]
)
def test_a_mixture_of_experts_traces_as_the_profiler_measures_it(family, precision, ac):
    """transformers runs the experts through ``aten._grouped_mm``, whose meta kernel takes bf16 only: every fp32
    trace of a mixture of experts failed, so `memfit plan` ended in a traceback and `train` ran without its fit
    check. Now traced (the CPU kernel takes fp32, as the real step shows) within the planner's bar."""
    policy = CheckpointPolicy.parse(ac)
    strategy = Strategy(activation_checkpointing=policy, precision=precision, optimizer="foreach", micro_batch_size=4)
    spec = StepSpec(_moe(family), 128, strategy)
    assert_within_3pct_per_category(trace_step(spec).peak, measured_steady_step(spec))


def test_lora_on_a_mixture_of_experts_adapts_its_attention_by_default_and_traces_as_measured():
    """The default adapters were the seven Llama projections by name, which a mixture of experts lacks (its experts
    are 3-D weights): LoRA on Mixtral or Phi-3 was refused until the user named its modules. The default is now
    every Linear but the output head (PEFT's all-linear), the same seven on a Llama."""
    spec = StepSpec(_moe("mixtral"), 128, Strategy(optimizer="foreach", micro_batch_size=4), LoraConfig(enabled=True))
    assert_within_3pct_per_category(trace_step(spec).peak, measured_steady_step(spec))
    fp32 = precision_policy("fp32")
    adapted = {
        name.rsplit(".", 1)[-1]
        for name, m in apply_lora(
            AutoModelForCausalLM.from_config(_moe("mixtral")), LoraConfig(enabled=True), fp32
        ).named_modules()
        if hasattr(m, "lora_A")
    }
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj"}
    llama = AutoModelForCausalLM.from_config(preset_config("tiny"))
    assert set(target_names(llama, LoraConfig().target_modules)) == {
        *("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    }
    phi3 = AutoModelForCausalLM.from_config(transformers.Phi3Config(**SMALL, pad_token_id=0))
    assert set(target_names(phi3, LoraConfig().target_modules)) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}


def test_experts_are_read_from_each_config_family(tmp_path):
    assert Experts.of(_moe("mixtral")) == Experts(4, 2, 96, 0)
    assert Experts.of(_moe("qwen2-moe")) == Experts(4, 2, 48, 64)
    assert Experts.of(_moe("qwen3-moe")) == Experts(8, 2, 32, 0)
    deepseek = transformers.DeepseekV3Config(
        **SMALL, n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=24, n_shared_experts=2
    )
    assert Experts.of(deepseek) == Experts(16, 4, 24, 48)
    assert Experts.of(preset_config("tiny")) == Experts() == experts(preset("tiny"))
    _moe("qwen2-moe").save_pretrained(tmp_path)
    read = config_for_planning(str(tmp_path))
    assert isinstance(read, ReadConfig) and experts(read) == Experts(4, 2, 48, 64)
    assert ReadConfig.parsed(asdict(read)) == read  # as the config cache keeps it


def _config(family: str):
    """A mixture of experts of ``family``, or one unlike the rest in its layers (``_unlike``), or a Qwen3-MoE whose
    ``head_dim`` is twice ``hidden_size / heads`` (as Qwen3-30B-A3B's is)."""
    if family in FAMILIES:
        return _moe(family)
    if family == "wide-heads":
        experts = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
        return transformers.Qwen3MoeConfig(**SMALL, head_dim=32, **experts)
    return _unlike(family)


@pytest.mark.parametrize("family", [*FAMILIES, "dense-first", "in-turn", "wide-heads", "deepseek-v3"])
def test_the_step_time_model_counts_the_flops_of_the_experts_a_token_runs_through(family):
    """Against torch's FLOP counter on a real forward (``_grouped_mm``: 2 x rows x K x N, each row through one
    expert; eager attention, whose core is two batched matmuls over the full square, which the cost model halves as
    causal): a mixture of experts was charged one expert's MLP per token, and its weights (ZeRO's traffic, FSDP's
    root share) one expert's; its dense layers (DeepSeek's first ones, Qwen3-MoE's ``mlp_only_layers``, those
    between its ``decoder_sparse_step``) were charged as sparse; attention was charged as ``hidden_size`` wide,
    which a ``head_dim`` of its own (Qwen3's) or DeepSeek's latent attention is not."""
    config = _config(family)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    B, T = 2, 32

    counter = FlopCounterMode(display=False, custom_mapping={torch.ops.aten._grouped_mm: _grouped_mm_flops})
    with counter, torch.no_grad():
        model(torch.randint(0, config.vocab_size, (B, T)))
    by_module = counter.get_flop_counts()
    counted = {str(op): n for op, n in by_module["Global"].items()}
    counted.pop("aten.bmm")  # attention's core, and the rotary angles where transformers takes them by a bmm (5.17)
    core = sum(
        n for name, ops in by_module.items() if name.endswith(".self_attn") for op, n in ops.items() if "bmm" in str(op)
    )
    shape = Shape.of(config)
    causal_core = shape.layers * B * T * T * shape.attn_width
    forward = step_flops(shape, B * T, T, lora=True, strategy=Strategy()) / 2  # LoRA: training = 2 x forward
    extra = shape.layers * 2 * B * T * shape.hidden if family == "qwen2-moe" else 0  # its shared expert's gate, h -> 1
    assert forward - causal_core == pytest.approx(sum(counted.values()) - extra, rel=1e-12)
    assert core == 2 * causal_core
    held = sum(p.numel() for layer in model.model.layers for p in layer.mlp.parameters() if p.dim() >= 2)
    assert shape.layers * (shape.mlp_weights + (shape.hidden if family == "qwen2-moe" else 0)) == held
    attention = sum(p.numel() for layer in model.model.layers for p in layer.self_attn.parameters() if p.dim() >= 2)
    assert shape.layers * shape.attn_weights == attention


def test_lora_on_the_expert_weights_traces_as_measured_and_is_charged_a_full_backward_through_the_experts():
    """``lora.target_parameters`` (PEFT's): adapters on the 3-D expert weights, which PEFT folds into each expert
    stack per forward, so the stack's gradient is computed whole. The trace against the profiler; and what the
    step-time model adds for it against what torch's FLOP counter counts more over a real forward and backward than
    with the experts frozen (the embeddings trained in both, so that backward runs through every layer; the fold
    itself, weight-sized, not counted)."""
    lora = LoraConfig(enabled=True, target_modules=[], target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    for strategy in (Strategy(optimizer="foreach", micro_batch_size=4), Strategy(precision="bf16-mixed")):
        spec = StepSpec(_moe("mixtral"), 128, strategy, lora)
        assert_within_3pct_per_category(trace_step(spec).peak, measured_steady_step(spec))
    config = _moe("mixtral")
    B, T = 2, 32

    def counted(adapted: bool) -> int:
        model = AutoModelForCausalLM.from_config(config).requires_grad_(False)
        if adapted:
            model = apply_lora(model, lora, precision_policy("fp32"))
        model.get_input_embeddings().weight.requires_grad_(True)
        counter = FlopCounterMode(display=False, custom_mapping={torch.ops.aten._grouped_mm: _grouped_mm_flops})
        with counter:
            model(torch.randint(0, config.vocab_size, (B, T))).logits.float().sum().backward()
        return sum(n for op, n in counter.get_flop_counts()["Global"].items() if "bmm" not in str(op))

    shape = Shape.of(config)
    modelled = [step_flops(shape, B * T, T, True, Strategy(), lora_experts=on) for on in (False, True)]
    assert modelled[1] - modelled[0] == counted(True) - counted(False) > 0


def test_a_target_parameter_that_names_no_weight_is_one_line_with_the_weights_it_could_name():
    fp32 = precision_policy("fp32")
    moe = AutoModelForCausalLM.from_config(_moe("qwen3-moe"))
    with pytest.raises(UserError, match=r"'gate_up' is no weight of this model; available: experts\.down_proj, exp"):
        apply_lora(moe, LoraConfig(enabled=True, target_parameters=["gate_up"]), fp32)
    experts_only = LoraConfig(enabled=True, rank=65, target_modules=[], target_parameters=["experts.gate_up_proj"])
    with pytest.raises(UserError, match=r"lora.rank 65 is above every adapted weight's smaller side \(at most 64 here"):
        apply_lora(moe, experts_only, fp32)  # 8 experts' gate and up projections: 64 x 64 each
    dense = AutoModelForCausalLM.from_config(preset_config("tiny"))
    with pytest.raises(UserError, match=r"'experts\.gate_up_proj' is no weight of this model \(it has no 3-D expert"):
        apply_lora(dense, LoraConfig(enabled=True, target_parameters=["experts.gate_up_proj"]), fp32)


def _unlike(kind: str):
    deep = {**SMALL, "num_hidden_layers": 7}
    qwen3 = dict(head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    if kind == "dense-first":  # Qwen3-MoE's mlp_only_layers
        return transformers.Qwen3MoeConfig(**deep, **qwen3, mlp_only_layers=[0, 1])
    if kind == "in-turn":  # a sparse layer every second one
        return transformers.Qwen3MoeConfig(**deep, **qwen3, decoder_sparse_step=2)
    mla = dict(q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
    return transformers.DeepseekV3Config(  # multi-head latent attention, 2 dense layers first, a shared expert
        **{**deep, "num_key_value_heads": 4},
        **mla,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        first_k_dense_replace=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
    )


@pytest.mark.parametrize("kind, prefix", [("dense-first", 2), ("in-turn", None), ("deepseek-v3", 2)])
@pytest.mark.parametrize("ac", ["none", "every_k:2"])
def test_decoder_layers_unlike_the_rest_are_predicted_as_the_whole_model_traces(kind, prefix, ac):
    """The planner traced 2 and 3 layers and extrapolated the third's bytes to every layer: where a mixture of
    experts' first layers are dense (DeepSeek's first_k_dense_replace, Qwen-MoE's mlp_only_layers) or its sparse
    layers come in turn with dense ones, the layers added were not the model's (a 7-layer Qwen3-MoE with a sparse
    layer every second one: parameters predicted 20% short). First layers unlike the rest are now traced in both
    depths; layers in turn trace the model whole. The prediction equals the full-depth trace, category by category,
    and (DeepSeek-V3) the profiler's measurement within the bar."""
    config = _unlike(kind)
    assert layer_prefix(config) == prefix
    policy = CheckpointPolicy.parse(ac)
    spec = StepSpec(config, 64, Strategy(activation_checkpointing=policy, optimizer="foreach", micro_batch_size=2))
    predicted, whole = Predictor(spec).predict(spec.strategy).peak, trace_step(spec).peak
    assert predicted.as_dict() == whole.as_dict()
    if kind == "deepseek-v3" and ac == "none":
        assert_within_3pct_per_category(predicted, measured_steady_step(spec))


def test_a_read_config_keeps_its_layers_kinds(tmp_path):
    _unlike("in-turn").save_pretrained(tmp_path)
    read = config_for_planning(str(tmp_path))
    assert read.layers == (0, 1, 0, 1, 0, 1, 0) and layer_prefix(read) is None
    assert ReadConfig.parsed(asdict(read)) == read
    assert layer_prefix(preset("llama2-7b")) == 0


def test_the_routers_load_balancing_loss_is_trained_where_the_config_asks_for_it():
    """memfit takes its token loss from the logits, so a config with ``output_router_logits: true`` (a mixture of
    experts' load-balancing loss, ``router_aux_loss_coef`` x ``aux_loss`` in transformers' loss) trained without it.
    The step's mean loss now adds it; without the setting it is the mean token loss alone. Its memory (every layer's
    router logits, kept for the loss) traces as the profiler measures it."""
    from memfit.step.loss import token_loss_sum
    from memfit.strategies.precision import precision_policy

    tokens = torch.randint(0, SMALL["vocab_size"], (2, 33), generator=torch.Generator().manual_seed(0))
    fp32, cpu = precision_policy("fp32"), torch.device("cpu")
    for asked in (False, True):
        config = _moe("mixtral")
        config.output_router_logits, config.router_aux_loss_coef = asked, 0.25
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        mean = token_loss_sum(model, tokens, tokens, fp32, cpu) / tokens[:, 1:].numel()
        output = model(input_ids=tokens[:, :-1])
        plain = torch.nn.functional.cross_entropy(output.logits.flatten(0, 1), tokens[:, 1:].flatten())
        want = plain + 0.25 * output.aux_loss if asked else plain
        assert output.aux_loss is None if not asked else float(output.aux_loss.detach()) > 0.1
        torch.testing.assert_close(mean, want)
        if asked:
            spec = StepSpec(config, 128, Strategy(optimizer="foreach", micro_batch_size=4))
            assert_within_3pct_per_category(trace_step(spec).peak, measured_steady_step(spec))


def test_a_load_balancing_loss_that_counts_picks_with_bincount_traces(monkeypatch):
    """transformers 5.17 (the GPU machine's) counts each expert's picks in its load-balancing loss with
    ``torch.bincount(..., minlength=num_experts)``, whose length fake tensors refuse (it is the largest value's): the
    trace of any config with ``output_router_logits`` raised DynamicOutputShapeException. Here the loss of whatever
    transformers runs also takes such a count; the trace against the profiler, every category within 3%."""
    from transformers.models.mixtral import modeling_mixtral

    loss = modeling_mixtral.load_balancing_loss_func

    def counting(gate_logits, num_experts=None, top_k=2, attention_mask=None):
        picks = torch.topk(gate_logits[0], top_k, dim=-1).indices.reshape(-1)
        counts = torch.bincount(picks, minlength=num_experts)
        assert counts.shape == (num_experts,) and counts.dtype == torch.int64
        return loss(gate_logits, num_experts, top_k, attention_mask) + 0 * counts.sum()

    monkeypatch.setattr(modeling_mixtral, "load_balancing_loss_func", counting)
    config = _moe("mixtral")
    config.output_router_logits = True
    spec = StepSpec(config, 128, Strategy(optimizer="foreach", micro_batch_size=4))
    assert_within_3pct_per_category(trace_step(spec).peak, measured_steady_step(spec))


@pytest.mark.parametrize("family", ["mixtral", "qwen3-moe"])
def test_a_config_asking_for_the_experts_loop_is_planned_as_grouped_mm_and_says_so(family, tmp_path, capsys):
    """``"experts_implementation": "eager"`` in a config.json (transformers' loop over the experts: ``nonzero`` of
    the routing, shapes a trace does not have) ended ``memfit plan`` in a MaybeEncodingError traceback from its trace
    workers, and a run's fit check in "planner failed". The experts are traced as grouped_mm, and the plan says so;
    the loop's measured step (real tensors, the loop itself) is within 7% of that trace."""
    _moe(family).save_pretrained(tmp_path / "loop")
    raw = json.loads((tmp_path / "loop" / "config.json").read_text()) | {"experts_implementation": "eager"}
    (tmp_path / "loop" / "config.json").write_text(json.dumps(raw))
    transformers.LlamaConfig(**SMALL, experts_implementation="eager").save_pretrained(tmp_path / "dense")
    read = config_for_planning(str(tmp_path / "loop"))
    assert asks_experts_loop(read) and asks_experts_loop(transformers_config(read))
    assert not asks_experts_loop(config_for_planning(str(tmp_path / "dense"))) and not asks_experts_loop(_moe(family))
    strategy = Strategy(optimizer="foreach", micro_batch_size=4)
    traced = trace_step(StepSpec(read, 128, strategy)).peak
    assert traced.as_dict() == trace_step(StepSpec(_moe(family), 128, strategy)).peak.as_dict()
    measured = measured_steady_step(StepSpec(read, 128, strategy))
    assert abs(measured.total_bytes - traced.total_bytes) <= 0.07 * measured.total_bytes, (measured, traced)
    pinned = ["--seq-len", "64", "--precision", "bf16-pure", "--ac", "none", "--micro-batch", "4"]
    assert main(["plan", "--model", str(tmp_path / "loop"), "--gpu", "h100", *pinned]) == 0
    assert "note: the config asks for experts_implementation 'eager'" in capsys.readouterr().out


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "bf16-pure"])
def test_adapters_built_on_the_meta_device_take_the_dtypes_real_ones_do(precision):
    """The planner builds its adapters on the meta device (PEFT would allocate and initialise them for real: 3.9 GB
    and 28 s of a Llama-2-7B plan at rank 1024), where PEFT leaves them in the default dtype instead of their base
    weight's; each parameter's dtype, shape and trainability must be the real model's, on a dense model and on a
    mixture of experts' expert weights."""
    policy = precision_policy(precision)
    cases = [
        (preset_config("tiny"), LoraConfig(enabled=True, rank=4)),
        (_moe("mixtral"), LoraConfig(enabled=True, rank=4, target_parameters=["experts.gate_up_proj"])),
    ]
    for config, lora in cases:
        held = {}
        for device in ("cpu", "meta"):
            with torch.device(device):
                model = apply_lora(AutoModelForCausalLM.from_config(config, dtype=policy.param_dtype), lora, policy)
            held[device] = {n: (p.dtype, p.shape, p.requires_grad) for n, p in model.named_parameters()}
        assert held["meta"] == held["cpu"]
        assert {dtype for dtype, _, trained in held["cpu"].values() if trained} == {policy.param_dtype}
