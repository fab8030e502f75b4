"""One JSON object per step in ``<output_dir>/metrics.jsonl``: easy to tail, grep and load."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN; keep it visible rather than dropping the key
    if isinstance(v, (int, float, str, bool)) or v is None:
        return v
    if hasattr(v, "item"):
        return _clean(v.item())
    return str(v)


class JsonlLogger:
    def __init__(self, output_dir: str, filename: str = "metrics.jsonl") -> None:
        os.makedirs(output_dir, exist_ok=True)
        self.path = os.path.join(output_dir, filename)
        self._fh = open(self.path, "a", encoding="utf-8")  # append: a resumed run continues the file

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        self._fh.write(json.dumps({k: _clean(v) for k, v in metrics.items()}) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def read_jsonl(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]
