"""What LoRA trains beside its adapters: whole modules (``lora.modules_to_save``: PEFT keeps the frozen original and
trains a copy) and embedding rows (``lora.trainable_tokens``: PEFT's trainable_token_indices). The planner's trace
against the profiler on real tensors, the bytes each adds, the cost model's counts against the real model's, training,
resume and export, and the one-line refusals."""

import shutil

import pytest
import torch
from support.measured import assert_within_3pct_per_category
from support.tiny import fitted, wide_tiny_config

from memfit.config.schema import LoraConfig
from memfit.config.strategy import Strategy
from memfit.errors import UserError
from memfit.models.load import ModelSource, build_model, decoder_layers
from memfit.planner.categories import Category
from memfit.planner.cost import Shape, TrainedWhole
from memfit.planner.measure import measured_steady_step
from memfit.planner.search import predict_run
from memfit.planner.sharding import ShardingSpec
from memfit.planner.trace import StepSpec
from memfit.strategies.lora import apply_lora
from memfit.strategies.precision import precision_policy

SAVED = LoraConfig(enabled=True, modules_to_save=["embed_tokens", "lm_head"])
ROWS = LoraConfig(enabled=True, trainable_tokens=[1, 5, 9, 5])  # a repeated id is one row


def _wide(tied: bool):
    cfg = wide_tiny_config(4)
    cfg.tie_word_embeddings = tied
    return cfg


@pytest.mark.parametrize(
    "lora, tied, precision",
    [(SAVED, False, "bf16-mixed"), (SAVED, True, "fp32"), (ROWS, True, "bf16-mixed"), (ROWS, False, "fp32")],
    ids=["saved-untied-bf16", "saved-tied-fp32", "rows-tied-bf16", "rows-untied-fp32"],
)
def test_the_planner_predicts_what_lora_trains_whole_as_the_profiler_measures_it(lora, tied, precision):
    """A 4-layer wide tiny model (vocabulary 2,048 x hidden 256): the planner's prediction as the trainer asks for it
    against torch.profiler on real tensors, every category within 3% (measured: within 0.01%, parameters and optimizer
    state to the byte). What each adds to plain LoRA, measured: the embeddings and head trained whole keep their frozen
    originals and add a copy in the trained dtype (fp32) with two AdamW moments each (and a step count), one table
    where the head is tied to the embeddings; token rows add a few kB of parameters and state."""
    cfg = _wide(tied)
    strategy = Strategy(precision=precision, micro_batch_size=2)
    predicted = predict_run(cfg, 128, strategy, lora, on_gpu=False).peak
    measured = measured_steady_step(StepSpec(cfg, 128, strategy, lora, host_is_device=True))
    assert_within_3pct_per_category(predicted, measured)
    plain = measured_steady_step(StepSpec(cfg, 128, strategy, LoraConfig(enabled=True), host_is_device=True))
    added = measured[Category.PARAMS] - plain[Category.PARAMS], measured[Category.OPTIMIZER] - plain[Category.OPTIMIZER]
    table = 2048 * 256 * 4  # one fp32 copy of the embeddings (or the head)
    if lora is SAVED:
        tables = 1 if tied else 2
        assert added == (tables * table, 2 * tables * table + 4 * tables)  # AdamW's step count: 4 bytes a tensor
    else:
        assert added == (3 * 256 * 4, 2 * 3 * 256 * 4 + 4)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize(
    "saved, tokens, targets",
    [
        (["embed_tokens", "lm_head"], [], ["all-linear"]),
        (["lm_head", "norm", "o_proj", "input_layernorm"], [], ["q_proj", "v_proj"]),
        ([], [3, 4, 3], ["gate_proj", "down_proj"]),
        (["embed_tokens"], [], ["k_proj"]),
    ],
)
def test_the_cost_model_counts_what_the_real_model_trains(tied, saved, tokens, targets):
    """``TrainedWhole``, which the step-time model and ZeRO's gradient sharding read from the config alone (the warm
    search runs without torch), against the trained parameters PEFT makes: the root group's (embeddings, final norm,
    head), the decoder layers' (modules trained whole, and the adapters), element for element."""
    cfg = wide_tiny_config(3)
    cfg.tie_word_embeddings = tied
    lora = LoraConfig(enabled=True, rank=4, modules_to_save=saved, trainable_tokens=tokens, target_modules=targets)
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        model = apply_lora(AutoModelForCausalLM.from_config(cfg), lora, precision_policy("fp32"))
    in_layers = {id(p) for layer in decoder_layers(model) for p in layer.parameters()}
    trained = {id(p): (n, p.numel()) for n, p in model.named_parameters() if p.requires_grad}
    root = sum(k for i, (_, k) in trained.items() if i not in in_layers)
    adapters = sum(k for i, (n, k) in trained.items() if i in in_layers and ".lora_" in n)
    whole = sum(k for i, (n, k) in trained.items() if i in in_layers and ".lora_" not in n)
    counted = TrainedWhole.of(Shape.of(cfg), lora, tied)
    assert (counted.root, counted.per_layer * 3, counted.adapters_per_layer * 3) == (root, whole, adapters)
    assert counted.head == any(p.requires_grad for p in model.get_output_embeddings().parameters())
    if root:  # FSDP2's root group holds the gradients of what is trained there
        share = ShardingSpec.for_model(2, 2, "fsdp2", cfg, lora).root_grad_fraction
        assert share == pytest.approx(root / (root + whole + adapters))


