"""A run folder, read back: what ``tempering view``, ``export`` and ``eval`` look at.

Writing a run folder is :mod:`tempering.training.recipe` and :mod:`tempering.runs.runfolder`'s business;
this module only reads one -- possibly while its run is still writing (the viewer shows a live
run), possibly after it was moved (checkpoint paths in ``progress.json`` are the run's own,
relative to where it was started: they are looked up inside the folder when they are not
where they say).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from tempering.errors import ConfigError
from tempering.interfaces import Closeable
from tempering.registry import Registry, get_registry
from tempering.runs import rollout_log
from tempering.runs.redact import REDACTED
from tempering.runs.runfolder import CHECKPOINTS, PROGRESS_FILE
from tempering.training.config import stage_id
from tempering.training.recipe import backend_spec

RUN_FILE = "run.json"
METRICS_FILE = "metrics.jsonl"


@dataclass
class RunDir:
    """The folder of one run (``output_dir``)."""

    path: str

    @classmethod
    def open(cls, path: str, key: str = "RUN_DIR") -> RunDir:
        """``path`` if it holds a run, else a one-line error naming what is missing."""
        if not os.path.isdir(path):
            raise ConfigError(f"no such folder '{path}'; give a run's output folder (runs/<name>)", key)
        if not any(os.path.exists(os.path.join(path, f)) for f in (RUN_FILE, METRICS_FILE, PROGRESS_FILE)):
            raise ConfigError(
                f"'{path}' holds no run (no {RUN_FILE}, {METRICS_FILE} or {PROGRESS_FILE}); "
                "give a run's output folder (runs/<name>)",
                key,
            )
        return cls(path)

    # ------------------------------------------------------------------ what the run wrote
    def info(self) -> dict[str, Any]:
        """``run.json``: the resolved recipe (``recipe``), the package and version each named
        component resolved to (``components``) and tempering's version; {} before it exists."""
        return _read_json(os.path.join(self.path, RUN_FILE)) or {}

    @property
    def recipe(self) -> dict[str, Any]:
        return dict(self.info().get("recipe") or {})

    def progress(self) -> dict[str, Any]:
        return _read_json(os.path.join(self.path, PROGRESS_FILE)) or {}

    def metrics(self) -> list[dict[str, Any]]:
        """The rows of ``metrics.jsonl`` (a line a kill cut short is skipped)."""
        return read_jsonl(os.path.join(self.path, METRICS_FILE))

    def rollouts(self) -> list[dict[str, Any]]:
        """The records of ``rollouts.jsonl`` (see :mod:`tempering.runs.rollout_log`)."""
        return read_jsonl(os.path.join(self.path, rollout_log.FILENAME))

    def stages(self) -> list[str]:
        """Stage ids in recipe order (then any only the metrics name)."""
        ids = [stage_id(s, i) for i, s in enumerate(self.recipe.get("stages") or [])]
        for row in self.metrics():
            sid = str(row.get("stage", ""))
            if sid and sid not in ids:
                ids.append(sid)
        return ids

    # ------------------------------------------------------------------ checkpoints
    def checkpoints(self) -> list[dict[str, Any]]:
        """The kept checkpoints, oldest first: ``{path, stage, global_step, stage_end}`` with
        ``path`` resolved to where the checkpoint is now."""
        out = []
        for entry in self.progress().get("checkpoints") or []:
            path = self._locate(str(entry["path"]))
            if path is not None:
                out.append({**entry, "path": path})
        return out

    def checkpoint(self, step: int | None = None, key: str = "--step") -> dict[str, Any]:
        """The latest checkpoint, or the one at global step ``step`` (the last of several at
        that step: a stage end after a periodic one); a one-line error lists the steps there are."""
        kept = self.checkpoints()
        if not kept:
            raise ConfigError(
                f"'{self.path}' has no checkpoint yet (progress.json lists none); "
                "a run saves one at the end of every stage",
                key,
            )
        if step is None:
            latest = self._locate(str(self.progress().get("checkpoint") or ""))
            return next((c for c in kept if c["path"] == latest), kept[-1])
        at = [c for c in kept if int(c["global_step"]) == int(step)]
        if not at:
            steps = ", ".join(str(c["global_step"]) for c in kept)
            raise ConfigError(f"no checkpoint at step {step} in '{self.path}'; kept: {steps}", key)
        return at[-1]

    def _locate(self, recorded: str) -> str | None:
        if not recorded:
            return None
        if os.path.isdir(recorded):
            return recorded
        inside = os.path.join(self.path, CHECKPOINTS, os.path.basename(recorded.rstrip("/")))
        return inside if os.path.isdir(inside) else None


@contextmanager
def run_backend(
    run: RunDir, step: int | None = None, registry: Registry | None = None
) -> Iterator[tuple[Any, dict[str, Any]]]:
    """The run's backend, rebuilt as the run built it, with checkpoint ``step`` (default: the
    latest) loaded; yields ``(backend, checkpoint entry)`` and closes the backend after."""
    registry = registry or get_registry()
    recipe = run.recipe
    if not recipe.get("backend"):
        raise ConfigError(
            f"'{run.path}' has no run.json with a backend: it was not written by `tempering run`", "RUN_DIR"
        )
    spec = backend_spec(registry, recipe)
    if isinstance(spec, Mapping):  # a secret run.json redacted: the backend's own default (its env variable)
        spec = {k: v for k, v in spec.items() if v != REDACTED}
    if isinstance(spec, str) and spec.startswith("<python object"):
        raise ConfigError(
            f"the run's backend was a Python object ({spec}), which run.json cannot rebuild; "
            "export from Python with backend.export_pretrained(path)",
            "RUN_DIR",
        )
    checkpoint = run.checkpoint(step)
    backend = registry.build("backend", spec, "backend")
    try:
        backend.load(checkpoint["path"])
        yield backend, checkpoint
    finally:
        if isinstance(backend, Closeable):
            backend.close()


def _read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, Mapping) else None  # type: ignore[return-value]


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """Every object of a JSON-lines file; a line that does not parse (cut short by a kill, the
    last one of a file being written) is skipped; no file: no rows."""
    if not os.path.exists(path):
        return []
    rows = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return rows
