"""Cross-entropy on the weighted target tokens."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from tempering.interfaces import LossOutput
from tempering.loss_contract import WEIGHTS


@dataclass
class CrossEntropyLoss:
    """``-sum(weights * logprobs)``: a *sum*, exactly Tinker's built-in ``cross_entropy``.

    Normalisation (token mean, per-sequence mean) is folded into ``weights`` by the caller, so
    the local and Tinker backends compute the same gradient for the same batch.
    """

    needs_logits: ClassVar[bool] = False
    tinker_builtin: ClassVar[str | None] = "cross_entropy"
    reads: ClassVar[frozenset[str]] = frozenset({WEIGHTS})  # the loss contract

    def __call__(self, logprobs: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> LossOutput:
        weights = batch[WEIGHTS]
        loss = -(logprobs * weights).sum()
        mask = weights != 0
        nll = -(logprobs[mask]).mean() if mask.any() else logprobs.new_zeros(())
        return LossOutput(loss, {"nll": float(nll.detach())})
