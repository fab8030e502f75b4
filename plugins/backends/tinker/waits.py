"""Bounded waits on the Tinker SDK: nothing the backend waits for can hang a run silently.

The SDK waits without limit in places: it polls a future whose queue is paused (capacity,
rate limits) forever, loops on HTTP 429 for sampling, and retries a training request's
submission and the session's setup for minutes. So every wait of the backend goes through
:func:`wait_for`: after ``warn_after`` seconds it warns, naming what it waits for (again at
twice that, four times, ...), and after ``timeout`` seconds it gives up with :class:`Overdue`.
Setup calls, which do their network work *before* returning a future, run on a thread of their
own (:func:`in_thread`) so that they are bounded the same way. :func:`probe` tells an
unreachable service apart at once, instead of after the SDK's connection retries.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["Overdue", "Unreachable", "wait_for", "in_thread", "probe", "diagnose", "unreachable"]

#: While waiting, the service's health is asked this often (when the caller gives ``explain``):
#: a service that died mid-run is named within seconds, not after ``wait_warning_seconds``.
HEALTH_CHECK_SECONDS = 10.0

_TIMEOUTS = (TimeoutError, concurrent.futures.TimeoutError)


class Overdue(Exception):
    """No result within the time allowed (the operation itself may still finish)."""

    def __init__(self, what: str, seconds: float) -> None:
        super().__init__(f"no result for {what} after {seconds:.0f} s")
        self.what, self.seconds = what, seconds


class Unreachable(Overdue):
    """The service cannot be reached while a result is awaited (it died, or its host is gone):
    waiting longer cannot help, so the wait ends at once, with the ``problem``."""

    def __init__(self, what: str, seconds: float, problem: str) -> None:
        super().__init__(what, seconds)
        self.problem = problem


def unreachable(problem: str | None) -> bool:
    """Whether a :func:`diagnose` answer means no connection at all (a dead service), as
    opposed to one that answers badly or slowly (HTTP 5xx, frozen), which may pass."""
    return problem is not None and problem.startswith(("connection refused", "cannot connect", "no connection within"))


def _done(fut: Any) -> bool:
    inner = fut.future() if callable(getattr(fut, "future", None)) else fut
    return bool(inner.done())


def wait_for(
    fut: Any,
    what: str,
    timeout: float,
    warn_after: float,
    setting: str = "backend.request_timeout_seconds",
    explain: Callable[[], str | None] | None = None,
) -> Any:
    """``fut.result()`` within ``timeout`` seconds (an SDK future or a concurrent one), warning
    after ``warn_after`` seconds and then at doubling intervals; :class:`Overdue` past it.
    ``explain`` (e.g. :func:`diagnose` of the service) says what is wrong: asked every
    :data:`HEALTH_CHECK_SECONDS`, an unreachable service ends the wait at once
    (:class:`Unreachable`); when a warning is due its answer replaces the guess that the service
    is queueing the call."""
    start = time.monotonic()
    warn_at = max(float(warn_after), 0.0) or float("inf")
    check_at = HEALTH_CHECK_SECONDS if explain is not None else float("inf")
    while True:
        elapsed = time.monotonic() - start
        try:
            return fut.result(timeout=max(0.0, min(warn_at, check_at, timeout) - elapsed))
        except _TIMEOUTS:
            if _done(fut):
                raise  # the operation's own TimeoutError
        elapsed = time.monotonic() - start
        if elapsed >= timeout:
            raise Overdue(what, elapsed)
        problem = None
        if explain is not None and (elapsed >= check_at or elapsed >= warn_at):
            problem = explain()
            check_at = elapsed + HEALTH_CHECK_SECONDS
            if unreachable(problem):
                assert problem is not None
                raise Unreachable(what, elapsed, problem)
        if elapsed >= warn_at:
            why = (
                f"the service: {problem}, which the SDK retries without a word"
                if problem
                else "the service may be queueing it, or paused for capacity or rate limits, which the SDK waits out "
                "without a word"
            )
            warnings.warn(
                f"Tinker: still waiting for {what} after {elapsed:.0f} s ({why}); "
                f"giving up after {timeout:.0f} s ({setting})",
                RuntimeWarning,
                stacklevel=2,
            )
            warn_at *= 2


def in_thread(fn: Callable[[], T], name: str = "tempering-tinker-setup") -> Future[T]:
    """Run ``fn`` on a daemon thread of its own: a caller can stop waiting for it (the thread
    then finishes or fails on its own, holding nothing of the caller's)."""
    out: Future[T] = Future()

    def run() -> None:
        try:
            out.set_result(fn())
        except BaseException as err:  # noqa: BLE001 - the future carries it
            out.set_exception(err)

    threading.Thread(target=run, name=name, daemon=True).start()
    return out


def probe(base_url: str, timeout: float = 5.0) -> str | None:
    """Why ``base_url`` cannot be reached (connection refused, unknown host, no connection in
    time), or None once a connection is made -- any answer counts: the SDK reports those itself."""
    import httpx

    try:
        # the connection is the question: a slow answer (read timeout) still counts as reachable
        httpx.get(f"{base_url.rstrip('/')}/api/v1/healthz", timeout=httpx.Timeout(1.0, connect=timeout))
    except httpx.ConnectError as err:
        return f"cannot connect: {err}" if str(err) else "cannot connect (connection refused)"
    except httpx.ConnectTimeout:
        return f"no connection within {timeout:.0f} s"
    except httpx.HTTPError:  # it connected: whatever else went wrong, the SDK will say
        return None
    return None


def diagnose(base_url: str | None, timeout: float = 5.0) -> str | None:
    """What is wrong with the service at ``base_url``, asked after a wait ran out (the SDK
    retries a refused connection, an HTTP 5xx and a silent server without a word, so the wait
    alone cannot tell them apart from a queue paused for capacity): ``connection refused``, ``no
    connection within N s``, ``HTTP <status>: <body>``, ``no answer within N s`` (it accepts
    connections but does not answer: frozen or overloaded), or None when it answers its health
    check (then the wait is the service's: queued, paused, rate-limited)."""
    import httpx

    if not base_url:
        return None
    url = f"{base_url.rstrip('/')}/api/v1/healthz"
    try:
        reply = httpx.get(url, timeout=httpx.Timeout(timeout, connect=timeout))
    except httpx.ConnectError as err:
        text = str(err)
        return "connection refused" if not text or "refused" in text.lower() else f"cannot connect: {text}"
    except httpx.ConnectTimeout:
        return f"no connection within {timeout:.0f} s"
    except httpx.TimeoutException:
        return (
            f"no answer within {timeout:.0f} s "
            "(the server accepts connections but does not answer: frozen or overloaded)"
        )
    except httpx.HTTPError as err:
        return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
    if reply.status_code >= 500:
        body = " ".join(reply.text.split())[:300]
        return f"HTTP {reply.status_code}" + (f": {body}" if body else "")
    return None
