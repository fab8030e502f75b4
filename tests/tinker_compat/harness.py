"""What the compatibility tests share: the served model's name, the server handle, and
:func:`run_driver` (a cookbook call in a fresh, time-bounded process)."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
KEY = "tml-compat"


@dataclass
class Served:
    url: str
    env: dict[str, str]  # what a client process needs: base URL, key, offline HF cache


def run_driver(served: Served, call: str, tmp_path: Path, timeout: float = 60) -> str:
    """``call`` (Python, e.g. ``rl_sync('/tmp/x')``) of :mod:`drivers` in a fresh process -- the
    environment a user's script has (the served URL, an offline HF cache) and a hard bound on
    the wait. Returns its output; a failure shows the output's end."""
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); from drivers import *; {call}"
    began = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", code], env=served.env, cwd=tmp_path, capture_output=True, text=True, timeout=timeout
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, f"{call} failed after {time.monotonic() - began:.0f} s:\n{text[-4000:]}"
    return text
