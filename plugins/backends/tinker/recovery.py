"""The training client's calls, kept until a saved state covers them, and recovery from a
failed or poisoned training client.

Why not just send a failed call again: Tinker runs a training client's requests in order, and
after a failure the client's state is unknown -- a ``forward_backward`` the service failed was
not applied, but the ``optim_step`` queued behind it may have been (an update without that
gradient); a custom-loss request that failed poisons the SDK's client for good. So recovery
abandons the client: it creates a new one from the last saved state (before the first save: a
fresh adapter with the same seed, which starts from the same weights) and repeats, in their
original order, every weight-changing call since that state and every call not yet answered.
Training requests are deterministic given the weights and the batch, so the new client ends
where the old one should have been: a failed training call never loses the run, it costs the
calls since the last checkpoint (``checkpoint_minutes``, 5 by default).

The journal holds those calls' batches until the next save (:meth:`TrainingCalls.saved`).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tempering.plugins.backends.tinker.errors import TinkerTrainingError

__all__ = ["Call", "TrainingCalls"]


@dataclass(eq=False)
class Call:
    """One request on the training client."""

    what: str
    submit: Callable[[Any], Any]  # training client -> SDK future
    stateful: bool  # changes weights or optimizer state (forward_backward, optim_step)
    sdk: Any = None
    generation: int = 0
    done: bool = False
    order: int = 0  # submission order


def _cancel(sdk: Any) -> None:
    """Stop waiting for a call of an abandoned client (its waiter moves to the repeated one)."""
    inner = sdk.future() if callable(getattr(sdk, "future", None)) else sdk
    cancel = getattr(inner, "cancel", None)
    if callable(cancel):
        cancel()


class TrainingCalls:
    """Submits training calls in order, keeps them until a saved state covers them, and
    rebuilds the client when one fails (see the module docstring).

    Args:
        create: ``state path or None -> training client`` (None: a fresh adapter); bounded and
            raising one-line errors.
        wait: ``(SDK future, what) -> result``; raises :class:`TinkerTrainingError` for a
            failure worth recovering from, anything else for one that is not.
        max_recoveries: new clients one call may cost before its error is raised.
        fresh_ok: whether a fresh adapter starts where the first one did (a fixed seed).
        lock: the backend's lock (orders submissions).
    """

    def __init__(
        self,
        create: Callable[[str | None], Any],
        wait: Callable[[Any, str], Any],
        max_recoveries: int,
        fresh_ok: bool,
        lock: threading.RLock,
        state: str | None = None,
    ) -> None:
        self.create, self.wait = create, wait
        self.max_recoveries, self.fresh_ok, self.lock = int(max_recoveries), fresh_ok, lock
        self.state = state  # the tinker path the journal starts from (None: a fresh adapter)
        self.client: Any = None
        self.generation = 0
        self.journal: list[Call] = []
        self.recoveries = 0
        self.gave_up = False
        self._submitted = 0

    def current(self) -> Any:
        """The training client (created on first use)."""
        with self.lock:
            if self.client is None:
                self.client = self.create(self.state)
            return self.client

    def submit(self, what: str, fn: Callable[[Any], Any], stateful: bool) -> Call:
        """Send ``fn(client)`` now (in call order) and keep it for recovery."""
        with self.lock:
            self._submitted += 1
            call = Call(what, fn, stateful, order=self._submitted)
            call.sdk, call.generation = fn(self.current()), self.generation
            self.journal.append(call)
            return call

    def result(self, call: Call) -> Any:
        """The call's result, recovering the client as often as allowed when it fails."""
        attempts = 0
        while True:
            with self.lock:
                generation, sdk = call.generation, call.sdk
            try:
                out = self.wait(sdk, call.what)
            except TinkerTrainingError as err:
                attempts = self._recover_or_raise(generation, err, attempts)
                continue
            with self.lock:
                call.done = True
                if not call.stateful and call in self.journal:
                    self.journal.remove(call)  # answered and changes nothing: never repeated
            return out

    def saved(self, call: Call, path: str) -> None:
        """``call`` (a save_state) finished at ``path``: everything before it is in that state."""
        with self.lock:
            self.journal = [c for c in self.journal if c.order > call.order]
            self.state = path

    def reset(self, client: object, state: str | None) -> None:
        """A client restored from ``state`` (``load``): earlier calls are moot."""
        with self.lock:
            self.generation += 1
            self.client, self.state, self.journal = client, state, []

    def _recover_or_raise(self, generation: int, err: TinkerTrainingError, attempts: int) -> int:
        while True:
            if attempts >= self.max_recoveries or (self.state is None and not self.fresh_ok):
                self.gave_up = True
                why = (
                    f"still failing after {attempts} new training client(s) (backend.max_recoveries)"
                    if attempts
                    else "no saved state to rebuild the training client from"
                    if self.max_recoveries
                    else "recovery is off (backend.max_recoveries: 0)"
                )
                raise TinkerTrainingError(
                    f"{err}; {why}. Re-run the same command (same output_dir) to resume from the last checkpoint"
                ) from err
            attempts += 1
            try:
                self._recover(generation, err)
                return attempts
            except TinkerTrainingError as again:  # a repeated call failed too: a newer client
                err, generation = again, self.generation

    def _recover(self, generation: int, err: TinkerTrainingError) -> None:
        with self.lock:
            if generation != self.generation:
                return  # another waiter already rebuilt the client
            replay = [c for c in self.journal if c.stateful or not c.done]
            source = f"the saved state {self.state}" if self.state else "a fresh adapter (same seed)"
            warnings.warn(
                f"{err} -- rebuilding the training client from {source} and repeating {len(replay)} call(s)",
                RuntimeWarning,
                stacklevel=3,
            )
            client = self.create(self.state)
            self.generation += 1
            self.client = client
            self.recoveries += 1
            for c in replay:
                _cancel(c.sdk)
                c.sdk, c.generation = c.submit(client), self.generation
            for c in replay:
                if c.done:  # repeated to rebuild the state: it must hold before later calls count
                    self.wait(c.sdk, f"repeat {c.what}")
