"""``run.json`` stays true to what was trained.

A run folder's ``run.json`` records the recipe the run trained with. Running a recipe into a
folder that already holds a run compares the two recipes key by key (:func:`changed_keys`):

* every stage already finished (nothing runs): ``run.json`` is left as it is -- the run never
  trained with the new values -- and a :class:`~tempering.runs.runfolder.RecipeChanged`
  warning names the changed keys and says ``--fresh`` starts over with them;
* a resumed run: the new recipe is recorded, and ``recipe_changes`` in ``run.json`` lists,
  for each resume that changed something, the global step it resumed at and every changed
  key as ``[old, new]`` (``null`` for a key one side lacks); a warning names the keys.

``resume`` itself is not compared (``--fresh`` sets it). See docs/runs.md.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from typing import Any

from tempering.runs.runfolder import RecipeChanged, write_json

RUN_JSON = "run.json"
#: Recipe keys that say how to run, not what is trained: never reported as a change.
NOT_COMPARED = frozenset({"resume"})
_UNSET = object()


def flatten(node: object, prefix: str = "") -> dict[str, Any]:
    """Leaf values by key path: ``{"stages[0].optimizer.learning_rate": 0.001, ...}``. An empty
    mapping or list is a leaf, so adding one is a change too."""
    if isinstance(node, Mapping) and node:
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(node, list) and node:
        out = {}
        for i, value in enumerate(node):
            out.update(flatten(value, f"{prefix}[{i}]"))
        return out
    return {prefix: node}


def changed_keys(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Each key path whose value differs between two recorded recipes -> ``(old, new)``
    (``None`` where one side lacks the key), in the new recipe's order, then removed keys."""
    a = {k: v for k, v in flatten(dict(old)).items() if k.split(".")[0].split("[")[0] not in NOT_COMPARED}
    b = {k: v for k, v in flatten(dict(new)).items() if k.split(".")[0].split("[")[0] not in NOT_COMPARED}
    out: dict[str, tuple[Any, Any]] = {}
    for key in [*b, *(k for k in a if k not in b)]:
        before, after = a.get(key, _UNSET), b.get(key, _UNSET)
        if before != after or type(before) is not type(after):
            out[key] = (None if before is _UNSET else before, None if after is _UNSET else after)
    return out


def describe(changes: Mapping[str, tuple[Any, Any]], most: int = 6) -> str:
    """``key (old -> new), ...``: the first ``most`` changes, then how many more."""

    def show(value: object) -> str:
        text = json.dumps(value) if value is not None else "unset"
        return text if len(text) <= 40 else text[:37] + "..."

    parts = [f"{key} ({show(a)} -> {show(b)})" for key, (a, b) in list(changes.items())[:most]]
    more = len(changes) - most
    return ", ".join(parts) + (f" and {more} more" if more > 0 else "")


def read(output_dir: str) -> dict[str, Any] | None:
    """The folder's ``run.json``, or None (none there, or unreadable: then nothing to compare)."""
    try:
        with open(os.path.join(output_dir, RUN_JSON), encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def update(
    output_dir: str, metadata: dict[str, Any], progress: Mapping[str, Any] | None, already_complete: bool
) -> dict[str, Any]:
    """Write ``run.json`` for this run (``metadata``: the new record; ``progress``: the
    resumed run's, None for a new run) and return what the folder's record now is."""
    earlier = read(output_dir) if progress else None
    if earlier is None or not isinstance(earlier.get("recipe"), Mapping):
        write_json(os.path.join(output_dir, RUN_JSON), metadata)
        return metadata
    changes = changed_keys(earlier["recipe"], metadata["recipe"])
    if already_complete:
        if changes:
            warnings.warn(
                f"tempering: the recipe differs from the one {output_dir} finished with: {describe(changes)}; "
                f"nothing was run, so {RUN_JSON} keeps the recipe the run trained with. To train with "
                "the change, run it with --fresh (the finished run is moved aside) or another --output-dir",
                RecipeChanged,
                stacklevel=4,
            )
        return earlier
    history = list(earlier.get("recipe_changes") or [])
    if changes:
        step = int(progress.get("global_step", 0)) if progress else 0
        history.append({"global_step": step, "changed": {k: [a, b] for k, (a, b) in changes.items()}})
        warnings.warn(
            f"tempering: resuming {output_dir} at step {step} with a changed recipe: {describe(changes)}; "
            f"{RUN_JSON} records the new recipe and lists the change under recipe_changes",
            RecipeChanged,
            stacklevel=4,
        )
    record = {**metadata, "recipe_changes": history} if history else metadata
    write_json(os.path.join(output_dir, RUN_JSON), record)
    return record
