"""The model config a plan reads (a "planning config"), without importing what builds and loads models, so ``memfit
plan`` answers from cached traces without importing transformers or torch: a preset is plain data
(``presets.Preset``), and a checkpoint's or a ``config.json``'s config is a ``ReadConfig``: what transformers read
from the file once, kept in the memfit cache (``$MEMFIT_CONFIG_CACHE``, default ``<memfit cache>/configs``, ``off``
turns it off) under the SHA-256 of the file's bytes, the attention implementation and ``cache.code_and_versions``.

The planner reads a planning config's shape attributes (``num_hidden_layers``, ``hidden_size``, ...); the tracer
builds a model from ``transformers_config(config)``; the trace cache names it by ``config_key(config)``, which for a
``ReadConfig`` is the JSON of the transformers config it was read as, so the trainer (which holds that config) and
``memfit plan`` name their traces alike."""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

from memfit.cache import cache_dir, cache_root, code_and_versions, digest, file_digest, read_entry, write_entry
from memfit.config.schema import EMBEDDED_MODEL, ModelConfig
from memfit.errors import UserError, did_you_mean, hub_hint
from memfit.models.presets import PRESETS, ModelShape, Preset, preset

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SHAPE = (*(f.name for f in fields(ModelShape)), "tie_word_embeddings")
"""The attributes of a model config that the planner reads (besides building the model to trace it)."""


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts MLP, as its step-time model reads it: ``count`` experts of ``intermediate`` each, of
    which ``per_token`` run for each token, beside a shared MLP of ``shared_intermediate`` that every token runs (0:
    none), in all decoder layers but ``dense_layers`` of them, which hold a dense MLP of the config's
    ``intermediate_size`` (DeepSeek's first ``first_k_dense_replace``, Qwen-MoE's ``mlp_only_layers`` and those
    between its ``decoder_sparse_step``). A dense model is one expert, always run."""

    count: int = 1
    per_token: int = 1
    intermediate: int = 0  # 0: the config's intermediate_size
    shared_intermediate: int = 0
    dense_layers: int = 0  # found by building the model (``layer_kinds``): ``Experts.of`` reads the config only

    @classmethod
    def of(cls, config) -> Experts:
        """A transformers config's experts: Mixtral's and gpt-oss's ``num_local_experts``, Qwen-MoE's and OLMoE's
        ``num_experts``, DeepSeek's ``n_routed_experts`` (with ``moe_intermediate_size`` where it is given, and a
        shared MLP of ``shared_expert_intermediate_size`` or ``n_shared_experts`` experts)."""
        count = next((v for k in EXPERT_COUNTS if isinstance(v := getattr(config, k, None), int) and v > 1), 1)
        if count == 1:
            return cls()
        intermediate = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        shared = getattr(config, "shared_expert_intermediate_size", None) or 0
        shared = shared or (getattr(config, "n_shared_experts", None) or 0) * intermediate
        per_token = next((v for k in EXPERTS_PER_TOKEN if (v := getattr(config, k, None))), 1)
        return cls(count, min(per_token, count), intermediate, shared)


EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")
EXPERTS_PER_TOKEN = ("num_experts_per_tok", "experts_per_token")


@dataclass(frozen=True)
class Attention:
    """A decoder layer's attention as its step-time model reads it: its projections' ``weights``, and the widths of
    its queries (and keys) and of its values over all heads, which its core's FLOPs grow with. In grouped-query
    attention both are heads x ``head_dim``, which a config may set apart from ``hidden_size / heads`` (Qwen3's
    and Gemma's do: Qwen3-30B-A3B's are twice its hidden size); DeepSeek's multi-head latent attention projects
    through low ranks (``q_lora_rank``, ``kv_lora_rank``) to query heads of ``qk_nope_head_dim +
    qk_rope_head_dim`` and value heads of ``v_head_dim``."""

    weights: int
    q_width: int
    v_width: int

    @classmethod
    def of(cls, config) -> Attention:
        """A model config's attention (a preset's or a transformers config's)."""
        hidden, heads = config.hidden_size, config.num_attention_heads
        kv_rank = getattr(config, "kv_lora_rank", None)
        if kv_rank:  # multi-head latent attention
            rope, nope, v = config.qk_rope_head_dim, config.qk_nope_head_dim, config.v_head_dim
            q_rank = getattr(config, "q_lora_rank", None)
            q = (hidden + heads * (nope + rope)) * q_rank if q_rank else hidden * heads * (nope + rope)
            kv = hidden * (kv_rank + rope) + kv_rank * heads * (nope + v)
            return cls(q + kv + heads * v * hidden, heads * (nope + rope), heads * v)
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(2 * hidden * (heads + kv_heads) * head_dim, heads * head_dim, heads * head_dim)  # q, o; k, v


