"""Named weight snapshots on Tinker: sampler weights saved on the service, scored through a
sampling client created on first use.

A snapshot is what DPO's and SDFT's "policy as it was" and a reference stage score with
(``weights=NAME``). Saving one is a training-client call (queued after the calls before it),
so its ``tinker://`` path is known only once that call is done; the path is resolved lazily
and recorded in checkpoints, from which snapshots are restored without their clients.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tempering.plugins.backends.tinker.recovery import Call, TrainingCalls


@dataclass
class Snapshot:
    """A named copy of the weights: sampler weights on the service, scored through a sampling
    client created on first use."""

    name: str
    step: int
    save: Call | None = None  # the save_weights_for_sampler call (None when restored)
    path: str | None = None
    client: Any = None
    lock: threading.Lock = field(default_factory=threading.Lock)


class Snapshots:
    """The backend's snapshots by name. ``lock`` is the backend's (it orders submissions to the
    training client, and a snapshot is one)."""

    def __init__(self, calls: TrainingCalls, lock: threading.RLock) -> None:
        self._calls = calls
        self._lock = lock
        self._by_name: dict[str, Snapshot] = {}
        self._counter = 0

    def take(self, name: str, step: int, ttl: int | None, safe: Callable[[str], str]) -> Snapshot:
        """Submit ``save_weights_for_sampler`` for the current weights (under a label unique in
        the run) and record it as ``name``, replacing an older snapshot of that name."""
        with self._lock:
            self._counter += 1
            label = safe(f"tempering-{name}-s{step}-{self._counter}")
            call = self._calls.submit(
                f"save snapshot '{name}'", lambda c: c.save_weights_for_sampler(label, ttl_seconds=ttl), stateful=False
            )
            snap = Snapshot(name, step, save=call)
            self._by_name[name] = snap
        return snap

    def path(self, snap: Snapshot) -> str:
        """The snapshot's ``tinker://`` path (waiting for its save call the first time)."""
        if snap.path is None:
            assert snap.save is not None
            snap.path = str(self._calls.result(snap.save).path)
        return snap.path

    def client(self, name: str, setup: Callable[[str, Callable[[], Any]], Any], service: Any) -> Callable[[], Any]:
        """A getter of ``name``'s sampling client (created on first use, through ``setup``); a
        missing name is a ``KeyError`` now, not when the getter runs."""
        with self._lock:
            if name not in self._by_name:
                raise KeyError(f"TinkerBackend: no weight snapshot named '{name}' (have: {sorted(self._by_name)})")
            snap = self._by_name[name]

        def get() -> Any:
            with snap.lock:
                if snap.client is None:
                    path = self.path(snap)
                    snap.client = setup(
                        f"create a sampling client for snapshot '{name}'",
                        lambda: service.create_sampling_client(model_path=path),
                    )
                return snap.client

        return get

    def drop(self, name: str) -> None:
        with self._lock:
            self._by_name.pop(name, None)

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._by_name)

    def current(self) -> list[Snapshot]:
        """The snapshots now (call under the backend's lock to pair them with a step)."""
        return list(self._by_name.values())

    def records(self, snaps: list[Snapshot]) -> dict[str, dict[str, Any]]:
        """What a checkpoint keeps of ``snaps``: each one's path and step."""
        return {s.name: {"path": self.path(s), "step": s.step} for s in snaps}

    def restore(self, records: Mapping[str, Mapping[str, Any]]) -> None:
        """Replace every snapshot by those a checkpoint recorded (clients made on first use)."""
        self._by_name = {
            name: Snapshot(name, int(s.get("step", 0)), path=str(s["path"])) for name, s in records.items()
        }
