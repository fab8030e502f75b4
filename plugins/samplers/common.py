"""What both built-in samplers need: explicit stop tokens."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from tempering.types import SamplingParams


def with_stops(params: SamplingParams, ids: Iterable[int]) -> SamplingParams:
    """``params`` with the token ids that end a turn added to ``stop`` -- unless the user gave
    stop *strings*, which Tinker cannot mix with ids (both backends stop at EOS regardless)."""
    current: list[Any] = [params.stop] if isinstance(params.stop, (str, int)) else list(params.stop or [])
    if any(isinstance(s, str) for s in current):
        return replace(params, stop=current)
    extra = [int(i) for i in ids if int(i) not in current]
    return replace(params, stop=current + extra)


def eos_ids(tokenizer: object) -> list[int]:
    """The tokenizer's EOS id(s), as the explicit stop of a plain-text prompt."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]
