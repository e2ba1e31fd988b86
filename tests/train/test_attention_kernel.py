"""Architectures that transformers runs without sdpa attention (Gemma-2's logit softcapping, GPT-OSS's sinks):
memfit asks for sdpa, which transformers refuses for them."""

import pytest
import torch
import transformers
from support.measured import assert_within_3pct_per_category
from transformers import AutoModelForCausalLM, AutoTokenizer

from memfit.cli import main
from memfit.config.schema import ModelConfig
from memfit.config.strategy import Strategy
from memfit.models.load import ModelSource, build_model, model_config
from memfit.models.planning import attention_note, config_for_planning
from memfit.planner.measure import measured_steady_step
from memfit.planner.trace import StepSpec, trace_step

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
SMALL |= dict(head_dim=16, vocab_size=256, max_position_embeddings=256)


ARCHS = {
    "gpt_oss": lambda: transformers.GptOssConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2),
    "gemma2": lambda: transformers.Gemma2Config(**SMALL),  # sdpa in transformers 5.17, none in 5.25
}


@pytest.mark.parametrize("arch", ARCHS)
def test_a_config_without_sdpa_is_planned_with_eager_attention_and_says_so(arch, tmp_path, capsys):
    """``memfit plan`` of a GPT-OSS or (transformers 5.25) Gemma-2 ``config.json`` ended in a traceback
    (transformers' "does not support an attention implementation through torch.nn.functional.scaled_dot_product_
    attention"). It is planned with eager attention, as transformers itself falls back, and the plan says so; the
    trace of that step within 3% of the profiler's, per category. Architectures with sdpa keep it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = ARCHS[arch]()
    if MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]._supports_sdpa:
        pytest.skip(f"transformers {transformers.__version__} runs {arch} with sdpa")
    config.save_pretrained(tmp_path / arch)
    transformers.LlamaConfig(**SMALL).save_pretrained(tmp_path / "llama")
    read = config_for_planning(str(tmp_path / arch))
    assert read.attn_implementation == "eager"
    assert attention_note(read, "sdpa").startswith(f"{arch} has no sdpa attention in transformers: it runs eager")
    assert config_for_planning(str(tmp_path / "llama")).attn_implementation == "sdpa"
    assert attention_note(config_for_planning(str(tmp_path / "llama")), "sdpa") is None
    assert attention_note(config_for_planning(str(tmp_path / arch), "eager"), "eager") is None  # as asked
    spec = StepSpec(read, 64, Strategy(optimizer="foreach", micro_batch_size=2))
    assert_within_3pct_per_category(trace_step(spec).peak, measured_steady_step(spec))
    pinned = ["--seq-len", "64", "--precision", "bf16-pure", "--ac", "none", "--micro-batch", "2"]
    assert main(["plan", "--model", str(tmp_path / arch), "--gpu", "h100", *pinned]) == 0
    assert f"note: {arch} has no sdpa attention in transformers" in capsys.readouterr().out


@pytest.mark.parametrize("kind", ["random", "checkpoint"])
def test_a_model_without_sdpa_trains_with_eager_attention(kind, tmp_path, embedded_dir):
    """``memfit train`` of a GPT-OSS (a random one from its config.json, or a checkpoint directory) ended in the same
    traceback; it builds the model with eager attention, and the run's notes say so."""
    vocab = {"vocab_size": 49152}  # the tokenizer's: a checkpoint's embeddings hold each of its ids
    config = transformers.GptOssConfig(**(SMALL | vocab), num_local_experts=4, num_experts_per_tok=2)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model.save_pretrained(tmp_path / "oss")
    AutoTokenizer.from_pretrained(embedded_dir).save_pretrained(tmp_path / "oss")
    source = ModelSource("preset" if kind == "random" else "hf", path=tmp_path / "oss")
    assert attention_note(model_config(source, ModelConfig()), "sdpa").startswith("gpt_oss has no sdpa attention")
    built = build_model(source, ModelConfig(), torch.float32, 0)
    assert built.config._attn_implementation == "eager"
    ids = torch.randint(0, 256, (2, 16))
    built(ids, labels=ids).loss.backward()
    model_source = f"random:{tmp_path / 'oss'}" if kind == "random" else str(tmp_path / "oss")
    run = ["train", "tiny-cpu", f"model.source={model_source}", "data.seq_len=32", "data.max_documents=2"]
    run += ["train.device=cpu", "train.max_steps=1", "train.eval_every=0", f"output.dir={tmp_path / 'run'}"]
    run += ["output.export=false"]
    assert main(run) == 0