def layer_kinds(config: PretrainedConfig) -> tuple[tuple[int, ...], int]:
    """For each decoder layer of a transformers ``config``, the index of its kind: layers alike in their weights'
    names and shapes are one kind. A mixture of experts' dense first layers (DeepSeek's ``first_k_dense_replace``,
    Qwen-MoE's ``mlp_only_layers``) or dense layers between its sparse ones (``decoder_sparse_step``) are a kind of
    their own. And how many layers hold no experts (no weight under an ``experts`` module). The model is built on
    the meta device: no memory, about a second for a 30B one."""
    import torch
    from transformers import AutoModelForCausalLM

    from memfit.models.load import decoder_layers

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    kinds: dict[tuple, int] = {}
    layers = decoder_layers(model, "--model")
    dense = sum(not any("experts" in name.split(".") for name, _ in layer.named_parameters()) for layer in layers)
    return tuple(
        kinds.setdefault(tuple((n, tuple(p.shape)) for n, p in layer.named_parameters()), len(kinds))
        for layer in layers
    ), dense


_KINDS: dict[str, tuple[tuple[int, ...], int]] = {}


def _stack(config: PretrainedConfig) -> tuple[tuple[int, ...], int]:
    """``layer_kinds`` of a transformers config with experts, found once per process; a dense one's: none, none."""
    if Experts.of(config).count == 1:  # dense Llama-family stacks are alike throughout
        return (), 0
    key = _transformers_key(config)
    return _KINDS[key] if key in _KINDS else _KINDS.setdefault(key, layer_kinds(config))


def layer_prefix(config: PlanningConfig) -> int | None:
    """How many first decoder layers differ from the rest, which are all of one kind (0: every layer alike, as in a
    Llama); None where the rest are not (layers of two kinds in turn). A read config keeps its layers' kinds; a
    transformers config's are found once per process."""
    if isinstance(config, Preset):
        return 0
    kinds = config.layers if isinstance(config, ReadConfig) else _stack(config)[0]
    if not kinds:
        return 0
    last = kinds[-1]
    prefix = len(kinds)
    while prefix and kinds[prefix - 1] == last:
        prefix -= 1
    return prefix if last not in kinds[:prefix] else None


def attention(config: PlanningConfig) -> Attention:
    """The attention of a planning config."""
    return config.attention if isinstance(config, ReadConfig) else Attention.of(config)


def attention_note(config: PlanningConfig, asked: str) -> str | None:
    """What to say where a model of ``config`` runs another attention kernel than ``asked`` (``attention_kernel``:
    eager, where the architecture has no sdpa), or None."""
    if isinstance(config, Preset):
        return None
    read = isinstance(config, ReadConfig)
    runs = config.attn_implementation if read else getattr(config, "_attn_implementation", None) or asked
    if runs == asked:
        return None
    model_type = json.loads(config.json).get("model_type") if read else getattr(config, "model_type", None)
    return (
        f"{model_type or 'this model'} has no {asked} attention in transformers: it runs {runs} "
        f"attention (model.attn_implementation={runs}), whose scores, T x T per head, each layer holds; planned and "
        "trained so"
    )