@pytest.mark.parametrize("beside", ["lora.modules_to_save=[embed_tokens]", "lora.trainable_tokens=[2,7,11]"])
def test_lora_with_trained_embeddings_trains_resumes_exactly_and_exports_for_peft(
    beside, tiny_cfg, tmp_path, embedded_dir
):
    """The tiny preset (its head tied to its embeddings): the embeddings trained whole or in three rows change, the
    head stays the same tensor as the embeddings, a resume from step 4 repeats steps 5 and 6 exactly, and the export
    is a PEFT adapter that gives the trained model's logits on the base it names."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_dir = tmp_path / "tiny-hf"
    build_model(ModelSource("preset", preset="tiny"), tiny_cfg().model, torch.float32, seed=3).save_pretrained(base_dir)
    AutoTokenizer.from_pretrained(embedded_dir).save_pretrained(base_dir)
    run = (f"model.source={base_dir}", "lora.enabled=true", beside, "optimizer.lr=1e-2", "train.checkpoint_every=2")
    run += ("train.eval_every=0", "output.export=true")
    trainer, result = fitted(tiny_cfg(*run))
    model = trainer.model
    trained = [
        {id(p) for p in m.parameters() if p.requires_grad} for m in (model.get_input_embeddings(), model.lm_head)
    ]
    assert trained[0] and trained[0] == trained[1]  # the head's trained tensors are the embeddings'
    losses = [r["loss"] for r in result.steps]
    tokens = trainer.eval[0][0][:, :-1]
    model.eval()
    with torch.no_grad():
        want = model(input_ids=tokens).logits
        base = AutoModelForCausalLM.from_pretrained(base_dir)
        before = base(input_ids=tokens).logits
        got = PeftModel.from_pretrained(base, trainer.run.export).eval()(input_ids=tokens).logits
    assert not torch.allclose(before, want, atol=1e-4), "training must have changed the model"
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    shutil.rmtree(trainer.run.checkpoints / "step_0000006")
    _, rest = fitted(tiny_cfg(*run, "train.resume=true"))
    assert [r["loss"] for r in rest.steps] == losses[4:]


def _tiny_model(tied: bool = True):
    from transformers import AutoModelForCausalLM

    cfg = wide_tiny_config(2)
    cfg.tie_word_embeddings = tied
    return AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize(
    "settings, message",
    [
        (
            dict(modules_to_save=["embeddings"]),
            r"lora.modules_to_save: 'embeddings' is no module of this model \(did you mean 'embed_tokens'\?\); e.g. "
            r"down_proj, embed_tokens, gate_proj, input_layernorm, k_proj, lm_head, norm, o_proj, ",
        ),
        (
            dict(modules_to_save=["q_proj"]),
            r"lora.modules_to_save: 'q_proj' gets adapters \(lora.target_modules\): a module is adapted or trained "
            r"whole, not both; name it in one of the two$",
        ),
        (
            dict(modules_to_save=["self_attn"]),
            r"'self_attn' holds q_proj, which gets adapters \(lora.target_modules\)",
        ),
        (
            dict(target_modules=["q_proj", "embed_tokens"]),  # as Unsloth's continued-pretraining recipe lists it
            r"^lora.target_modules: 'embed_tokens' is the embeddings, not a Linear module: to train them, name it in "
            r"lora.modules_to_save \(trained whole\) or give lora.trainable_tokens \(only those rows\)$",
        ),
        (
            dict(trainable_tokens=[5, 2048]),
            r"lora.trainable_tokens: token id 2048 is past this model's vocabulary of 2048 embedding rows; give ids "
            r"below 2048$",
        ),
        (
            dict(trainable_tokens=[5], modules_to_save=["lm_head"]),  # tied: the head's rows are the embeddings'
            r"lora.trainable_tokens trains rows of the input embeddings, and lora.modules_to_save 'lm_head' trains "
            r"them whole: keep one of the two$",
        ),
    ],
)
def test_what_peft_would_skip_or_refuse_is_one_line(settings, message):
    """PEFT skips a modules_to_save name that matches no module (a typo trained nothing beside the adapters), says
    "No modules were targeted" for an adapted one, and an IndexError for a token id past the vocabulary."""
    with pytest.raises(UserError, match=message):
        apply_lora(_tiny_model(), LoraConfig(enabled=True, **settings), precision_policy("fp32"))


def test_an_untied_head_trains_whole_beside_trained_token_rows():
    """Untied, the head is no view of the embeddings' rows: both are allowed, and both train."""
    model = apply_lora(
        _tiny_model(tied=False),
        LoraConfig(enabled=True, trainable_tokens=[5], modules_to_save=["lm_head"]),
        precision_policy("fp32"),
    )
    trained = [n for n, p in model.named_parameters() if p.requires_grad and ".lora_" not in n]
    assert len(trained) == 2 and any("trainable_tokens_delta" in n for n in trained)


