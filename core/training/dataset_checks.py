"""Checking a stage's dataset before anything trains: it loads, is not empty, and its rows hold
the columns the stage and its reward read.

A recipe validates every stage before the first one trains (:func:`tempering.training.stage.check_stage`
calls :func:`check_dataset`), so a missing file, an empty split or a missing ``answer`` column
in the last stage fails in a second, as one line with the key to fix -- not as a traceback after
the earlier stages trained. What the rows must hold is declared, not guessed: each stage passes
its :data:`Columns`, and a reward class names the config keys that hold its columns in
``column_keys``.

Cost: a registered dataset is loaded to be checked (cheap for the built-in ones), unless its
factory has a ``peek(**params)`` that reads only its first rows (``jsonl``, ``hf`` with local
files) or returns ``None`` when the rows cannot be known without the expensive load (a hub
dataset); such rows are checked when the stage loads them.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tempering.errors import ConfigError, TemperingError
from tempering.registry import split_spec

if TYPE_CHECKING:  # pragma: no cover
    from tempering.interfaces import BuildContext

#: What a stage's dataset rows must hold: ``{format column: {other column: config key naming
#: it}}``. A row must have one of the format columns (``prompt`` or ``messages``; ``""``
#: matches any row) and every column listed under the first one it has; the config key is the
#: error's path (``completion_key``, ``reward.answer_key``). ``{}`` = no particular column.
Columns = Mapping[str, Mapping[str, str]]


def prompt_columns(sampler: object, needed: Mapping[str, str]) -> Columns:
    """Rows rolled out by ``sampler``: ``prompt`` text or a ``messages`` chat for the
    ``completion`` sampler, each with the columns in ``needed``; any row for a sampler that
    builds its own prompts (an environment)."""
    name = sampler if isinstance(sampler, str) else (sampler.get("name") if isinstance(sampler, Mapping) else None)
    if name != "completion":
        return {}
    return {"prompt": dict(needed), "messages": dict(needed)}


def reward_columns(ctx: BuildContext, spec: object, key: str = "reward") -> dict[str, str]:
    """The dataset columns a reward reads, from its config without building it: a reward
    class lists the config keys that name columns in ``column_keys`` (``ExactMatch``:
    ``("answer_key",)``). Unknown for a reward given as a Python object."""
    if not isinstance(spec, (str, Mapping)):
        return {}
    ctx.check("reward", spec, key)  # an unknown name or key fails here, with its path
    name, params = split_spec(spec, f"{ctx.path}.{key}")
    factory = ctx.registry.get("reward", name).load()
    out: dict[str, str] = {}
    for k in getattr(factory, "column_keys", ()):
        try:
            default = inspect.signature(factory).parameters[k].default
        except (KeyError, TypeError, ValueError):
            default = None
        column = params.get(k, default)
        if isinstance(column, str):
            out[column] = f"{key}.{k}"
    return out


def preview_rows(ctx: BuildContext, spec: object, key: str) -> list[dict[str, Any]] | None:
    """The rows :func:`check_dataset` looks at, without training anything.

    A list is used as it is. A registered dataset is loaded -- cheap for the built-in ones --
    unless its factory has a ``peek(**params)`` function (``jsonl``, ``hf``): that returns a
    few rows cheaply (the first lines of a file), or ``None`` when they cannot be known cheaply
    (a hub dataset: then the stage checks its rows when it starts). A dataset that fails to
    load is a :class:`ConfigError` at ``key``.
    """
    if isinstance(spec, list):
        return [dict(x) for x in spec]
    make = ctx.factory("dataset", spec, key)  # name and keys validated here
    func, params = getattr(make, "func", None), getattr(make, "keywords", None) or {}
    peek = getattr(func, "peek", None)
    try:
        rows = peek(**params) if peek is not None else make()
        return None if rows is None else [dict(x) for x in rows]
    except TemperingError:
        raise
    except Exception as exc:  # noqa: BLE001 - any load error, reported with the key's path
        raise ConfigError(f"the dataset does not load: {type(exc).__name__}: {exc}", f"{ctx.path}.{key}") from None


def check_dataset(ctx: BuildContext, spec: object, key: str, columns: Columns | None = None) -> None:
    """The dataset at ``key`` loads, is not empty and every row has the ``columns`` (see
    :data:`Columns`) -- checked before any stage trains, so a later stage's missing column
    does not surface after the earlier stages trained."""
    rows = preview_rows(ctx, spec, key)
    if rows is not None:
        check_rows(rows, columns or {}, ctx.path, key, renames=takes_rename(ctx, spec, key))


def takes_rename(ctx: BuildContext, spec: object, key: str) -> bool:
    """The dataset at ``key`` has a ``rename`` key (``jsonl``, ``hf``: a user's own files), so a
    missing column's fix is to rename one; a built-in dataset made for another task has none."""
    if isinstance(spec, list):
        return False
    func = getattr(ctx.factory("dataset", spec, key), "func", None)
    try:
        return func is not None and "rename" in inspect.signature(func).parameters
    except (TypeError, ValueError):  # a callable without a signature: offer the generic fix
        return True


def check_rows(rows: Sequence[Mapping[str, Any]], columns: Columns, path: str, key: str, renames: bool = True) -> None:
    """``rows`` (all of a dataset's, or the first few) are not empty and hold ``columns``:
    before training from a preview, and again by a stage on the rows it loaded. ``renames``:
    the dataset takes a ``rename`` key, the fix a missing column's message offers."""
    if not rows:
        raise ConfigError("the dataset is empty (0 rows): check its path, split, size or filter", f"{path}.{key}")
    check_columns(rows, columns, path, key, renames)


def check_columns(
    rows: Iterable[Mapping[str, Any]], columns: Columns, path: str, key: str, renames: bool = True
) -> None:
    """Every row has one of the format columns and the columns listed under it."""
    formats = list(columns)
    if not formats:
        return
    for i, row in enumerate(rows):
        fmt = next((f for f in formats if f == "" or f in row), None)
        if fmt is None:
            either = " or ".join(f"'{f}'" for f in formats)
            fix = (
                f"rename a column (e.g. rename: {{your_column: {formats[0]}}})"
                if renames
                else "this dataset is made for another kind of stage: choose one whose rows have it, "
                f"or load yours with jsonl or hf, whose rename maps a column onto {formats[0]}"
            )
            raise ConfigError(f"rows have no {either} (row {i} has keys: {sorted(row)}); {fix}", f"{path}.{key}")
        for column, column_key in columns[fmt].items():
            if column not in row:
                raise ConfigError(
                    f"rows have no '{column}' (row {i} has keys: {sorted(row)}); set {column_key} "
                    "to the column that holds it" + (", or rename that column" if renames else ""),
                    f"{path}.{column_key}",
                )
