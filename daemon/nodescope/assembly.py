"""The configuration put together with the sources it configures.

:mod:`nodescope.config` declares every option and validates a file, but knows the sources only
as the catalogue it is handed: every stage reads the configuration, and a configuration that
imported the sources would load them into every detector, hook and command. This module is
where the two meet: it hands the source registry's specs (``[sources.<name>]`` tables, their
default intervals, their own keys and help) to the configuration, for the daemon
(:mod:`nodescope.service`), the commands, the simulator, the documents generated from the
declarations (:mod:`nodescope.docgen`) and the tests.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nodescope import config
from nodescope.config import Config
from nodescope.sources.registry import SOURCES


def load(path: str | Path) -> Config:
    """Read and validate a config file; every problem is a
    :class:`~nodescope.errors.ConfigError`."""
    return config.load(path, catalogue=SOURCES)


def from_mapping(data: Mapping[str, Any], path: str = "<config>") -> Config:
    """Validate a parsed TOML document into a :class:`Config`."""
    return config.from_mapping(data, path, catalogue=SOURCES)


def default_config(**fields: Any) -> Config:
    """The configuration of a file that sets nothing (every source at its spec's defaults),
    with ``fields`` in place of the defaults of those :class:`Config` fields."""
    return Config(**{"sources": config.default_sources(SOURCES), **fields})


def reference_markdown() -> str:
    """The README's configuration reference."""
    return config.reference_markdown(SOURCES)


def sample_toml() -> str:
    """The sample configuration file (``systemd/nodescope.toml``)."""
    return config.sample_toml(SOURCES)


__all__ = ["default_config", "from_mapping", "load", "reference_markdown", "sample_toml"]
