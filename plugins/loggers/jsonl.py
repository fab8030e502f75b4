"""One JSON object per step in ``<output_dir>/metrics.jsonl``: easy to tail, grep and load."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any


def _clean(v: object) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN; keep it visible rather than dropping the key
    if isinstance(v, (int, float, str, bool)) or v is None:
        return v
    if hasattr(v, "item"):
        return _clean(v.item())
    return str(v)


class JsonlLogger:
    """Appends one line per logged row, flushed at once (a killed run loses no finished row).

    A resumed run continues the file after :meth:`rewind` cut it back to the rows its
    checkpoint had seen, so every step is in the file once.
    """

    def __init__(self, output_dir: str, filename: str = "metrics.jsonl") -> None:
        os.makedirs(output_dir, exist_ok=True)
        self.path = os.path.join(output_dir, filename)
        self._fh = open(self.path, "a", encoding="utf-8")  # append: a resumed run continues the file

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        self._fh.write(json.dumps({k: _clean(v) for k, v in metrics.items()}) + "\n")
        self._fh.flush()

    def rewind(self, rows: int) -> None:
        """Keep the first ``rows`` lines and drop the rest: those were logged after the
        checkpoint the run resumes from, by a run that was killed, and will be logged again.
        A line cut short by the kill is dropped too."""
        self._fh.flush()
        keep = 0
        with open(self.path, "rb") as fh:
            for _ in range(rows):
                line = fh.readline()
                if not line.endswith(b"\n"):
                    break  # fewer whole rows than the checkpoint saw (the file was edited): keep them
                keep += len(line)
        os.truncate(self.path, keep)

    def close(self) -> None:
        self._fh.close()


def read_jsonl(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]
