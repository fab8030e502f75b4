"""The direct-loss variant of on-policy distillation: the reverse KL over whole distributions.

With the teacher's next-token distributions at every position of the student's own samples
(the ``top_k`` and ``full`` estimators of the ``kl:`` block), the per-token reverse KL need not
be estimated from the sampled token: it is computed over the vocabulary (or the teacher's top-k
plus one tail bucket) and minimised directly,

    L = coef * mean_{(b, t) in mask} KL(p_student(. | x_<t) || p_teacher(. | x_<t)),

the mean over the batch's loss tokens (``token_mean``, TRL's GKD ``batchmean`` over labelled
tokens) or per sequence first (``seq_mean``). This is TRL's ``GKDTrainer.generalized_jsd_loss``
with ``beta = 1`` (reverse KL) on on-policy samples (``lmbda = 1``) at temperature 1, which
``tests/test_distill.py`` checks to 1e-6. The divergence itself is
:mod:`tempering.rlmath.divergence`'s; reading the teacher's values out of the batch is
:func:`tempering.training.teacher.teacher_divergence`, shared with SDFT and SDPO.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from tempering.interfaces import LossOutput
from tempering.loss_contract import (
    LOGITS,
    TEACHER_LOGITS,
    TEACHER_TOPK_IDS,
    TEACHER_TOPK_LOGPROBS,
    WEIGHTS,
    NoBuiltin,
)
from tempering.rlmath.aggregation import aggregate_mean
from tempering.rlmath.masks import active
from tempering.training.teacher import TeacherNeeds, teacher_divergence
from tempering.types import Batch

#: The ``kl.estimator`` that are losses of their own, and the divergence mode each computes.
LOGIT_MODES = {"full": "full_logits", "top_k": "topk_logits"}


@dataclass
class ReverseKLLoss:
    """``coef`` x the reverse KL(student || teacher) per loss token, over the full vocabulary
    (``estimator: full``) or the teacher's ``top_k`` tokens (plus a tail bucket holding the
    rest of each distribution's mass when ``add_tail``), aggregated by ``aggregation``
    (``token_mean`` or ``seq_mean``). Reads the model's logits and the teacher's distributions
    the distill stage put in the batch."""

    estimator: str = "full"
    top_k: int = 20
    add_tail: bool = True
    coef: float = 1.0
    aggregation: str = "token_mean"

    needs_logits: ClassVar[bool] = True
    tinker_builtin: ClassVar[str | None] = None

    def __post_init__(self) -> None:
        if self.estimator not in LOGIT_MODES:
            raise ValueError(f"ReverseKLLoss.estimator must be one of {tuple(LOGIT_MODES)}, got {self.estimator!r}")

    @property
    def teacher_needs(self) -> TeacherNeeds:
        """What the stage must score with the teacher: its full distributions, or its top-k."""
        return TeacherNeeds("full" if self.estimator == "full" else "topk", int(self.top_k), self.aggregation)

    @property
    def reads(self) -> frozenset[str]:
        """The batch inputs it requires (the loss contract)."""
        if self.estimator == "full":
            return frozenset({WEIGHTS, LOGITS, TEACHER_LOGITS})
        return frozenset({WEIGHTS, LOGITS, TEACHER_TOPK_LOGPROBS, TEACHER_TOPK_IDS})

    def builtin(self, batch: Batch) -> NoBuiltin:
        """No built-in loss computes a divergence over the model's logits."""
        return NoBuiltin("a reverse KL over distributions needs the logits; use kl.estimator: sampled on Tinker")

    def per_token(self, logprobs: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The ``(B, T)`` reverse KL at each position (0 where no logits were computed)."""
        return teacher_divergence(
            logprobs, batch, LOGIT_MODES[self.estimator], 1.0, self.top_k, self.add_tail, "teacher"
        )

    def __call__(self, logprobs: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> LossOutput:
        for key in self.reads:
            if key not in batch:
                raise KeyError(f"ReverseKLLoss ({self.estimator}) needs batch[{key!r}]; the batch has {sorted(batch)}")
        mask = batch[WEIGHTS]
        per_token = self.per_token(logprobs, batch)
        loss = self.coef * aggregate_mean(per_token, mask, self.aggregation)
        is_active = active(mask)
        with torch.no_grad():
            mean = per_token[is_active].mean() if is_active.any() else per_token.new_zeros(())
        return LossOutput(loss, {f"distill/kl_{self.estimator}": float(mean)})
