"""Sampling requests batched while the model is busy: what lets a served model keep up with a
cookbook RL step (``groups_per_batch`` requests at once, each for ``group_size`` samples).

The local backend samples one call at a time, so a hundred concurrent requests would run as a
hundred generate calls. A :class:`SampleBatcher` sends the first request at once and, while it
runs, queues the next ones; when the call finishes it sends every queued request with the same
``num_samples`` and sampling parameters as one call (prompts of different lengths are padded by
the backend). No request waits for a batch to fill. Requests with a ``seed`` are never batched:
their samples must not depend on what else was queued.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

__all__ = ["SampleBatcher"]

Submit = Callable[[list[list[int]], int, Any], "Future[list[list[Any]]]"]


class SampleBatcher:
    """Batches ``sample(prompt, n, params)`` calls onto ``submit(prompts, n, params)``."""

    def __init__(self, submit: Submit, max_prompts: int = 64) -> None:
        self._submit, self.max_prompts = submit, max_prompts
        self._pending: list[tuple[list[int], int, Any, Future[list[Any]]]] = []
        self._busy = False
        self._lock = threading.Lock()
        self.calls = 0  # backend calls made (for tests and measurements)

    def sample(self, prompt: list[int], n: int, params: object) -> Future[list[Any]]:
        out: Future[list[Any]] = Future()
        with self._lock:
            self._pending.append((list(prompt), int(n), params, out))
            if self._busy:
                return out
            self._busy = True
        self._next()
        return out

    def _next(self) -> None:
        with self._lock:
            if not self._pending:
                self._busy = False
                return
            _, n, params, _ = self._pending[0]
            if getattr(params, "seed", None) is not None:
                group = self._pending[:1]
            else:
                group = [p for p in self._pending if p[1] == n and p[2] == params][: self.max_prompts]
            taken = {id(p[3]) for p in group}
            self._pending = [p for p in self._pending if id(p[3]) not in taken]
            self.calls += 1
        try:
            future = self._submit([p[0] for p in group], n, params)
        except BaseException as err:  # noqa: BLE001 - each request's future carries it
            for p in group:
                p[3].set_exception(err)
            self._next()
            return
        future.add_done_callback(lambda f: self._done(f, group))

    def _done(
        self, future: Future[list[list[Any]]], group: list[tuple[list[int], int, Any, Future[list[Any]]]]
    ) -> None:
        err = future.exception()
        for i, p in enumerate(group):
            if err is not None:
                p[3].set_exception(err)
            else:
                p[3].set_result(future.result()[i])
        self._next()
