"""Named Llama-family architectures, built from config alone (random weights).

Used by tests (``tiny``), benchmarks and the planner. Shapes follow the published configs of each
model; vocab sizes are the models' own, so a preset is only trainable with a tokenizer whose vocabulary
fits (the embedded SmolLM2 tokenizer has 49,152 tokens: ``tiny`` and ``smollm2-135m`` match it).

A ``Preset`` is plain data with the attribute names of a transformers config, so the planner reads its shape
without importing transformers (or torch, which transformers' config classes import): a search whose traces
are all cached never does. ``Preset.llama_config`` builds the transformers config where a model is built.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from memfit.errors import UserError, did_you_mean

if TYPE_CHECKING:
    from transformers import LlamaConfig


@dataclass(frozen=True)
class ModelShape:
    """What the planner reads of a Llama-family model config besides building the model to trace it (with
    ``tie_word_embeddings``, which each kind of planning config carries with its own default)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int


@dataclass(frozen=True)
class Preset(ModelShape):
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool = False
    attn_implementation: str = "sdpa"

    def llama_config(self) -> LlamaConfig:
        """This architecture's ``LlamaConfig`` (a new one each call)."""
        from transformers import LlamaConfig

        config = LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            bos_token_id=1,
            eos_token_id=2,
        )
        config._attn_implementation = self.attn_implementation
        return config


PRESETS: dict[str, Preset] = {
    "tiny": Preset(49152, 64, 128, 2, 4, 2, 1024, 10000.0, 1e-5, tie_word_embeddings=True),
    "smollm2-135m": Preset(49152, 576, 1536, 30, 9, 3, 8192, 100000.0, 1e-5, tie_word_embeddings=True),
    "llama2-7b": Preset(32000, 4096, 11008, 32, 32, 32, 4096, 10000.0, 1e-5),
    "llama2-13b": Preset(32000, 5120, 13824, 40, 40, 40, 4096, 10000.0, 1e-5),
    "llama2-70b": Preset(32000, 8192, 28672, 80, 64, 8, 4096, 10000.0, 1e-5),
    "llama3-8b": Preset(128256, 4096, 14336, 32, 32, 8, 8192, 500000.0, 1e-5),
}


def preset(name: str, attn_implementation: str = "sdpa") -> Preset:
    """The named preset, with ``attn_implementation``.

    Raises:
        UserError: for an unknown name, with the closest match.
    """
    if name not in PRESETS:
        raise UserError(
            f"model.source: unknown preset '{name}'{did_you_mean(name, PRESETS)}; presets: {', '.join(PRESETS)}"
        )
    return replace(PRESETS[name], attn_implementation=attn_implementation)


def preset_config(name: str, attn_implementation: str = "sdpa") -> LlamaConfig:
    """The ``LlamaConfig`` of a named preset.

    Raises:
        UserError: for an unknown name, with the closest match.
    """
    return preset(name, attn_implementation).llama_config()
