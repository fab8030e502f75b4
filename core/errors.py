"""Error types. Every error says what is wrong *and* how to fix it."""

from __future__ import annotations


class TemperingError(Exception):
    """Base class for errors raised by tempering."""


class ConfigError(TemperingError, ValueError):
    """A recipe or component config is invalid. The message names the key's path."""

    def __init__(self, message: str, path: str | None = None) -> None:
        self.path = path
        super().__init__(f"{path}: {message}" if path else message)


class UnknownComponentError(TemperingError, KeyError):
    """A component name is not registered. The message lists the known names."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class PluginError(TemperingError):
    """A plugin is broken: duplicate component names, a failing import in strict mode, ..."""
