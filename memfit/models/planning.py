"""The model config a plan reads (a "planning config"), without importing what builds and loads models: a preset is
plain data (``presets.Preset``), so ``memfit plan`` answers from cached traces without importing transformers or
torch; a checkpoint's or a ``config.json``'s config is transformers' own (read with its config classes).

The planner reads a planning config's shape attributes (``num_hidden_layers``, ``hidden_size``, ...); the tracer
builds a model from ``transformers_config(config)``; the trace cache names it by ``config_key(config)``."""

from __future__ import annotations

import copy
import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from memfit.config.schema import EMBEDDED_MODEL, ModelConfig
from memfit.errors import UserError, did_you_mean
from memfit.models.presets import PRESETS, Preset, preset

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    PlanningConfig = Preset | PretrainedConfig


def planning_config_file(model: str) -> Path | None:
    """The ``config.json`` that ``config_for_planning(model)`` reads, or None for a preset (no file)."""
    name = model.split(":", 1)[1] if model.startswith("random:") else model
    if name in PRESETS:
        return None
    if model == EMBEDDED_MODEL:
        from memfit.models.load import embedded_checkpoint_dir

        return embedded_checkpoint_dir() / "config.json"
    path = Path(name).expanduser()
    return path if path.is_file() else path / "config.json"


def config_for_planning(model: str, attn_implementation: str = "sdpa") -> PlanningConfig:
    """A planning config (a ``Preset``, or a transformers config) from a preset name (``llama2-7b`` or
    ``random:llama2-7b``), the embedded model's name, a checkpoint directory or a ``config.json`` path; no weights
    are read.

    Raises:
        UserError: unknown name (with the closest preset) or a path without a config.
    """
    name = model.split(":", 1)[1] if model.startswith("random:") else model
    if name in PRESETS:
        return preset(name, attn_implementation)
    from memfit.models.load import model_config, read_config, resolve_source

    path = Path(name).expanduser()
    if path.is_file() and path.name.endswith(".json"):
        config = read_config(path.parent if path.name == "config.json" else path, "--model")
        config._attn_implementation = attn_implementation
        return config
    if model == EMBEDDED_MODEL or path.is_dir():
        return model_config(resolve_source(model), ModelConfig(attn_implementation=attn_implementation))

    raise UserError(
        f"--model: '{model}' is not a preset, a checkpoint directory or a config.json{did_you_mean(name, PRESETS)}; "
        f"presets: {', '.join(PRESETS)}"
    )


def transformers_config(config: PlanningConfig) -> PretrainedConfig:
    """A transformers config of ``config`` that the caller may change: a preset's built, a transformers one copied."""
    return config.llama_config() if isinstance(config, Preset) else copy.deepcopy(config)


def config_key(config: PlanningConfig) -> str:
    """What names ``config`` in a cache key: a preset's fields, or a transformers config's whole JSON."""
    if isinstance(config, Preset):
        return json.dumps({"preset": asdict(config)}, sort_keys=True)
    return config.to_json_string(use_diff=False)
