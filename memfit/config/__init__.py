"""Typed run configuration (``schema``) and its YAML / ``key=value`` loader (``loader``)."""

from memfit.config.loader import dump_config, load_config
from memfit.config.schema import RunConfig

__all__ = ["RunConfig", "dump_config", "load_config"]
