"""Talking to the Tinker service: bounded setup and waits, retries of idempotent requests, the
worker threads that wait on the SDK's futures, and finishing the session.

Everything here is about *how* a request reaches the service and its answer comes back, not
what is asked: the backend's sampling, scoring, training and checkpoint code all go through
one :class:`Session`, so a timeout, a retry or an error message means the same everywhere.
"""

from __future__ import annotations

import concurrent.futures
import random
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from types import ModuleType
from typing import Any, TypeVar

from tempering.errors import TemperingError
from tempering.plugins.backends.tinker.errors import (
    URL_HINT,
    TinkerServiceError,
    TinkerTrainingError,
    one_line,
    retryable,
    translate,
)
from tempering.plugins.backends.tinker.waits import Overdue, Unreachable, diagnose, in_thread, probe, wait_for

T = TypeVar("T")

#: Seconds ``close`` waits for the session to finish (after a sixth of it, only if the service
#: still answers its health check).
CLOSE_TIMEOUT = 30.0


class Session:
    """One service client and the rules for every request sent through it.

    ``owns_service``: this backend built the service client (so it probes the service before
    the first setup call, asks it what is wrong when a wait runs out, and finishes the session
    on close); a client given by the caller is used as it is."""

    def __init__(
        self,
        tinker: ModuleType,
        service: Any,
        base_url: str,
        api_key: str | None,
        owns_service: bool,
        *,
        setup_timeout: float,
        request_timeout: float,
        wait_warning: float,
        max_retries: int,
        retry_backoff: float,
        retry_max_backoff: float,
        concurrency: int,
    ) -> None:
        self.tinker = tinker
        self.service = service
        self.base_url = base_url
        self.api_key = api_key
        self.owns_service = owns_service
        self.setup_timeout = setup_timeout
        self.request_timeout = request_timeout
        self.wait_warning = wait_warning
        self.max_retries = max_retries
        self.retry_backoff = retry_backoff
        self.retry_max_backoff = retry_max_backoff
        self.retry_count = 0
        self._retry_lock = threading.Lock()
        self._reachable = not owns_service  # probed before the first setup call
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="tempering-tinker")

    # ------------------------------------------------------------------ setup
    def setup(self, what: str, make: Callable[[], Any]) -> Any:
        """``make().result()`` -- a setup call, which does its network work (the session) before
        it returns a future -- on a thread of its own, within ``setup_timeout_seconds``; errors
        one line. An unreachable service is reported at once (the SDK would retry for minutes)."""
        if not self._reachable:
            problem = probe(self.base_url)
            if problem is not None:
                raise TinkerServiceError(
                    f"the Tinker service at {self.base_url} cannot be reached ({problem}): {URL_HINT}"
                )
            self._reachable = True
        try:
            return wait_for(
                in_thread(lambda: make().result()),
                what,
                self.setup_timeout,
                self.wait_warning,
                setting="backend.setup_timeout_seconds",
                explain=self.diagnose,
            )
        except Unreachable as err:
            raise self.gone(err) from err
        except Overdue as err:
            raise TinkerServiceError(
                f"no answer from the Tinker service at {self.base_url} after {err.seconds:.0f} s "
                f"while trying to {what} "
                f"(backend.setup_timeout_seconds): {URL_HINT}"
            ) from err
        except Exception as err:
            raise self.translate(err, what) from err

    # ------------------------------------------------------------------ results
    def spawn(self, fn: Callable[..., T], *args: object) -> Future[T]:
        """Run ``fn`` (which waits on SDK futures) on a worker thread; errors become ours."""

        def run() -> T:
            try:
                return fn(*args)
            except TemperingError:
                raise
            except (NotImplementedError, ValueError, KeyError, TypeError):
                raise
            except Exception as err:
                raise self.translate(err, getattr(fn, "__name__", "call")) from err

        return self._pool.submit(run)

    def wait(self, fut: object, what: str, training: bool = False) -> Any:
        """``fut.result()`` within ``request_timeout_seconds`` (warning after
        ``wait_warning_seconds``), the service's errors translated (no retry). A training call
        past its time is a :class:`TinkerTrainingError` (recoverable: its client is abandoned)."""
        try:
            return wait_for(fut, what, self.request_timeout, self.wait_warning, explain=self.diagnose)
        except Unreachable as err:  # not a training failure: a new client on a dead service cannot help
            raise self.gone(err) from err
        except Overdue as err:
            problem = self.diagnose()
            why = (
                f"the service at {self.base_url}: {problem}"
                if problem
                else "the service answers its health check, so it may be queueing the call or paused for capacity or "
                "rate limits, which the SDK waits out without a word"
            )
            message = (
                f"no result for {what} from Tinker after {err.seconds:.0f} s (backend.request_timeout_seconds; {why})"
            )
            raise (TinkerTrainingError if training else TinkerServiceError)(message) from err
        except TemperingError:
            raise
        except Exception as err:
            raise self.translate(err, what, training=training) from err

    def gone(self, err: Unreachable) -> TinkerServiceError:
        """The one line for a service that cannot be reached while a call waits on it."""
        return TinkerServiceError(
            f"the Tinker service at {self.base_url} stopped answering while waiting for {err.what} "
            f"({err.problem}, {err.seconds:.0f} s into the wait): {URL_HINT}; the run is resumable "
            "from its last checkpoint once the service is back"
        )

    def diagnose(self) -> str | None:
        """What is wrong with the service, asked when a wait runs out: a dead server (connection
        refused), one that answers HTTP 5xx, or a frozen one (no answer) -- the SDK retries all
        three silently, so without asking they looked like a queue paused for capacity. None
        when the service is not ours to ask (a client given by the caller) or answers."""
        if not self.owns_service:
            return None
        return diagnose(self.base_url, timeout=min(5.0, max(1.0, self.request_timeout / 2)))

    @staticmethod
    def try_submit(submit: Callable[[T], Any], arg: T) -> Any:
        """Submit now; a synchronous failure is kept (as a failed future) for the retry loop."""
        try:
            return submit(arg)
        except Exception as err:  # noqa: BLE001
            failed: Future[Any] = Future()
            failed.set_exception(err)
            return failed

    def result_with_retry(self, what: str, fut: object, resubmit: Callable[[], Any]) -> Any:
        """The result of an *idempotent* request, resubmitting it after a retryable failure
        (each attempt bounded by ``request_timeout_seconds``)."""
        attempt = 0
        while True:
            try:
                return self.wait(fut, what)
            except TemperingError as translated:
                cause = translated.__cause__
                if not isinstance(cause, Exception) or isinstance(cause, Overdue) or not retryable(self.tinker, cause):
                    raise
                if attempt >= self.max_retries:
                    raise self.translate(cause, what, attempts=attempt + 1) from cause
                delay = min(self.retry_backoff * 2**attempt, self.retry_max_backoff) * random.uniform(0.75, 1.25)
                with self._retry_lock:
                    self.retry_count += 1
                time.sleep(delay)
                attempt += 1
                fut = self.try_submit(lambda _: resubmit(), None)

    def translate(
        self, err: BaseException, what: str, training: bool = False, attempts: int | None = None
    ) -> TemperingError:
        return translate(self.tinker, err, what, training=training, attempts=attempts)

    # ------------------------------------------------------------------ the end
    def close(self, status: str) -> None:
        """Wait for the worker threads and (if this backend created the service client) finish
        the Tinker session with ``status``, never for long and never masking the run's outcome."""
        self._pool.shutdown(wait=True)
        if not self.owns_service or not hasattr(self.service, "close"):
            return
        closing: Any = None
        try:
            closing = self.service.close(status)
            if hasattr(closing, "result"):
                try:  # a few seconds, then ask the service: a dead or frozen one is not waited on for long
                    closing.result(timeout=CLOSE_TIMEOUT / 6)
                except (TimeoutError, concurrent.futures.TimeoutError):
                    if self.diagnose() is not None:
                        raise
                    closing.result(timeout=CLOSE_TIMEOUT * 5 / 6)
        except Exception as err:  # noqa: BLE001 - closing must not mask the run's outcome
            # a TimeoutError has no text: the warning said "TinkerBackend.close: " and nothing else
            if isinstance(err, (TimeoutError, concurrent.futures.TimeoutError)):
                problem = self.diagnose()
                text = "no answer" + (
                    f"; the service at {self.base_url}: {problem}" if problem else f" within {CLOSE_TIMEOUT:.0f} s"
                )
            else:
                text = one_line(err) or type(err).__name__
            warnings.warn(
                f"TinkerBackend.close: the Tinker session was not finished ({status}): {text}",
                RuntimeWarning,
                stacklevel=3,
            )
            # The SDK would go on retrying the finish, and its session heartbeat would log a
            # warning every 10 s, for minutes, after the run ended: cancelling the finish
            # runs its cleanup, which stops the heartbeat and releases the connections.
            future = getattr(closing, "future", None)
            if callable(future):
                future().cancel()


def run_status(exc: BaseException | None, gave_up: bool) -> str:
    """The session's finish status for a run ending with ``exc`` in flight (or none)."""
    if exc is None:
        return "errored" if gave_up else "success"
    if type(exc).__name__ in ("RunStopped", "StopRun") or not isinstance(exc, Exception):
        return "interrupted"  # Ctrl-C, or a stage that stopped the run on purpose
    return "errored"