def test_trainable_tokens_in_a_config_are_integers_and_need_lora(tiny_cfg):
    assert tiny_cfg("lora.enabled=true", "lora.trainable_tokens=128000, 128009").lora.trainable_tokens == [
        128000,
        128009,
    ]
    assert tiny_cfg("lora.enabled=true", "lora.trainable_tokens=128009").lora.trainable_tokens == [128009]
    with pytest.raises(UserError, match=r"lora.trainable_tokens must be a list of integers, e.g. \[128000, 128009\] "):
        tiny_cfg("lora.trainable_tokens=true")
    with pytest.raises(
        UserError,
        match=r"^lora.modules_to_save trains beside a LoRA run's adapters, and a full fine-tune trains every weight: "
        r"set lora.enabled=true or leave lora.modules_to_save empty$",
    ):
        tiny_cfg("lora.enabled=false", "lora.modules_to_save=[embed_tokens]")
    with pytest.raises(UserError, match=r"lora.trainable_tokens must be a list of integers, e.g. \[128000, 128009\] "):
        tiny_cfg("lora.trainable_tokens=[eos]")
    with pytest.raises(UserError, match=r"lora.trainable_tokens are token ids, each >= 0 \(got -1\)"):
        tiny_cfg("lora.trainable_tokens=[3,-1]")
