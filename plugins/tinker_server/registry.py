"""What the Tinker server remembers across a restart: its training runs and checkpoints, in one
JSON file (``registry.json``) beside the checkpoint folders under the server's root.

Why a file: a checkpoint is worth keeping only if a client can still name it after the server
restarts -- list it (``RestClient.list_checkpoints``), read its run's ``user_metadata`` (where
the cookbook keeps its renderer name), load it into a new run. A run's live state (weights
between checkpoints, optimizer, queued requests) is not kept: after a restart its ``model_id``
answers 404 with a message naming its checkpoints, at once, so no client waits on it.

The answers are ``tinker.types`` shapes (``TrainingRun``, ``Checkpoint``, ``Cursor``) as JSON.
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
import threading
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Registry", "RunRecord", "CheckpointRecord", "DamagedRegistry", "now", "folder_size"]

FILE = "registry.json"


def now() -> str:
    """The current UTC time, ISO 8601 (as the service's JSON has it)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat()


@dataclass
class RunRecord:
    """A training run as ``tinker.types.TrainingRun`` shows it, plus what this server needs."""

    training_run_id: str
    base_model: str
    lora_rank: int | None
    session_id: str
    user_metadata: dict[str, str] | None = None
    created: str = field(default_factory=now)
    last_request_time: str = field(default_factory=now)
    closed: str | None = None  # why the run no longer takes requests (session expired, server restarted)

    def as_training_run(self, last: CheckpointRecord | None, last_sampler: CheckpointRecord | None) -> dict[str, Any]:
        return {
            "training_run_id": self.training_run_id,
            "base_model": self.base_model,
            "model_owner": "local",
            "is_lora": self.lora_rank is not None,
            "corrupted": False,
            "lora_rank": self.lora_rank,
            "last_request_time": self.last_request_time,
            "user_metadata": self.user_metadata,
            "last_checkpoint": last.as_checkpoint() if last else None,
            "last_sampler_checkpoint": last_sampler.as_checkpoint() if last_sampler else None,
        }


@dataclass
class CheckpointRecord:
    """A saved state (``training``), sampler weights (``sampler``) or an export (``external``)."""

    tinker_path: str
    checkpoint_type: str  # "training" | "sampler" | "external"
    folder: str
    base_model: str
    lora_rank: int | None
    time: str = field(default_factory=now)
    size_bytes: int | None = None
    public: bool = False
    user_metadata: dict[str, str] | None = None
    expires_at: str | None = None

    @property
    def run_id(self) -> str:
        return self.tinker_path.removeprefix("tinker://").split("/", 1)[0]

    @property
    def checkpoint_id(self) -> str:
        return self.tinker_path.removeprefix("tinker://").split("/", 1)[1]

    def as_checkpoint(self) -> dict[str, Any]:
        return {
            "checkpoint_id": self.checkpoint_id,
            "checkpoint_type": self.checkpoint_type,
            "time": self.time,
            "tinker_path": self.tinker_path,
            "size_bytes": self.size_bytes,
            "public": self.public,
            "user_metadata": self.user_metadata,
            "expires_at": self.expires_at,
        }


def folder_size(folder: str) -> int:
    """Bytes of the files under ``folder`` (0 for a folder that is gone)."""
    total = 0
    for d, _, files in os.walk(folder):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(d, f))
            except OSError:  # removed while we walked
                pass
    return total


class DamagedRegistry(Exception):
    """``registry.json`` cannot be read (truncated, not JSON, not a registry): one line that
    names the file and the way out. Not a ValueError, so no caller mistakes it for bad input
    of its own."""


class Registry:
    """Runs and checkpoints, written to ``<root>/registry.json`` on every change (atomically:
    a crash leaves the previous file, never half of one)."""

    def __init__(self, root: str) -> None:
        self.path = os.path.join(root, FILE)
        self.runs: dict[str, RunRecord] = {}
        self.checkpoints: dict[str, CheckpointRecord] = {}
        self._lock = threading.RLock()
        if os.path.isfile(self.path):
            try:
                with open(self.path) as fh:
                    saved = json.load(fh)
                self.runs = {r["training_run_id"]: RunRecord(**r) for r in saved.get("runs", [])}
                self.checkpoints = {c["tinker_path"]: CheckpointRecord(**c) for c in saved.get("checkpoints", [])}
            except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
                raise DamagedRegistry(
                    f"{self.path}: the run registry is damaged ({type(err).__name__}: {err}); move it aside "
                    "to start with an empty one (the checkpoint folders beside it are left as they are), "
                    "or give another --root"
                ) from err
            self.checkpoints = {p: c for p, c in self.checkpoints.items() if os.path.isdir(c.folder)}

    def save(self) -> None:
        with self._lock:
            data = {
                "runs": [asdict(r) for r in self.runs.values()],
                "checkpoints": [asdict(c) for c in self.checkpoints.values()],
            }
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path), prefix=".registry-")
            with os.fdopen(fd, "w") as fh:
                json.dump(data, fh, indent=1)
            os.replace(tmp, self.path)

    def add_run(self, record: RunRecord) -> None:
        with self._lock:
            self.runs[record.training_run_id] = record
            self.save()

    def touch(self, run_id: str) -> None:
        """A request reached the run (``last_request_time``; kept in memory until the next save)."""
        record = self.runs.get(run_id)
        if record is not None:
            record.last_request_time = now()

    def close_run(self, run_id: str, why: str) -> None:
        with self._lock:
            if run_id in self.runs and self.runs[run_id].closed is None:
                self.runs[run_id].closed = why
                self.save()

    def add_checkpoint(self, record: CheckpointRecord) -> None:
        with self._lock:
            record.size_bytes = folder_size(record.folder) if os.path.isdir(record.folder) else None
            self.checkpoints[record.tinker_path] = record
            self.save()

    def drop_checkpoint(self, path: str) -> CheckpointRecord | None:
        with self._lock:
            record = self.checkpoints.pop(path, None)
            if record is not None:
                self.save()
            return record

    def checkpoints_of(self, run_id: str | None = None) -> list[CheckpointRecord]:
        with self._lock:
            found = [c for c in self.checkpoints.values() if run_id is None or c.run_id == run_id]
        return sorted(found, key=lambda c: c.time)

    def training_run(self, run_id: str) -> dict[str, Any] | None:
        record = self.runs.get(run_id)
        if record is None:
            return None
        mine = self.checkpoints_of(run_id)
        last = next((c for c in reversed(mine) if c.checkpoint_type == "training"), None)
        last_sampler = next((c for c in reversed(mine) if c.checkpoint_type == "sampler"), None)
        return record.as_training_run(last, last_sampler)

    def page(self, items: list[Any], offset: int, limit: int) -> tuple[list[Any], dict[str, int]]:
        return items[offset : offset + limit], {"offset": offset, "limit": limit, "total_count": len(items)}
