"""The model config a plan reads, without importing transformers' modeling code: a preset needs only its config
class, so ``memfit plan`` answers from cached traces without loading what builds and loads models."""

from __future__ import annotations

from pathlib import Path

from memfit.config.schema import EMBEDDED_MODEL, ModelConfig
from memfit.errors import UserError, did_you_mean
from memfit.models.presets import PRESETS, preset_config


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


def config_for_planning(model: str, attn_implementation: str = "sdpa"):
    """A model config from a preset name (``llama2-7b`` or ``random:llama2-7b``), the embedded model's
    name, a checkpoint directory or a ``config.json`` path — no weights are read.

    Raises:
        UserError: unknown name (with the closest preset) or a path without a config.
    """
    name = model.split(":", 1)[1] if model.startswith("random:") else model
    if name in PRESETS:
        return preset_config(name, attn_implementation)
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
