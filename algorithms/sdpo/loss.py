"""The SDPO objective: self-distillation from a feedback-conditioned teacher, blended with the
GRPO policy loss.

Per step (TRL 1.16's ``SDPOTrainer.compute_loss``; ``w`` = ``distillation_weight``)::

    loss = (1 - w) * policy_loss + w * distillation_loss

``w = 1`` computes the distillation part only and ``w = 0`` the policy part only (as TRL, so
neither pays for the other). ``policy_loss`` is the stage's policy loss (``grpo`` by default:
PPO-clip with TRL's ``loss_type`` aggregations, :class:`~tempering.algorithms.grpo.loss.GRPOLoss`)
on every trainable token.

``distillation_loss`` runs over the *distillation mask* ``m`` (``batch["distill_weights"]``):
the sampled tokens of the samples whose teacher had something to say (a sibling's solution,
feedback); 0 elsewhere. Per token ``l_t`` (``mode``):

* ``sampled_token`` (default; alpha must be 1): ``sg(lp_t - lp_teacher_t) * lp_t`` -- the
  reverse KL's policy gradient through the sampled token
  (:func:`tempering.rlmath.divergence.sampled_token_loss`); needs only the teacher's logprob of
  each sampled token (``batch["teacher_token_logprobs"]``);
* ``full_logits``: ``D_alpha(student || teacher)`` over the vocabulary;
* ``topk_logits``: ``D_alpha`` on a top-``topk`` support -- the student's top-k with the
  teacher's full distribution gathered there (``topk_support: student``, TRL's local path) or
  the teacher's own top-k (``teacher``, TRL's server path; all a service returns) -- either
  renormalised on the support or with one tail bucket for the rest (``add_tail``).

``D_alpha`` is forward KL at alpha 0, reverse KL at 1 and the generalised JSD between
(:mod:`tempering.rlmath.divergence`, the same functions SDFT uses). With ``is_clip`` (TRL's
``distillation_is_clip``, default 2) each ``l_t`` is multiplied by ``min(exp(lp_t - old_t),
is_clip)``, detached, where ``old`` are the batch's ``sampler_logprobs``: a correction for
tokens sampled by older weights (1 on-policy; skipped when the batch has no old logprobs).
``is_clip_low`` (ours, for stale rollouts; off by default) adds a floor: the weight is
``clamp(exp(lp_t - old_t), is_clip_low, is_clip)``, two-sided
(:func:`tempering.rlmath.ratios.clipped_is_weight`).
The aggregation is TRL's: each row's mean over its masked tokens, then the mean over *all*
``B`` rows -- a row without a teacher counts as 0, so a batch where few samples have a teacher
takes a proportionally smaller distillation step. A batch where none has one gives a zero
distillation loss (and zero gradient), never NaN.

Metrics: ``sdpo/distill_loss`` (token mean of ``l_t`` over the mask, TRL's logged value),
``sdpo/policy_loss``, ``sdpo/teacher_kl`` (token mean of ``lp - lp_teacher`` on the sampled
tokens under the mask: a one-sample estimate of KL(student || teacher)), ``sdpo/is_clip_frac``
(share of masked tokens whose ratio exceeded ``is_clip`` or fell below ``is_clip_low``), plus the
policy loss's own metrics.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

import tempering.loss_contract as loss_contract
from tempering.interfaces import LossOutput
from tempering.loss_contract import (
    DISTILL_WEIGHTS,
    LOGITS,
    SAMPLER_LOGPROBS,
    TEACHER_TOKEN_LOGPROBS,
    WEIGHTS,
    BuiltinLoss,
    NoBuiltin,
    builtin_of,
    loss_reads,
)
from tempering.rlmath.aggregation import aggregate_mean
from tempering.rlmath.divergence import sampled_token_loss
from tempering.rlmath.masks import active, masked
from tempering.rlmath.ratios import clipped_is_weight
from tempering.training.teacher import TEACHER_INPUT_KEYS, TeacherNeeds, teacher_divergence
from tempering.types import Batch

__all__ = ["MODES", "SUPPORTS", "SDPOLoss", "distillation_problem", "teacher_input"]

MODES = ("sampled_token", "full_logits", "topk_logits")
SUPPORTS = ("student", "teacher")


def distillation_problem(
    mode: str,
    alpha: float,
    topk: int | None,
    support: str,
    is_clip: float | None,
    weight: float,
    is_clip_low: float | None = None,
) -> tuple[str, str] | None:
    """The first bad distillation setting as ``(key of the distillation: block, one-line message)``, or None.

    One rule set for the stage's validation (a :class:`~tempering.errors.ConfigError` at the
    key's path) and for :class:`SDPOLoss` built by hand (a ``ValueError``)."""
    if mode not in MODES:
        return "mode", f"unknown mode '{mode}'; use one of {', '.join(MODES)}"
    if not 0.0 <= alpha <= 1.0:
        return "alpha", f"must be in [0, 1] (0 forward KL, 1 reverse KL, JSD between), got {alpha}"
    if mode == "sampled_token" and alpha != 1.0:
        return "alpha", (
            f"must be 1 with mode 'sampled_token' (a sampled token estimates "
            f"the reverse KL only), got {alpha}; use full_logits or topk_logits for other alphas"
        )
    if mode == "topk_logits" and topk is None:
        return (
            "topk",
            "mode 'topk_logits' needs topk (the support size, e.g. 100)",
        )
    if topk is not None and mode != "topk_logits":
        return "topk", f"is only read by mode 'topk_logits' (the mode is '{mode}'); remove it"
    if topk is not None and topk < 1:
        return "topk", f"must be >= 1, got {topk}"
    if support not in SUPPORTS:
        return "topk_support", f"use one of {', '.join(SUPPORTS)} (got '{support}')"
    if is_clip is not None and is_clip <= 0:
        return "is_clip", f"must be > 0 (or null: off), got {is_clip}"
    if is_clip_low is not None and is_clip is None:
        return (
            "is_clip_low",
            "is a floor of the is_clip weight, which is off (null); set both",
        )
    if is_clip_low is not None and not 0 < is_clip_low <= min(1.0, is_clip or 1.0):
        return "is_clip_low", (
            f"must be in (0, {min(1.0, is_clip or 1.0):g}] (at most 1 and at most is_clip), got {is_clip_low}"
        )
    if not 0.0 <= weight <= 1.0:
        return "weight", f"must be in [0, 1] (1 distillation only, 0 policy gradient only), got {weight}"
    return None


