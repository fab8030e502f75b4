"""Errors of the Tinker backend. Each is one line that says what to do (the CLI prints a
:class:`~tempering.errors.TemperingError` without a traceback)."""

from __future__ import annotations

from tempering.errors import TemperingError

INSTALL_HINT = 'pip install "tempering[tinker]"'
KEY_HINT = (
    "set TINKER_API_KEY to your Tinker API key (it starts with 'tml-'; create one in the Tinker console), "
    "or pass backend.api_key"
)


class TinkerBackendError(TemperingError, RuntimeError):
    """The Tinker service or SDK failed in a way the backend could not recover from."""


class TinkerNotInstalledError(TemperingError, ImportError):
    """The ``tinker`` extra is not installed."""


class TinkerAuthError(TinkerBackendError):
    """The API key is missing, malformed or rejected."""


class TinkerServiceError(TinkerBackendError):
    """A retryable service error (rate limit, timeout, connection, 5xx) that outlasted the retries,
    or a non-retryable one (bad request, not found, ...)."""


class TinkerTrainingError(TinkerBackendError):
    """A training call (forward_backward, optim_step, save_state, ...) failed after submission.

    Never retried: the service may already have applied it (see docs/tinker.md, "Retries")."""


def one_line(text: str) -> str:
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())
