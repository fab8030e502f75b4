"""DPO-family preference losses over per-token logprobs (a pure function of the batch).

Layout: a batch of ``2N`` rows holds ``N`` pairs *interleaved*: row ``2i`` is pair ``i``'s
chosen completion and row ``2i + 1`` its rejected one, both after the same prompt (a
multi-turn side that spans several rows instead marks each row with its slot, ``2i`` or
``2i + 1``, in ``batch["dpo_slot"]``, see :func:`pair_sequence_logprobs`). (TRL stacks
all chosen rows, then all rejected rows; interleaving keeps a pair together when a backend
splits a batch into micro-batches.) Per row, over target positions ``(B, T)`` as
:meth:`tempering.types.Batch.to_tensors` pads them:

* ``logprobs``: the policy's per-token logprobs (the backend's forward pass);
* ``batch["weights"]``: the completion mask (non-zero on completion tokens, 0 on prompt and
  padding positions; any non-zero value counts as 1);
* ``batch["ref_logprobs"]``: the reference policy's per-token logprobs (``Datum.extra``), live
  or precomputed -- the stage decides.

With sequence logprobs ``s = sum_t m_t lp_t`` and ``ref = sum_t m_t ref_t``, the implicit
rewards are ``r_c = beta (s_c - ref_c)`` and ``r_r = beta (s_r - ref_r)``, ``d = (s_c - ref_c) -
(s_r - ref_r)``, and per pair (``eps`` = ``label_smoothing``):

* ``sigmoid``: ``-(1 - eps) log sigmoid(beta d) - eps log sigmoid(-beta d)`` (DPO; with ``eps > 0``
  the "conservative DPO" of Mitchell 2023 -- TRL 1.16's ``sigmoid`` ignores
  ``label_smoothing``, so only ``eps = 0`` is TRL's ``sigmoid``);
* ``robust``: ``((1 - eps)(-log sigmoid(beta d)) + eps log sigmoid(-beta d)) / (1 - 2 eps)``
  (Robust DPO, TRL's ``robust``);
* ``ipo``: ``(d_c / n_c - d_r / n_r - 1 / (2 beta))^2`` with ``d_* = s_* - ref_*`` and ``n_*`` the
  completion lengths (IPO, length-normalised exactly as TRL 1.16's ``ipo``);
* ``sigmoid_sft``: ``sigmoid`` plus ``sft_weight`` times the token-mean NLL of the *chosen*
  completions over the whole batch -- TRL 1.16's ``loss_type=["sigmoid", "sft"]`` with
  ``loss_weights=[1, sft_weight]`` (the RPO recipe of Pang et al. 2024, whose NLL term TRL
  normalises per token over the batch; that is the normalisation used here).

The loss is the mean over pairs, plus the SFT term. ``sft_weight`` may also be set with the
other loss types (it is added the same way); it defaults to 1 for ``sigmoid_sft`` and 0 else.
Metrics use TRL's names: ``rewards/chosen``, ``rewards/rejected``, ``rewards/margins`` (means of
``r_c``, ``r_r``, ``r_c - r_r``), ``rewards/accuracies`` (share of pairs with ``r_c > r_r``),
``logps/chosen`` and ``logps/rejected`` (means of ``s``), plus ``dpo/loss`` (the preference part)
and ``sft/nll`` when an SFT term is added.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from tempering.interfaces import LossOutput
from tempering.loss_contract import DPO_SLOT, REF_LOGPROBS, WEIGHTS
from tempering.schema import Problem, one_of, raise_problems

__all__ = ["DPOLoss", "LOSS_TYPES", "pair_sequence_logprobs", "preference_loss"]

LOSS_TYPES = ("sigmoid", "ipo", "robust", "sigmoid_sft")


def pair_sequence_logprobs(
    logprobs: torch.Tensor, mask: torch.Tensor, slots: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(B, T)`` per-token values of interleaved pairs -> ``(chosen_sum, rejected_sum,
    chosen_len, rejected_len)``, each ``(N,)``. Masked positions contribute exactly 0, whatever
    they hold. ``slots`` (``(B, T)``, a row's slot at each of its positions): a multi-turn
    side may span several rows; row ``b`` then belongs to slot ``slots[b, 0]`` -- ``2i`` for
    pair i's chosen side, ``2i + 1`` its rejected -- and a side's sum is over its rows."""
    active = mask != 0
    sums = torch.where(active, logprobs, torch.zeros_like(logprobs)).sum(-1)
    lengths = active.sum(-1).to(logprobs.dtype)
    if slots is not None:
        slot = slots[:, 0].long()
        n = int(slot.max()) + 1 if slot.numel() else 0
        if n % 2 or bool((torch.bincount(slot, minlength=n) == 0).any()):
            raise ValueError(f"DPO: every pair needs a chosen and a rejected side; row slots are {slot.tolist()}")
        sums = sums.new_zeros(n).index_add(0, slot, sums)
        lengths = lengths.new_zeros(n).index_add(0, slot, lengths)
    elif logprobs.dim() != 2 or logprobs.size(0) % 2:
        raise ValueError(
            f"DPO: expected (2N, T) rows of interleaved (chosen, rejected) pairs, got shape {tuple(logprobs.shape)}"
        )
    return sums[0::2], sums[1::2], lengths[0::2], lengths[1::2]


