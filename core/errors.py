"""Error types. Every error says what is wrong *and* how to fix it."""

from __future__ import annotations


class TemperingError(Exception):
    """Base class for errors raised by tempering."""


class ConfigError(TemperingError, ValueError):
    """A recipe or component config is invalid. The message names the key's path.

    ``path`` and ``message`` (the text without the ``path: `` prefix) stay apart as attributes,
    so a check that shares a raising helper with the builder can report the error as a
    :class:`~tempering.schema.Problem` without parsing the text (:func:`tempering.schema.caught`)."""

    def __init__(self, message: str, path: str | None = None) -> None:
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}" if path else message)


class UnknownComponentError(TemperingError, KeyError):
    """A component name is not registered. The message lists the known names."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class PluginError(TemperingError):
    """A plugin is broken: duplicate component names, a failing import in strict mode, ..."""


class StopRun(Exception):
    """Raised inside a stage to stop the whole run cleanly: :func:`tempering.training.recipe.run_recipe`
    checkpoints the stage as unfinished, closes everything and raises :class:`RunStopped` with
    this exception's message. Not a :class:`TemperingError`: it is control flow, never shown.

    It lives here, beside the errors, rather than in :mod:`tempering.training.recipe`, so that the
    modules that stop a run (:mod:`tempering.runs.failures`) need not import the recipe runner
    (that import closed a cycle through the stage loop)."""


class RunStopped(TemperingError):
    """A stage stopped the run on purpose (:class:`StopRun`); the run is checkpointed and
    resumes when started again. The CLI prints it as one line and exits non-zero."""
