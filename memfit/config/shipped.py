"""The configs that ship with memfit (``memfit/configs/*.yaml``), by name, and how a command argument
names one: a file, a shipped name, or nothing (the default)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from memfit.errors import UserError, did_you_mean, not_a_file

DEFAULT_CONFIG = "smollm2-shakespeare-lora-cpu"


def shipped_configs() -> dict[str, Path]:
    """Configs that ship with memfit, by name (file name without .yaml)."""
    root = resources.files("memfit") / "configs"
    return {Path(p.name).stem: Path(str(p)) for p in root.iterdir() if p.name.endswith(".yaml")}


def resolve_config_path(arg: str | None) -> Path:
    """A config path from the argument: a file, a shipped config name, or the default when absent.

    Raises:
        UserError: the argument is neither a file nor a shipped name.
    """
    if arg is None:
        return shipped_configs()[DEFAULT_CONFIG]
    if Path(arg).is_file():
        return Path(arg)
    shipped = shipped_configs()
    if arg in shipped:
        return shipped[arg]
    if Path(arg).exists():
        raise UserError(f"config '{arg}' {not_a_file(arg)}; give a YAML file or a shipped config")
    raise UserError(
        f"config '{arg}' is neither a file nor a shipped config{did_you_mean(arg, shipped)}; "
        f"shipped: {', '.join(sorted(shipped))}"
    )


def split_train_args(args: list[str]) -> tuple[str | None, list[str]]:
    """The optional CONFIG (first argument without '=') and the key=value overrides."""
    config = None
    overrides = []
    for a in args:
        if "=" in a or config is not None:
            overrides.append(a)
        else:
            config = a
    return config, overrides
