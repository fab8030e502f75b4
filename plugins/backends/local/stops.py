"""Stop strings and stop tokens of ``SamplingParams.stop``, the same for both of the local
backend's samplers (``generate`` in :mod:`~tempering.plugins.backends.local.generation`, and
:mod:`~tempering.plugins.backends.local.vllm_engine`): a module of their own so that neither
imports the other's private helpers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def split_stop(stop: Any) -> tuple[list[str], list[int]]:
    """``SamplingParams.stop`` holds strings or token ids (a bare string is one stop)."""
    items = [stop] if isinstance(stop, (str, int)) else list(stop or [])
    strings = [s for s in items if isinstance(s, str)]
    ids = [int(s) for s in items if not isinstance(s, str)]
    if any(s == "" for s in strings):
        raise ValueError("SamplingParams.stop: empty stop string")
    return strings, ids


def before_first(text: str, stops: Sequence[str]) -> str:
    """``text`` up to the earliest stop string (the OpenAI/vLLM convention for ``text``)."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(hits)] if hits else text
