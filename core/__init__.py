"""tempering: plugin-based LLM post-training that runs locally or on Tinker.

The core is small on purpose: data types (:mod:`tempering.types`), the component interfaces
(:mod:`tempering.interfaces`), the plugin registry (:mod:`tempering.registry`), config handling
(:mod:`tempering.training.config`), recipes (:mod:`tempering.training.recipe`) and the CLI. Everything that does
work -- backends, rewards, losses, algorithms -- is a plugin, the built-ins included.

Importing this package must stay cheap (no torch), so that ``tempering plugins`` and
``--help`` are fast: the rest of the public surface (:mod:`tempering.api`: ``Recipe``, the
stage and loss types, ...) is imported on first use, ``from tempering import Recipe``.
"""

from __future__ import annotations

__version__ = "0.1.0"

from tempering.errors import ConfigError, PluginError, TemperingError, UnknownComponentError
from tempering.hookspecs import hookimpl
from tempering.types import AdamParams, Batch, Completion, Datum, Group, Sample, SamplingParams

__all__ = [
    "__version__",
    "AdamParams",
    "Batch",
    "Completion",
    "ConfigError",
    "Datum",
    "Group",
    "PluginError",
    "Sample",
    "SamplingParams",
    "TemperingError",
    "UnknownComponentError",
    "hookimpl",
    "Recipe",
    "RLStage",
    "Stage",
]


def __getattr__(name: str) -> object:
    """The names of :mod:`tempering.api` not imported above, imported when first asked for."""
    import tempering.api as api  # an import statement, not `from tempering import`: that would ask __getattr__

    if name in api.__all__:
        return getattr(api, name)
    raise AttributeError(f"module 'tempering' has no attribute {name!r}")


def __dir__() -> list[str]:
    import tempering.api as api

    return sorted(set(__all__) | set(api.__all__))
