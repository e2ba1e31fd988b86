"""The ``memfit`` command line: a thin layer that parses arguments and hands off to the library."""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

from memfit.errors import UserError

DEFAULT_CONFIG = "smollm2-shakespeare-lora-cpu"


def shipped_configs() -> dict[str, Path]:
    """Configs that ship with memfit, by name (file name without .yaml)."""
    root = resources.files("memfit") / "configs"
    return {Path(p.name).stem: Path(str(p)) for p in root.iterdir() if p.name.endswith(".yaml")}


def resolve_config_path(arg: str | None) -> Path:
    """A config path from the argument: a file, a shipped config name, or the default when absent."""
    if arg is None:
        return shipped_configs()[DEFAULT_CONFIG]
    if Path(arg).is_file():
        return Path(arg)
    shipped = shipped_configs()
    if arg in shipped:
        return shipped[arg]
    from memfit.errors import did_you_mean

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


def cmd_train(ns: argparse.Namespace) -> int:
    from memfit.config.loader import config_help, dump_config, load_config

    if ns.help_config:
        print(config_help())
        return 0
    config_arg, overrides = split_train_args(ns.args)
    cfg = load_config(resolve_config_path(config_arg), overrides)
    if ns.print_config:
        print(dump_config(cfg), end="")
        return 0
    from memfit.train.loop import Trainer

    Trainer(cfg).fit()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memfit", description="Fit LLM fine-tuning into GPU memory, and show where the memory went.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train",
        help="fine-tune a model (full or LoRA) with the configured memory strategies",
        description=(
            "memfit train [CONFIG] [section.key=value ...]\n\nCONFIG is a YAML file or the name of a "
            f"shipped config (default: {DEFAULT_CONFIG}). Overrides such as train.max_steps=10 or "
            "strategy.activation_checkpointing=ffn follow it. --help-config lists every key."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("args", nargs="*", metavar="CONFIG | key=value")
    train.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    train.add_argument("--help-config", action="store_true", help="list every config key with its default and meaning")
    train.set_defaults(func=cmd_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns)
    except UserError as e:
        print(f"memfit: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("memfit: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