def preference_loss(
    chosen_logratios: torch.Tensor,
    rejected_logratios: torch.Tensor,
    loss_type: str = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-pair loss ``(N,)`` from the policy-minus-reference sequence log-ratios."""
    delta = chosen_logratios - rejected_logratios
    eps = label_smoothing
    if loss_type in ("sigmoid", "sigmoid_sft"):
        return -(1 - eps) * F.logsigmoid(beta * delta) - eps * F.logsigmoid(-beta * delta)
    if loss_type == "robust":
        return ((1 - eps) * -F.logsigmoid(beta * delta) + eps * F.logsigmoid(-beta * delta)) / (1 - 2 * eps)
    if loss_type == "ipo":
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError("IPO needs the completion lengths")
        d = chosen_logratios / chosen_lengths.clamp(min=1.0) - rejected_logratios / rejected_lengths.clamp(min=1.0)
        return (d - 1 / (2 * beta)) ** 2
    raise ValueError(f"DPO loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")


@dataclass
class DPOLoss:
    """DPO / IPO / robust DPO / DPO+SFT on interleaved pairs (see the module docstring).

    Config keys: ``loss_type`` (``sigmoid`` default, ``ipo``, ``robust``, ``sigmoid_sft``),
    ``beta`` (0.1; for IPO the regulariser tau), ``label_smoothing`` (0.0; sigmoid = cDPO and
    robust only), ``sft_weight`` (weight of the chosen-NLL term; default 1 for ``sigmoid_sft``,
    else 0). Reads ``batch["weights"]`` and ``batch["ref_logprobs"]``.
    """

    loss_type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    sft_weight: float | None = None

    needs_logits: ClassVar[bool] = False
    tinker_builtin: ClassVar[str | None] = None  # custom loss (forward_backward_custom on Tinker)
    reads: ClassVar[frozenset[str]] = frozenset({WEIGHTS, REF_LOGPROBS})  # the loss contract; DPO_SLOT when present

    @staticmethod
    def check_config(config: Mapping[str, Any]) -> Iterator[Problem | None]:
        """The values that cannot work, at their keys (the loss's schema check,
        :mod:`tempering.schema`: the registry runs it before building, ``__post_init__`` too)."""
        loss_type, smoothing, sft = config["loss_type"], config["label_smoothing"], config["sft_weight"]
        yield one_of(
            "loss_type", loss_type, LOSS_TYPES, f"DPOLoss.loss_type must be one of {LOSS_TYPES}, got {loss_type!r}"
        )
        if config["beta"] <= 0:
            yield Problem("beta", f"DPOLoss.beta must be > 0, got {config['beta']}")
        if not 0.0 <= smoothing < 0.5:
            yield Problem("label_smoothing", f"DPOLoss.label_smoothing must be in [0, 0.5), got {smoothing}")
        if loss_type == "ipo" and smoothing:
            yield Problem(
                "label_smoothing", "DPOLoss: label_smoothing has no meaning for loss_type='ipo'; leave it at 0"
            )
        if sft is not None and sft < 0:
            yield Problem("sft_weight", f"DPOLoss.sft_weight must be >= 0, got {sft}")

    def __post_init__(self) -> None:
        raise_problems(self)

    @property
    def sft_coef(self) -> float:
        if self.sft_weight is not None:
            return float(self.sft_weight)
        return 1.0 if self.loss_type == "sigmoid_sft" else 0.0

    def __call__(self, logprobs: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> LossOutput:
        for key in (WEIGHTS, REF_LOGPROBS):
            if key not in batch:
                raise KeyError(f"DPOLoss needs batch[{key!r}]; the batch has {sorted(batch)}")
        mask = batch[WEIGHTS]
        ref = batch[REF_LOGPROBS].to(logprobs.dtype)
        slots = batch.get(DPO_SLOT)
        s_c, s_r, n_c, n_r = pair_sequence_logprobs(logprobs, mask, slots)
        with torch.no_grad():
            ref_c, ref_r, _, _ = pair_sequence_logprobs(ref, mask, slots)
        chosen_lr, rejected_lr = s_c - ref_c, s_r - ref_r
        per_pair = preference_loss(chosen_lr, rejected_lr, self.loss_type, self.beta, self.label_smoothing, n_c, n_r)
        pref = per_pair.mean()
        loss = pref
        metrics: dict[str, float] = {"dpo/loss": float(pref.detach())}
        if self.sft_coef:
            chosen_tokens = n_c.sum().clamp(min=1.0)
            nll = -s_c.sum() / chosen_tokens  # token mean over every chosen completion of the batch
            loss = loss + self.sft_coef * nll
            metrics["sft/nll"] = float(nll.detach())
        with torch.no_grad():
            r_c, r_r = self.beta * chosen_lr.detach(), self.beta * rejected_lr.detach()
            metrics.update(
                {
                    "rewards/chosen": float(r_c.mean()),
                    "rewards/rejected": float(r_r.mean()),
                    "rewards/margins": float((r_c - r_r).mean()),
                    "rewards/accuracies": float((r_c > r_r).float().mean()),
                    "logps/chosen": float(s_c.detach().mean()),
                    "logps/rejected": float(s_r.detach().mean()),
                }
            )
        return LossOutput(loss=loss, metrics=metrics)
