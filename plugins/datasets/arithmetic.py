"""Synthetic addition problems: the bundled CPU demo's task.

Pairs ``a + b`` with ``a, b`` in ``[low, high]`` are split into train and test by a seeded
shuffle of *all* pairs, so the test questions are never seen in training.
"""

from __future__ import annotations

import random
from typing import Any


def all_pairs(low: int, high: int) -> list[tuple[int, int]]:
    return [(a, b) for a in range(low, high + 1) for b in range(low, high + 1)]


def arithmetic(
    split: str = "train",
    size: int | None = None,
    low: int = 0,
    high: int = 99,
    test_size: int = 500,
    seed: int = 1234,
) -> list[dict[str, Any]]:
    """``{"prompt": "23+45=", "answer": "68"}`` rows for ``split`` in {train, test}."""
    if split not in ("train", "test"):
        raise ValueError(f"arithmetic: split must be 'train' or 'test', got '{split}'")
    pairs = all_pairs(low, high)
    if test_size >= len(pairs):
        raise ValueError(f"arithmetic: test_size {test_size} leaves no training pairs (only {len(pairs)} exist)")
    random.Random(seed).shuffle(pairs)
    chosen = pairs[:test_size] if split == "test" else pairs[test_size:]
    if size is not None:
        chosen = chosen[:size]
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in chosen]
