"""Errors of the Tinker backend. Each is one line that says what to do (the CLI prints a
:class:`~tempering.errors.TemperingError` without a traceback), and :func:`translate` turns
what the SDK raises into them.

What the SDK (0.38) raises, and where:

* at setup, *before* a ``create_*`` call returns a future (the first call builds the session:
  ``/client/config``, ``/create_session``): ``AuthenticationError`` (401), ``TinkerError`` (no
  key), connection errors after its own retries;
* at submission, after its own retries (connection errors and 408/409/429/5xx for up to 300 s):
  ``APIStatusError`` subclasses;
* after submission, from a future: ``RequestFailedError`` (the service failed the request;
  ``category`` says whether the request was at fault, ``user``, or the service, ``server``),
  ``ValueError("Error retrieving result: ...")`` (a 4xx while polling), ``RetryableException``
  (the future expired, 410), ``RuntimeError("... poisoned ...")`` (a training client whose
  custom-loss request failed refuses every later request).
"""

from __future__ import annotations

from types import ModuleType

from tempering.errors import TemperingError

INSTALL_HINT = 'pip install "tempering[tinker]"'
KEY_HINT = (
    "set TINKER_API_KEY to your Tinker API key (it starts with 'tml-'; create one in the Tinker console), "
    "or pass backend.api_key"
)
URL_HINT = "check TINKER_BASE_URL (or backend.base_url) and that the service is up"


class TinkerBackendError(TemperingError, RuntimeError):
    """The Tinker service or SDK failed in a way the backend could not recover from."""


class TinkerNotInstalledError(TemperingError, ImportError):
    """The ``tinker`` extra is not installed."""


class TinkerAuthError(TinkerBackendError):
    """The API key is missing, malformed or rejected."""


class TinkerServiceError(TinkerBackendError):
    """A retryable service error (rate limit, timeout, connection, 5xx) that outlasted the retries,
    a request the service rejected (bad request, not found, a name in use, ...), or no answer in
    the configured time."""


class TinkerTrainingError(TinkerBackendError):
    """A training call (forward_backward, optim_step, save_state, ...) failed after submission,
    or got no result in time. The backend recovers from it (a new training client from the last
    saved state, the lost calls repeated) up to ``max_recoveries`` times before raising it."""


class TinkerLossError(TinkerBackendError, ValueError):
    """A custom loss failed its local dry run: nothing was sent, the training client is intact."""


def one_line(text: object) -> str:
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def is_user_failure(tinker: ModuleType, err: BaseException) -> bool:
    """The service failed the request because of the request itself (repeating it cannot help)."""
    if isinstance(err, tinker.RequestFailedError):
        return str(getattr(err, "category", "")).lower().endswith("user")
    return isinstance(err, (tinker.BadRequestError, tinker.UnprocessableEntityError, tinker.ConflictError))


def retryable(tinker: ModuleType, err: BaseException) -> bool:
    """Worth sending again (for a request that changes nothing on the service)."""
    from tinker.lib.retryable_exception import RetryableException

    if isinstance(
        err,
        (
            tinker.RateLimitError,
            tinker.InternalServerError,
            tinker.APIConnectionError,
            RetryableException,
            ConnectionError,
        ),
    ):
        return True
    if isinstance(err, tinker.RequestFailedError):
        return not is_user_failure(tinker, err)
    if isinstance(err, tinker.APIStatusError):
        return err.status_code in (408, 429) or err.status_code >= 500
    return False


def translate(
    tinker: ModuleType, err: BaseException, what: str, training: bool = False, attempts: int | None = None
) -> TemperingError:
    """A one-line error that says what happened and what to do.

    ``training``: ``err`` came from a training-client call; unless the request itself was at
    fault it becomes a :class:`TinkerTrainingError` (which the backend recovers from).
    ``attempts``: how many times an idempotent request was sent."""
    if isinstance(err, TemperingError):
        return err
    detail = one_line(getattr(err, "message", None) or err)[:300]
    text = str(err)
    if (
        isinstance(err, tinker.AuthenticationError)
        or "status 401" in text
        or "api_key must start with" in text
        or "api_key client option must be set" in text
    ):
        return TinkerAuthError(f"Tinker rejected the API key while trying to {what} ({detail}): {KEY_HINT}")
    if isinstance(err, tinker.PermissionDeniedError) or "status 403" in text:
        return TinkerAuthError(
            f"Tinker denied access while trying to {what} (403: {detail}); check the key's project and {KEY_HINT}"
        )
    if isinstance(err, tinker.BillingError):
        return TinkerServiceError(f"Tinker refused to {what}: billing is not set up for this account (402: {detail})")
    if isinstance(err, tinker.ConflictError):
        return TinkerServiceError(f"Tinker refused to {what}: the name is in use (409: {detail})")
    if is_user_failure(tinker, err):
        return TinkerServiceError(f"Tinker rejected the request to {what} ({type(err).__name__}: {detail})")
    if training:
        return TinkerTrainingError(f"Tinker failed to {what} ({type(err).__name__}: {detail})")
    if retryable(tinker, err):
        kind = "rate limit (429)" if isinstance(err, tinker.RateLimitError) else type(err).__name__
        if attempts is None:
            return TinkerServiceError(
                f"Tinker could not {what}: {kind} persisted after the SDK's own retries ({detail}); try again later"
            )
        return TinkerServiceError(
            f"Tinker could not {what}: {kind} persisted over {attempts} attempt(s) ({detail}); "
            "raise backend.max_retries or backend.retry_backoff, or try later"
        )
    if isinstance(err, tinker.NotFoundError):
        return TinkerServiceError(f"Tinker found nothing to {what} with ({type(err).__name__}: {detail})")
    return TinkerServiceError(f"Tinker failed to {what} ({type(err).__name__}: {detail})")
