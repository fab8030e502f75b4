"""The loss-mask convention shared by every RL function.

A mask is the batch's ``weights``: a position counts when its weight is non-zero, and its
weight may scale it (fractional weights). Positions that do not count may hold anything -- a
failed sample's NaN advantage, a huge padding logprob -- so they are *selected away*, never
multiplied by 0: ``0 * NaN`` is NaN, and so is the gradient of such a product.
"""

from __future__ import annotations

import torch

__all__ = ["active", "masked"]


def active(mask: torch.Tensor) -> torch.Tensor:
    """``BoolTensor``: True where ``mask`` is non-zero (the positions that count)."""
    return mask != 0


def masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` where ``mask`` is non-zero, exactly 0 elsewhere (and no gradient there)."""
    return torch.where(active(mask), x, torch.zeros_like(x))
