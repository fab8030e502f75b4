"""Datasets from files or the Hugging Face hub.

``jsonl`` reads a local JSON-lines file; ``hf`` goes through ``datasets.load_dataset`` so the
same config takes a hub name (``openai/gsm8k``) or a local format (``json`` with
``data_files``). ``rename`` maps source columns onto the keys our algorithms read
(``prompt``, ``answer``, ``chosen``, ``rejected``, ``demonstration``).

Each has a ``peek`` with the same keys, which a recipe calls before any stage trains
(:func:`tempering.training.stage.check_dataset`): it reads only the first rows of a local file, so a
missing file, an empty one or a missing column fails at once without loading the whole
dataset twice; for a hub dataset it returns ``None`` (knowing its rows would mean
downloading it), and the stage checks the rows when it starts.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Mapping
from typing import Any

PEEK_ROWS = 8  # rows a peek reads: enough to see the columns, few enough to be instant


def _rename(rows: list[dict[str, Any]], rename: dict[str, str] | None) -> list[dict[str, Any]]:
    if not rename:
        return rows
    return [{rename.get(k, k): v for k, v in r.items()} for r in rows]


def _read_jsonl(path: str, limit: int | None = None) -> list[dict[str, Any]]:
    """The first ``limit`` (all when None) rows of a JSON-lines file; blank lines skipped."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"jsonl dataset: no file at '{path}'")
    rows: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if limit is not None and len(rows) >= limit:
                break
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{number}: not a JSON line ({exc.msg})") from None
                if not isinstance(row, dict):  # a row is named columns: a list has none
                    raise ValueError(
                        f"{path}:{number}: expected a JSON object of columns per line, such as "
                        f'{{"prompt": "...", "answer": "..."}}, got a {type(row).__name__}'
                    )
                rows.append(row)
    return rows


def _limit(size: int | None, peek: bool) -> int | None:
    return min(PEEK_ROWS, size) if peek and size is not None else (PEEK_ROWS if peek else size)


def jsonl(path: str, rename: dict[str, str] | None = None, size: int | None = None) -> list[dict[str, Any]]:
    return _rename(_read_jsonl(path, size), rename)


def _peek_jsonl(path: str, rename: dict[str, str] | None = None, size: int | None = None) -> list[dict[str, Any]]:
    return _rename(_read_jsonl(path, _limit(size, peek=True)), rename)


jsonl.peek = _peek_jsonl  # type: ignore[attr-defined]


def hf(
    path: str,
    split: str = "train",
    name: str | None = None,
    data_files: object = None,
    rename: dict[str, str] | None = None,
    size: int | None = None,
) -> list[dict[str, Any]]:
    import datasets

    ds = datasets.load_dataset(path, name, split=split, data_files=data_files)
    if size is not None:
        ds = ds.select(range(min(size, len(ds))))
    return _rename([dict(r) for r in ds], rename)


def _peek_hf(
    path: str,
    split: str = "train",
    data_files: Any = None,
    rename: dict[str, str] | None = None,
    size: int | None = None,
    **_: Any,
) -> list[dict[str, Any]] | None:
    """Local ``data_files`` must exist; the first rows of a JSON-lines one are read. ``None``
    (rows unknown until the stage loads them) for anything else, e.g. a hub name."""
    if data_files is None:
        return None
    files = data_files.get(split) if isinstance(data_files, Mapping) else data_files
    if files is None:
        raise ValueError(f"data_files has no '{split}' split (it has: {sorted(data_files)})")
    found: list[str] = []
    for pattern in [files] if isinstance(files, str) else list(files):
        if "://" in str(pattern):
            return None  # remote files: not checked without downloading
        matches = sorted(glob.glob(str(pattern)))
        if not matches:
            raise FileNotFoundError(f"hf dataset: no file matches data_files '{pattern}'")
        found += matches
    if path != "json" or not found[0].endswith(".jsonl"):
        return None
    rows: list[dict[str, Any]] = []
    for file in found:
        rows += _read_jsonl(file, _limit(size, peek=True))
        if rows:
            break
    return _rename(rows, rename)


hf.peek = _peek_hf  # type: ignore[attr-defined]
