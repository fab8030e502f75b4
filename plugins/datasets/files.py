"""Datasets from files or the Hugging Face hub.

``jsonl`` reads a local JSON-lines file; ``hf`` goes through ``datasets.load_dataset`` so the
same config takes a hub name (``openai/gsm8k``) or a local format (``json`` with
``data_files``). ``rename`` maps source columns onto the keys our algorithms read
(``prompt``, ``answer``, ``chosen``, ``rejected``, ``demonstration``).
"""

from __future__ import annotations

import json
import os
from typing import Any


def _rename(rows: list[dict[str, Any]], rename: dict[str, str] | None) -> list[dict[str, Any]]:
    if not rename:
        return rows
    return [{rename.get(k, k): v for k, v in r.items()} for r in rows]


def jsonl(path: str, rename: dict[str, str] | None = None, size: int | None = None) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        raise FileNotFoundError(f"jsonl dataset: no file at '{path}'")
    with open(path, encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    return _rename(rows[:size] if size is not None else rows, rename)


def hf(
    path: str,
    split: str = "train",
    name: str | None = None,
    data_files: Any = None,
    rename: dict[str, str] | None = None,
    size: int | None = None,
) -> list[dict[str, Any]]:
    import datasets

    ds = datasets.load_dataset(path, name, split=split, data_files=data_files)
    if size is not None:
        ds = ds.select(range(min(size, len(ds))))
    return _rename([dict(r) for r in ds], rename)