def teacher_input(mode: str, support: str, weight: float) -> str | None:
    """What the teacher must provide for these settings: ``token`` logprobs (``sampled_token``),
    ``topk`` (its own top-k: ``topk_logits`` on the teacher's support) or ``full``
    distributions; None when nothing is distilled (``weight`` 0). One rule for the loss and
    for the stage, which asks it before the loss exists (validation)."""
    if weight == 0:
        return None
    if mode == "sampled_token":
        return "token"
    return "topk" if mode == "topk_logits" and support == "teacher" else "full"


@dataclass
class DistillationSettings:
    """What the distillation part of the loss is, and how much of the loss it is: the fields of
    the ``distillation:`` block the loss reads (TRL's ``distillation_*`` keys without the
    prefix), declared once for the block and the loss."""

    mode: str = "sampled_token"
    alpha: float = 1.0
    topk: int | None = None
    topk_support: str = "student"
    add_tail: bool = False
    is_clip: float | None = 2.0
    is_clip_low: float | None = None
    weight: float = 1.0


@dataclass
class SDPOLoss(DistillationSettings):
    """``(1 - weight) * policy + weight * distillation`` (see the module docstring).

    ``policy`` is the policy-gradient loss (a :class:`~tempering.interfaces.Loss`, e.g.
    ``GRPOLoss()``; may be None when ``weight`` is 1). The other fields are the
    :class:`DistillationSettings`.

    Reads ``weights``, ``advantages`` and ``sampler_logprobs`` (policy part; the latter also
    for ``is_clip``), ``distill_weights`` (the distillation mask), ``teacher_token_logprobs``
    (``sampled_token``; every mode for ``sdpo/teacher_kl``), ``logits`` and ``teacher_logits``
    or ``teacher_topk_logprobs`` / ``teacher_topk_ids`` (logit modes)."""

    policy: Any = None

    def __post_init__(self) -> None:
        problem = distillation_problem(
            self.mode, self.alpha, self.topk, self.topk_support, self.is_clip, self.weight, self.is_clip_low
        )
        if problem is not None:
            raise ValueError(f"SDPOLoss {problem[0]}: {problem[1]}")
        if self.policy is None and self.weight < 1.0:
            raise ValueError(f"SDPOLoss: weight {self.weight} < 1 blends in a policy loss; pass policy=")

    @property
    def needs_logits(self) -> bool:
        """The logit modes need the student's logits (and the policy loss, if it does)."""
        distill = self.weight > 0 and self.mode != "sampled_token"
        return distill or (self.weight < 1 and loss_contract.needs_logits(self.policy))

    @property
    def teacher_input(self) -> str | None:
        """What the teacher must provide (:func:`teacher_input`)."""
        return teacher_input(self.mode, self.topk_support, self.weight)

    @property
    def teacher_needs(self) -> TeacherNeeds:
        """What the stage must score with the teacher (:class:`tempering.training.teacher.DistillationLoss`):
        the teacher input (token logprobs when nothing is distilled: the stage scores none then)
        and the top-k size."""
        return TeacherNeeds(self.teacher_input or "token", int(self.topk or 0))

    @property
    def reads(self) -> frozenset[str]:
        """The batch inputs it requires (the loss contract): the policy loss's (when it is
        blended in, ``weight < 1``), and for the distillation part (``weight > 0``) the
        distillation mask and the teacher's values of the mode (:data:`TEACHER_INPUT_KEYS`:
        its token logprobs always, plus its top-k or full distributions and the backend's
        logits for the logit modes). The sampler's logprobs are optional here (``is_clip``
        uses them when present)."""
        reads = {WEIGHTS}
        if self.weight < 1.0:
            reads |= loss_reads(self.policy) or frozenset()
        kind = self.teacher_input
        if kind is not None:
            reads |= {DISTILL_WEIGHTS} | TEACHER_INPUT_KEYS[kind] | ({LOGITS} if kind != "token" else set())
        return frozenset(reads)

    @property
    def tinker_builtin(self) -> str | None:
        """The static form of :meth:`builtin`: the policy loss's with ``weight`` 0, else none."""
        return loss_contract.builtin_name(self.policy) if self.weight == 0.0 else None

    def builtin(self, batch: Batch) -> BuiltinLoss | NoBuiltin:
        """Backend-neutrally (the loss contract): with ``weight`` 0 the loss *is* its policy
        loss, so whatever computes that computes this; otherwise no built-in computes the
        distillation part (``sg(lp - lp_teacher) * lp`` over a mask of its own, or a divergence
        over the logits), so it runs as a custom loss (Tinker: ``forward_backward_custom``)."""
        if self.weight == 0.0:
            return builtin_of(self.policy, batch)
        if self.mode == "sampled_token":
            return NoBuiltin(
                "SDPOLoss: no built-in computes the self-distillation term sg(lp - lp_teacher) * lp "
                "blended with the policy loss"
            )
        return NoBuiltin("Use distillation.mode: sampled_token for SDPO on Tinker.")

    def distillation(
        self, logprobs: torch.Tensor, batch: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The distillation loss (seq-mean over all rows) and its metrics."""
        mask = batch[DISTILL_WEIGHTS] if DISTILL_WEIGHTS in batch else torch.zeros_like(logprobs)
        on = active(mask)
        if not bool(on.any()):  # no teacher anywhere: a zero that keeps the graph (zero gradients)
            return masked(logprobs, batch[WEIGHTS]).sum() * 0.0, {"sdpo/distill_loss": 0.0}
        if self.mode == "sampled_token":
            teacher = batch[TEACHER_TOKEN_LOGPROBS].to(logprobs.dtype)
            per_token = sampled_token_loss(logprobs, torch.where(on, teacher, logprobs.detach()))
        else:
            per_token = teacher_divergence(
                logprobs, batch, self.mode, float(self.alpha), int(self.topk or 0), self.add_tail, self.topk_support
            )
        metrics: dict[str, float] = {}
        if self.is_clip is not None and SAMPLER_LOGPROBS in batch:
            # selected, not multiplied, at masked positions: they may hold anything (NaN padding),
            # and 0 * NaN in a product is NaN in the gradient (rlmath's convention, masks.py)
            old = torch.where(on, batch[SAMPLER_LOGPROBS].to(logprobs.dtype), logprobs.detach())
            per_token = per_token * clipped_is_weight(logprobs, old, self.is_clip_low, self.is_clip)
            with torch.no_grad():
                ratio = (logprobs - old).clamp(-20.0, 20.0).exp()
                clipped = (ratio > self.is_clip) | (ratio < (self.is_clip_low or 0.0))
                metrics["sdpo/is_clip_frac"] = float(clipped[on].float().mean())
        loss = aggregate_mean(per_token, mask, "seq_mean")
        with torch.no_grad():
            metrics["sdpo/distill_loss"] = float(per_token[on].mean())
            teacher_lp = batch.get(TEACHER_TOKEN_LOGPROBS)
            if teacher_lp is not None:
                diff = (logprobs - teacher_lp.to(logprobs.dtype))[on]
                diff = diff[torch.isfinite(diff)]  # a token outside the teacher's top-k has no value
                if diff.numel():
                    metrics["sdpo/teacher_kl"] = float(diff.mean())
        return loss, metrics

    def __call__(self, logprobs: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> LossOutput:
        metrics: dict[str, float] = {}
        policy_loss = distill_loss = None
        if self.weight < 1.0:
            policy = self.policy(logprobs, batch)
            policy_loss = policy.loss
            metrics.update(policy.metrics)
            metrics["sdpo/policy_loss"] = float(policy_loss.detach())
        if self.weight > 0.0:
            distill_loss, distill_metrics = self.distillation(logprobs, batch)
            metrics.update(distill_metrics)
        if distill_loss is None:
            loss = policy_loss
        elif policy_loss is None:
            loss = distill_loss
        else:
            loss = (1.0 - self.weight) * policy_loss + self.weight * distill_loss
        assert loss is not None
        return LossOutput(loss, metrics)
