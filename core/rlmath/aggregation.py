"""From a per-token loss to a scalar: aggregations, and their normalisers folded into advantages.

How a ``(B, T)`` per-token loss ``l`` is reduced decides how much each token and each sequence
weighs, so it is part of the algorithm (TRL 1.16's ``loss_type``; ``m`` = the mask's weights,
``B`` = rows, sums over all ``(b, t)``) -- :func:`aggregate`:

- ``"grpo"``: ``mean_b( sum_t m*l / max(sum_t m, 1) )`` -- per-sequence token mean, then the
  mean over all ``B`` rows (a row with no completion token counts as 0). Length-biased: a
  token of a short answer weighs more.
- ``"bnpo"``: ``sum m*l / max(sum m, 1)`` -- token mean over this call's batch.
- ``"dapo"``: ``sum m*l / N`` with ``N`` the number of completion tokens in the *whole* batch
  the optimizer step covers (``num_items``; default ``sum m``, which equals ``bnpo``). A
  backend that splits a step into micro-batches passes the step's token count and sums the
  micro-batch losses, which reproduces TRL's global token mean exactly.
- ``"dr_grpo"``: ``sum m*l / (B * L)`` with a constant ``L = max_completion_length`` (default:
  the padded width ``T``): no length bias and no per-batch normaliser (Dr. GRPO).

:func:`aggregate_mean` is the same reduction named as the distillation losses name it
(``seq_mean`` = ``grpo``, ``token_mean`` = ``bnpo``) over the 0/1 view of the mask.

A backend whose losses are plain *sums over tokens* (Tinker's built-ins) cannot normalise: any
*linear* aggregation with non-negative coefficients ``c[b, t]`` is folded into the advantages
instead, because ``c * f(r, A) = f(r, c * A)`` for every loss here that is linear in ``A``
(``min(r cA, clip(r) cA) = c min(r A, clip(r) A)`` for ``c >= 0``). :func:`fold_normaliser` gives
those coefficients for ``token_mean`` / ``seq_mean`` / ``sum`` on plain lists (a stage folds them
in before the batch leaves), :func:`aggregation_coefficients` reads them off any linear
aggregation by autograd, so they are exactly the ones the loss uses.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from tempering.rlmath.masks import active

__all__ = [
    "FOLD_AGGREGATIONS",
    "LOSS_TYPES",
    "MEAN_AGGREGATIONS",
    "aggregate",
    "aggregate_mean",
    "aggregation_coefficients",
    "fold_normaliser",
]

#: TRL 1.16's ``loss_type`` values, for :func:`aggregate`.
LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo")
#: The mean aggregations of :func:`aggregate_mean`, and the ``loss_type`` each one is.
MEAN_AGGREGATIONS = {"seq_mean": "grpo", "token_mean": "bnpo"}
#: What :func:`fold_normaliser` folds.
FOLD_AGGREGATIONS = ("token_mean", "seq_mean", "sum")


def aggregate(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str = "dapo",
    max_completion_length: int | None = None,
    num_items: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a ``(B, T)`` per-token loss to a scalar; see the module docstring for each
    ``loss_type``'s normaliser. ``max_completion_length`` (dr_grpo) defaults to ``T``;
    ``num_items`` (dapo) defaults to ``mask.sum()``."""
    # select, not multiply: 0 * NaN is NaN, so a NaN on a masked position would leak through
    masked = torch.where(active(mask), per_token_loss * mask, torch.zeros_like(per_token_loss))
    if loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dapo":
        n = mask.sum() if num_items is None else torch.as_tensor(num_items, dtype=masked.dtype, device=masked.device)
        return masked.sum() / n.clamp(min=1.0)
    if loss_type == "dr_grpo":
        length = per_token_loss.size(-1) if max_completion_length is None else max_completion_length
        return masked.sum() / (per_token_loss.size(0) * length)
    raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")


def aggregate_mean(per_token: torch.Tensor, mask: torch.Tensor, aggregation: str = "seq_mean") -> torch.Tensor:
    """``seq_mean`` (per-sequence mean over its loss tokens, then the mean over the ``B`` rows)
    or ``token_mean`` (over all loss tokens) of ``per_token``, counting each position where
    ``mask`` is non-zero once whatever its weight. The token sum this equals once
    :func:`fold_normaliser` is folded in."""
    if aggregation not in MEAN_AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {tuple(MEAN_AGGREGATIONS)}, got {aggregation!r}")
    return aggregate(per_token, (mask != 0).to(per_token.dtype), MEAN_AGGREGATIONS[aggregation])


def fold_normaliser(weights: list[list[float]], aggregation: str) -> list[list[float]]:
    """Per-token factors that turn a token *sum* into the ``aggregation`` mean: ``1 / N``
    (``token_mean``, ``N`` loss tokens in the batch), ``1 / (B * n_b)`` (``seq_mean``: ``B``
    rows, ``n_b`` loss tokens in row ``b``; a row without any counts as 0, as TRL's ``grpo``
    loss type), or 1 (``sum``); 0 off the mask. Multiply advantages by them before a sum loss.

    On plain lists because a stage folds them into :class:`~tempering.types.Datum` rows
    before the batch reaches a backend."""
    counts = [sum(1 for w in row if w != 0) for row in weights]
    if aggregation == "token_mean":
        total = max(sum(counts), 1)
        return [[1.0 / total if w != 0 else 0.0 for w in row] for row in weights]
    if aggregation == "seq_mean":
        b = max(len(weights), 1)
        return [[1.0 / (b * n) if w != 0 else 0.0 for w in row] for row, n in zip(weights, counts)]
    if aggregation == "sum":
        return [[1.0 if w != 0 else 0.0 for w in row] for row in weights]
    raise ValueError(f"aggregation must be token_mean, seq_mean or sum, got {aggregation!r}")


def aggregation_coefficients(aggregate_fn: Callable[[torch.Tensor], torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """``c[b, t] = d aggregate(l) / d l[b, t]``: the per-token weight of a *linear* aggregation
    (token mean, per-sequence mean, constant normaliser), read off by autograd so it is exactly
    the one the loss uses. Checked to be linear (``aggregate(l) == sum(c * l)`` on a probe) and
    non-negative, the two conditions under which it folds into the advantages."""
    x = torch.zeros_like(mask, dtype=torch.float32, requires_grad=True)
    (coef,) = torch.autograd.grad(aggregate_fn(x), x)
    probe = torch.linspace(-1.0, 2.0, mask.numel(), dtype=torch.float32).reshape(mask.shape)
    with torch.no_grad():
        direct, folded = float(aggregate_fn(probe)), float((coef * probe).sum())
    if not math.isclose(direct, folded, rel_tol=1e-5, abs_tol=1e-6):  # pragma: no cover - a non-linear aggregation
        raise ValueError(
            "the loss's aggregation is not linear in the per-token loss; it cannot be folded into advantages"
        )
    if bool((coef < 0).any()):  # pragma: no cover - defensive
        raise ValueError("the loss's aggregation has negative coefficients; it cannot be folded into advantages")
    return coef.detach()
