"""A reward is any callable ``(completion: str, example: Mapping) -> float``.

Registered as a dataclass, its fields are its config keys: a recipe writes
``reward: {name: length_penalty, max_chars: 8}``, and a misspelt key (``max_char``) fails
with its full path before anything trains.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass
class LengthPenalty:
    """``1.0`` for completions of at most ``max_chars`` characters (after ``strip``), then
    ``penalty`` less per extra character, never below ``floor``."""

    max_chars: int = 16
    penalty: float = 0.1
    floor: float = 0.0

    def __post_init__(self) -> None:
        if self.max_chars < 0 or self.penalty < 0:
            raise ValueError(
                f"length_penalty: max_chars and penalty must be >= 0, got {self.max_chars}, {self.penalty}"
            )

    def __call__(self, completion: str, example: Mapping[str, Any]) -> float:
        extra = max(0, len(completion.strip()) - self.max_chars)
        return max(self.floor, 1.0 - self.penalty * extra)