EXPERTS_LOOP_NOTE = (
    "the config asks for experts_implementation 'eager', transformers' loop over the experts, whose shapes the routing "
    "sets and a trace cannot follow: planned as its default, grouped_mm (on small Mixtral and Qwen3-MoE steps the "
    "loop's peak measured 5-6% from it: above it without activation checkpointing, below it with full)"
)


def asks_experts_loop(config: PlanningConfig) -> bool:
    """Whether ``config``, a mixture of experts, asks for transformers' eager loop over its experts
    (``"experts_implementation": "eager"``), which the planner traces as grouped_mm (``EXPERTS_LOOP_NOTE``)."""
    if isinstance(config, Preset):
        return False
    asks = config.experts_loop if isinstance(config, ReadConfig) else config_asks_loop(config)
    return asks and experts(config).count > 1


def config_asks_loop(config: PretrainedConfig) -> bool:
    """Whether a transformers config asks for the eager experts loop (its own ``experts_implementation``)."""
    return getattr(config, "_experts_implementation", None) == "eager"


def experts(config: PlanningConfig) -> Experts:
    """The experts of a planning config (a preset's: one, dense), its dense layers counted."""
    if isinstance(config, Preset):
        return Experts()
    if isinstance(config, ReadConfig):
        return config.experts
    return replace(Experts.of(config), dense_layers=_stack(config)[1])


@dataclass(frozen=True)
class ReadConfig(ModelShape):
    """A checkpoint's or a ``config.json``'s model config as the planner reads it: its shape, the file it came from
    and the JSON of the transformers config transformers read it as (``config_key``)."""

    tie_word_embeddings: bool
    path: str
    attn_implementation: str
    json: str
    attention: Attention
    experts: Experts = Experts()
    layers: tuple[int, ...] = ()  # each decoder layer's kind (``layer_kinds``)
    experts_loop: bool = False  # asks for transformers' eager loop over its experts (``asks_experts_loop``)

    @classmethod
    def of(cls, path: Path, attn_implementation: str, config: PretrainedConfig) -> ReadConfig:
        """``config`` (transformers', as read from ``path``) as plain data."""
        values = {name: getattr(config, name, None) for name in SHAPE}
        values["num_key_value_heads"] = values["num_key_value_heads"] or config.num_attention_heads
        return cls(
            **values,
            path=str(path),
            attn_implementation=attn_implementation,
            json=_transformers_key(config),
            attention=Attention.of(config),
            experts=experts(config),
            layers=_stack(config)[0],
            experts_loop=config_asks_loop(config),
        )

    @classmethod
    def parsed(cls, data: dict) -> ReadConfig:
        """A read config from its cache entry (``asdict``'s)."""
        parts = {"attention": Attention(**data["attention"]), "experts": Experts(**data["experts"])}
        return cls(**{**data, **parts, "layers": tuple(data["layers"])})


if TYPE_CHECKING:
    PlanningConfig = Preset | ReadConfig | PretrainedConfig


def planning_config_file(model: str) -> Path | None:
    """The ``config.json`` that ``config_for_planning(model)`` reads, or None for a preset (no file)."""
    name = model.removeprefix("random:")
    if name in PRESETS:
        return None
    if model == EMBEDDED_MODEL:
        converted = cache_dir() / EMBEDDED_MODEL / "config.json"
        if converted.is_file():  # converted before (``load.embedded_checkpoint_dir``): the converter not imported
            return converted
        from memfit.models.load import embedded_checkpoint_dir

        return embedded_checkpoint_dir() / "config.json"
    path = Path(name).expanduser()
    return path if path.is_file() else path / "config.json"


