"""Learning-rate schedules as pure functions of the step (so resume needs no extra state)."""

from __future__ import annotations

import math


def lr_at(
    step: int, total: int, base: float, schedule: str = "constant", warmup: int = 0, final_ratio: float = 0.0
) -> float:
    """Learning rate for optimizer step ``step`` (0-based) of ``total``."""
    if warmup and step < warmup:
        return base * (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return base
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        return base * (1 - (1 - final_ratio) * frac)
    if schedule == "cosine":
        return base * (final_ratio + (1 - final_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))
    raise ValueError(f"unknown lr schedule '{schedule}'; use constant, linear or cosine")
