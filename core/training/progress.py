"""Progress bars for long work (tqdm), quiet under pytest unless asked for."""

from __future__ import annotations

import os
import sys
from typing import Any


def progress(total: int, desc: str, initial: int = 0) -> Any:
    from tqdm.auto import tqdm

    disable = os.environ.get("TEMPERING_PROGRESS", "1") == "0"
    return tqdm(
        total=total, initial=initial, desc=desc, disable=disable, dynamic_ncols=True, file=sys.stderr, mininterval=0.5
    )