def config_for_planning(model: str, attn_implementation: str = "sdpa") -> PlanningConfig:
    """A planning config (a ``Preset`` or a ``ReadConfig``) from a preset name (``llama2-7b`` or
    ``random:llama2-7b``), the embedded model's name, a checkpoint directory or a ``config.json`` path; no weights
    are read. A file read before (the same bytes) is taken from the config cache without importing transformers.

    Raises:
        UserError: unknown name (with the closest preset) or a path without a usable config.
    """
    name = model.removeprefix("random:")
    if name in PRESETS:
        return preset(name, attn_implementation)
    file = planning_config_file(model)
    key = None
    if file is not None and file.is_file():
        key = digest(
            {
                "config": file_digest(file),
                "attn": attn_implementation,
                "code": code_and_versions(),
            }
        )
        cached = _load(key)
        if cached is not None:  # the same bytes, maybe another copy of them: this one is read where it is read again
            return replace(cached, path=str(file))
    config = _read(model, name, attn_implementation)
    read = ReadConfig.of(file, config._attn_implementation, config)
    if key is not None:
        write_entry(cache_root("MEMFIT_CONFIG_CACHE", "configs"), key, asdict(read))
    return read


def _read(model: str, name: str, attn_implementation: str) -> PretrainedConfig:
    """Transformers' config of a checkpoint directory, the embedded model or a ``config.json`` (validated)."""
    from memfit.models.load import model_config, resolve_source

    path = Path(name).expanduser()
    if path.is_file() and path.name.endswith(".json"):
        return _read_file(path, attn_implementation)
    if model == EMBEDDED_MODEL or path.is_dir() or (path.is_file() and path.suffix == ".gguf"):  # GGUF: said there
        return model_config(resolve_source(model), ModelConfig(attn_implementation=attn_implementation))
    raise UserError(
        f"--model: '{model}' is not a preset, a checkpoint directory or a config.json{did_you_mean(name, PRESETS)}"
        f"{hub_hint(model, 'hf download {0} config.json --local-dir DIR')}; "
        f"presets: {', '.join(PRESETS)}"
    )


def _load(key: str) -> ReadConfig | None:
    """The config cache's entry ``key``, or None (not cached, off, or damaged: said in one line and removed)."""
    return read_entry(cache_root("MEMFIT_CONFIG_CACHE", "configs"), key, "config", ReadConfig.parsed)


def _read_file(path: Path, attn_implementation: str, built: bool = True) -> PretrainedConfig:
    """Transformers' config of a ``config.json`` (or another JSON file of one), validated (``load.read_config``;
    ``built``: not yet built, so one layer of it is)."""
    from memfit.models.load import attention_kernel, read_config

    config = read_config(path.parent if path.name == "config.json" else path, "--model", built=built)
    config._attn_implementation = attention_kernel(config, attn_implementation)
    return config


def transformers_config(config: PlanningConfig) -> PretrainedConfig:
    """A transformers config of ``config`` that the caller may change: a preset's built, a read one read again from
    its file, a transformers one copied."""
    if isinstance(config, Preset):
        return config.llama_config()
    if isinstance(config, ReadConfig):
        return _read_file(Path(config.path), config.attn_implementation, built=False)  # built as it was read
    return copy.deepcopy(config)


def config_key(config: PlanningConfig) -> str:
    """What names ``config`` in a cache key: a preset's fields, or a transformers config's JSON (a read config's as
    it was read)."""
    if isinstance(config, Preset):
        return json.dumps({"preset": asdict(config)}, sort_keys=True)
    if isinstance(config, ReadConfig):
        return config.json
    return _transformers_key(config)


def _transformers_key(config: PretrainedConfig) -> str:
    """A transformers config's whole JSON but where it was read from (``_name_or_path``: a directory or its
    config.json, another copy of the same file), which changes no trace."""
    values = config.to_dict()
    values.pop("_name_or_path", None)
    return json.dumps(values, sort_keys=True, default=str)
