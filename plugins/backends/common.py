"""What every backend does alike, written once (issue 22: the backends shared copies).

* :func:`float_metrics`: a loss's metrics as the plain floats a backend returns from
  ``forward_backward`` -- the local backend and Tinker's custom-loss path both call a loss and
  must refuse the same way a metric that is not a number;
* :func:`checked_extra`: the caller's ``extra`` of a checkpoint, refused at ``save`` (not at
  some later write) when it is not JSON;
* :func:`run_on`, :func:`resolved`, :func:`failed`: futures made without a thread pool, for a
  backend that runs a call inline (or already knows its result) but must answer with a
  :class:`~concurrent.futures.Future` like every other call.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

__all__ = ["float_metrics", "checked_extra", "run_on", "resolved", "failed"]

T = TypeVar("T")


def float_metrics(metrics: Mapping[str, Any], who: str) -> dict[str, float]:
    """``metrics`` (a loss's, ``who`` its class name) with every value as a float; a value that
    is not a number is a ``TypeError`` naming the metric and the loss."""
    out = {}
    for key, value in metrics.items():
        try:
            out[str(key)] = float(value)
        except (TypeError, ValueError, RuntimeError) as err:
            raise TypeError(f"forward_backward: metric '{key}' from {who} is not a number ({value!r})") from err
    return out


def checked_extra(extra: Mapping[str, Any] | None, who: str) -> dict[str, Any]:
    """A copy of ``extra`` (``None``: empty), or a ``TypeError`` naming ``who`` (e.g.
    ``LocalBackend.save``) when it is not JSON-serialisable."""
    payload = dict(extra or {})
    try:
        json.dumps(payload)
    except TypeError as err:
        raise TypeError(f"{who}: extra must be JSON-serialisable ({err})") from err
    return payload


def run_on(executor: Executor | None, fn: Callable[..., T], *args: object) -> Future[T]:
    """Submit ``fn`` to ``executor``, or run it inline into a finished future (unthreaded)."""
    if executor is not None:
        return executor.submit(fn, *args)
    future: Future[T] = Future()
    try:
        future.set_result(fn(*args))
    except BaseException as err:  # noqa: BLE001 - the future carries it to the caller
        future.set_exception(err)
    return future


def resolved(value: T) -> Future[T]:
    """A future that already holds ``value``."""
    future: Future[T] = Future()
    future.set_result(value)
    return future


def failed(err: BaseException) -> Future[Any]:
    """A future that already holds ``err``."""
    future: Future[Any] = Future()
    future.set_exception(err)
    return future
