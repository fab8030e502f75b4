"""What every experiment-tracker logger shares: the run's config, numeric metrics, rollout
tables, and a one-line error when the tracker's package is missing.

A tracker logger is built before the run writes ``run.json``, so it reads the resolved config
(the recipe plus each component's package and version) from there when the first row comes:
every tracker gets the same config the run folder has. Metrics are the row's finite numbers
(texts such as ``first_error/...`` stay in ``metrics.jsonl``); rollouts arrive through the
optional ``log_rollouts(records, step)`` (see :mod:`tempering.runs.rollout_log`) and are flattened
into table rows (:func:`table_rows`) with a readable transcript per sample.

Subclasses implement ``start(config)``, ``log_metrics(metrics, step)``,
``log_table(columns, rows, step)`` and ``finish()``. A resumed run starts a new tracker run
(whose steps continue from the checkpoint's global step): trackers cannot take rows back.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from tempering.schema import Problem

#: Table columns of a logged rollout, in order.
COLUMNS = (
    "stage",
    "step",
    "kind",
    "group",
    "sample",
    "reward",
    "advantage",
    "failed",
    "failure",
    "stop",
    "turns",
    "prompt",
    "completion",
    "transcript",
)
SKIPPED = frozenset({"step", "time"})


def package_check(package: str, logger: str, extra: str) -> Callable[[Mapping[str, Any]], Iterator[Problem]]:
    """A logger's ``check_config`` (see :mod:`tempering.schema`): the tracker's package must be
    importable -- checked when the recipe is validated, before anything runs, without importing
    it -- else one line at the logger with the install command."""

    def check(config: Mapping[str, Any]) -> Iterator[Problem]:
        if importlib.util.find_spec(package) is None:
            yield Problem("", f"the {logger} logger needs the '{package}' package: pip install 'tempering[{extra}]'")

    return check


def numeric(row: Mapping[str, Any]) -> dict[str, float]:
    """The row's finite numbers (bools as 0/1), without the step and wall-clock columns."""
    out = {}
    for key, value in row.items():
        if key in SKIPPED or isinstance(value, str) or value is None:
            continue
        if hasattr(value, "item"):
            value = value.item()
        if isinstance(value, (bool, int, float)) and math.isfinite(float(value)):
            out[key] = float(value)
    return out


def flatten(config: object, prefix: str = "") -> dict[str, str]:
    """Nested config as ``a.b.0.c -> value`` pairs (for trackers whose parameters are flat)."""
    if isinstance(config, Mapping):
        items = [(f"{prefix}{k}", v) for k, v in config.items()]
    elif isinstance(config, list):
        items = [(f"{prefix}{i}", v) for i, v in enumerate(config)]
    else:
        return {prefix.rstrip("."): json.dumps(config) if not isinstance(config, str) else config}
    out: dict[str, str] = {}
    for key, value in items:
        if isinstance(value, (Mapping, list)) and value:
            out.update(flatten(value, f"{key}."))
        else:
            out[key] = value if isinstance(value, str) else json.dumps(value)
    return out


def transcript_text(record: Mapping[str, Any]) -> str:
    """A record's conversation as plain text, one ``role: content`` block per message, tool
    calls as ``-> name(args)``: readable in any tracker's table cell."""
    messages = record.get("messages")
    if not messages:
        return f"user: {record.get('prompt') or ''}\nassistant: {record.get('completion') or ''}"
    lines = []
    for m in messages:
        head = m.get("role", "?") + (f" [{m['name']}]" if m.get("role") == "tool" and m.get("name") else "")
        lines.append(f"{head}: {m.get('content') or ''}".rstrip())
        for call in m.get("tool_calls") or []:
            fn = call.get("function", call)
            lines.append(f"  -> {fn.get('name')}({fn.get('arguments', '')})")
    return "\n".join(lines)


def table_rows(records: Sequence[Mapping[str, Any]]) -> list[list[Any]]:
    """One row per record in :data:`COLUMNS` order."""
    rows = []
    for r in records:
        first_user = next((m.get("content") for m in r.get("messages") or [] if m.get("role") == "user"), None)
        prompt = r.get("prompt") if r.get("prompt") is not None else first_user
        values = {**r, "prompt": "" if prompt is None else str(prompt), "transcript": transcript_text(r)}
        rows.append([values.get(c) for c in COLUMNS])
    return rows


class TrackerLogger:
    """Base of the tracker loggers (see the module docs)."""

    def __init__(self, output_dir: str) -> None:
        self.output_dir = output_dir
        self._started = False

    # ------------------------------------------------------------------ the logger protocol
    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        self._ensure_started()
        values = numeric(metrics)
        if values:
            self.log_metrics(values, int(step))

    def log_rollouts(self, records: Sequence[Mapping[str, Any]], step: int) -> None:
        if records:
            self._ensure_started()
            self.log_table(list(COLUMNS), table_rows(records), int(step))

    def close(self) -> None:
        if self._started:
            self.finish()
            self._started = False

    # ------------------------------------------------------------------ helpers
    def config(self) -> dict[str, Any]:
        """``run.json``: the resolved recipe and the component provenance ({} if absent)."""
        path = os.path.join(self.output_dir, "run.json")
        try:
            with open(path, encoding="utf-8") as fh:
                return dict(json.load(fh))
        except (OSError, ValueError):
            return {}

    def display_name(self, name: str | None) -> str:
        """The tracker run's name: ``name``, else the recipe's name."""
        return name or str(
            self.config().get("recipe", {}).get("name") or os.path.basename(os.path.abspath(self.output_dir))
        )

    def _ensure_started(self) -> None:
        if not self._started:
            self.start(self.config())
            self._started = True

    # ------------------------------------------------------------------ what a tracker writes
    def start(self, config: dict[str, Any]) -> None:
        raise NotImplementedError

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def log_table(self, columns: list[str], rows: list[list[Any]], step: int) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        raise NotImplementedError
