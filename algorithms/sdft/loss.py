"""SDFT losses: per-token divergences between the student and a demonstration-conditioned teacher.

Everything is over *target* positions ``(B, T)`` as :meth:`tempering.types.Batch.to_tensors` pads
them (the SDFT stage aligns the teacher's positions with the student's, see
:mod:`tempering.algorithms.sdft.algorithm`). ``batch["weights"]`` is the loss mask (non-zero on
completion tokens that count; the stage zeroes the first ``skip_first_tokens``).

Divergence ``D_alpha(S, T)`` between the student's and the teacher's next-token distributions:
forward KL (``alpha = 0``), reverse KL (``alpha = 1``) or the generalised Jensen-Shannon
divergence between, TRL 1.16's convention; the functions are :mod:`tempering.rlmath.divergence`'s
(shared with the next distillation algorithms), re-exported here.

Modes (``mode``):

* ``full_logits``: ``D_alpha`` over the whole vocabulary; needs the student's logits
  (``batch["logits"]``, ``(B, T, V)``) and the teacher's (``batch["teacher_logits"]``, any
  logits or log-probabilities; they are log-softmaxed here).
* ``topk_logits``: ``D_alpha`` on a ``topk`` support. ``topk_support: student`` (TRL's choice)
  takes the student's top-k token ids and gathers the teacher there (needs the full
  ``teacher_logits``); ``teacher`` uses the teacher's top-k, given as
  ``batch["teacher_topk_logprobs"]`` and ``batch["teacher_topk_ids"]`` (``(B, T, K)``: what a
  server or Tinker can return). ``add_tail: false`` renormalises both distributions on the
  support; ``true`` appends one bucket holding the leftover mass ``1 - sum``.
* ``sampled_token``: the sampled-token reverse-KL estimate used as an advantage, exactly
  Tinker's ``importance_sampling`` loss: ``-sum_t exp(lp_t - q_t) * A_t`` with ``q`` the
  sampler's logprobs (``batch["sampler_logprobs"]``) and ``A_t = -(q_t - lp_teacher_t)`` times
  the aggregation normaliser, which the stage folds into ``batch["advantages"]`` (Tinker's
  losses sum over tokens). On-policy its gradient is TRL's ``sampled_token`` gradient,
  ``(lp - lp_teacher) * grad lp`` per token; only ``alpha = 1`` is meaningful.

Aggregation of the per-token loss ``l`` for the logit modes (``aggregation``): ``seq_mean``
(TRL: per-sequence mean over its loss tokens, then mean over the ``B`` rows) or
``token_mean`` (over all loss tokens of the batch). ``is_clip`` (TRL's
``distillation_is_clip``) multiplies each token's loss by the detached, clipped ratio
``min(exp(lp - q), is_clip)`` -- a correction for off-policy samples, 1 on-policy.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from tempering.interfaces import LossOutput
from tempering.loss_contract import (
    ADVANTAGES,
    LOGITS,
    SAMPLER_LOGPROBS,
    TEACHER_LOGITS,
    TEACHER_TOKEN_LOGPROBS,
    TEACHER_TOPK_IDS,
    TEACHER_TOPK_LOGPROBS,
    WEIGHTS,
    BuiltinLoss,
    NoBuiltin,
)
from tempering.rlmath import policy_loss
from tempering.rlmath.aggregation import MEAN_AGGREGATIONS, fold_normaliser
from tempering.rlmath.aggregation import aggregate_mean as aggregate
from tempering.rlmath.divergence import add_tail_bucket, divergence, full_logits_loss, topk_logits_loss
from tempering.rlmath.masks import active
from tempering.rlmath.ratios import capped_is_weight, log_importance_weights
from tempering.schema import Problem, one_of, raise_problems
from tempering.training.teacher import TeacherNeeds, teacher_divergence
from tempering.types import Batch

# add_tail_bucket, aggregate (tempering.rlmath.aggregation.aggregate_mean), divergence,
# fold_normaliser, full_logits_loss and topk_logits_loss are re-exports from tempering.rlmath,
# kept so that existing imports (tests, third-party plugins) keep working.
__all__ = [
    "AGGREGATIONS",
    "ImportanceSamplingLoss",
    "MODES",
    "SDFTLoss",
    "add_tail_bucket",
    "aggregate",
    "divergence",
    "fold_normaliser",
    "full_logits_loss",
    "importance_sampling_loss",
    "topk_logits_loss",
]

MODES = ("sampled_token", "topk_logits", "full_logits")
AGGREGATIONS = tuple(MEAN_AGGREGATIONS)
SUPPORTS = ("student", "teacher")


def default_alpha(mode: str) -> float:
    """``alpha: null``: 1 (reverse KL, the only valid value) for ``sampled_token``, else 0.5 (JSD)."""
    return 1.0 if mode == "sampled_token" else 0.5


def importance_sampling_loss(
    logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Tinker's ``importance_sampling``: ``-sum(exp(lp - q) * A)`` over the positions where
    ``mask`` is non-zero (elsewhere the ratio is never evaluated). On logprobs, for this
    module's callers; the formula is :func:`tempering.rlmath.policy_loss.importance_sampling_loss`."""
    ratio = torch.exp(log_importance_weights(logprobs, sampler_logprobs, mask))
    return policy_loss.importance_sampling_loss(ratio, advantages, mask)


@dataclass
class ImportanceSamplingLoss:
    """``-sum(exp(lp - q) * A)``: Tinker's built-in ``importance_sampling`` (a sum over tokens;
    fold any normaliser into the advantages). Reads ``weights`` (mask), ``sampler_logprobs``
    and ``advantages``."""

    needs_logits: ClassVar[bool] = False
    tinker_builtin: ClassVar[str | None] = "importance_sampling"
    reads: ClassVar[frozenset[str]] = frozenset({WEIGHTS, SAMPLER_LOGPROBS, ADVANTAGES})  # the loss contract

    def __call__(self, logprobs: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> LossOutput:
        for key in (WEIGHTS, SAMPLER_LOGPROBS, ADVANTAGES):
            if key not in batch:
                raise KeyError(f"importance_sampling needs batch[{key!r}]; the batch has {sorted(batch)}")
        mask = batch[WEIGHTS]
        q = batch[SAMPLER_LOGPROBS].to(logprobs.dtype)
        loss = importance_sampling_loss(logprobs, q, batch[ADVANTAGES].to(logprobs.dtype), mask)
        ratio = torch.exp((logprobs - q)[active(mask)].detach())
        metrics = {"ratio/mean": float(ratio.mean()) if ratio.numel() else 1.0}
        return LossOutput(loss, metrics)


@dataclass
class SDFTLoss:
    """The SDFT distillation loss (see the module docstring).

    Config keys: ``mode`` (``topk_logits`` default, ``full_logits``, ``sampled_token``),
    ``alpha`` (divergence direction; default 0.5 for the logit modes, and 1 -- the only valid
    value -- for ``sampled_token``), ``topk`` (support size, 100), ``topk_support``
    (``student`` or ``teacher``), ``add_tail`` (False), ``aggregation`` (``seq_mean`` or
    ``token_mean``), ``is_clip`` (None = off; TRL's ``distillation_is_clip``).
    """

    mode: str = "topk_logits"
    alpha: float | None = None
    topk: int = 100
    topk_support: str = "student"
    add_tail: bool = False
    aggregation: str = "seq_mean"
    is_clip: float | None = None

    @staticmethod
    def check_config(config: Mapping[str, Any]) -> Iterator[Problem | None]:
        """The values that cannot work, at their keys (the loss's schema check,
        :mod:`tempering.schema`: the registry runs it before building, ``__post_init__`` too).
        ``alpha: null`` is the mode's default."""
        mode, support, aggregation, is_clip = (
            config["mode"],
            config["topk_support"],
            config["aggregation"],
            config["is_clip"],
        )
        bad_mode = one_of("mode", mode, MODES, f"SDFTLoss.mode must be one of {MODES}, got {mode!r}")
        if bad_mode is not None:
            yield bad_mode
            return
        alpha = default_alpha(mode) if config["alpha"] is None else config["alpha"]
        if not 0.0 <= alpha <= 1.0:
            yield Problem("alpha", f"SDFTLoss.alpha must be in [0, 1], got {alpha}")
        elif mode == "sampled_token" and alpha != 1.0:
            yield Problem(
                "alpha",
                "SDFTLoss: mode 'sampled_token' estimates the reverse KL from sampled tokens only, so "
                f"alpha must be 1 (got {alpha}); use topk_logits or full_logits for forward KL / JSD",
            )
        if config["topk"] < 1:
            yield Problem("topk", f"SDFTLoss.topk must be >= 1, got {config['topk']}")
        yield one_of(
            "topk_support", support, SUPPORTS, f"SDFTLoss.topk_support must be one of {SUPPORTS}, got {support!r}"
        )
        yield one_of(
            "aggregation",
            aggregation,
            AGGREGATIONS,
            f"SDFTLoss.aggregation must be one of {AGGREGATIONS}, got {aggregation!r}",
        )
        if is_clip is not None and is_clip <= 0:
            yield Problem("is_clip", f"SDFTLoss.is_clip must be > 0 (or null), got {is_clip}")

    def __post_init__(self) -> None:
        raise_problems(self)
        if self.alpha is None:
            self.alpha = default_alpha(self.mode)

    @property
    def needs_logits(self) -> bool:
        return self.mode != "sampled_token"

    @property
    def tinker_builtin(self) -> str | None:
        return "importance_sampling" if self.mode == "sampled_token" else None

    @property
    def teacher_input(self) -> str:
        """What the stage must put in the batch: ``token`` logprobs, ``topk`` or ``full`` logits."""
        if self.mode == "sampled_token":
            return "token"
        if self.mode == "topk_logits" and self.topk_support == "teacher":
            return "topk"
        return "full"

    @property
    def teacher_needs(self) -> TeacherNeeds:
        """What the SDFT stage must score with the teacher for this loss
        (:class:`tempering.training.teacher.DistillationLoss`): the teacher input, its top-k size and the
        normaliser folded into the sampled-token advantages."""
        return TeacherNeeds(self.teacher_input, int(self.topk), self.aggregation)

    @property
    def reads(self) -> frozenset[str]:
        """The batch inputs it requires (the loss contract): the sampled-token mode is
        ``importance_sampling`` on the teacher's advantages; the logit modes read the teacher's
        top-k (teacher support) or full distributions, and the backend's logits. The sampler's
        logprobs are optional there (``is_clip`` uses them when present)."""
        if self.mode == "sampled_token":
            return ImportanceSamplingLoss.reads
        if self.teacher_input == "topk":
            return frozenset({WEIGHTS, LOGITS, TEACHER_TOPK_LOGPROBS, TEACHER_TOPK_IDS})
        return frozenset({WEIGHTS, LOGITS, TEACHER_LOGITS})

    def builtin(self, batch: Batch) -> BuiltinLoss | NoBuiltin:
        """Backend-neutrally (the loss contract): the sampled-token mode is exactly the
        built-in ``importance_sampling`` (the stage folds the normaliser into the advantages);
        the logit modes are divergences over the model's logits, which no built-in computes."""
        if self.mode == "sampled_token":
            return BuiltinLoss(
                "importance_sampling",
                None,
                note="SDFTLoss (mode 'sampled_token') as the built-in "
                "importance_sampling (the normaliser is folded into the teacher's advantages)",
            )
        return NoBuiltin("Use mode: sampled_token (Tinker's importance_sampling) for SDFT on Tinker.")

    def per_token(self, logprobs: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The ``(B, T)`` per-token divergence of the logit modes, before masking: computed at
        the positions ``batch["logits"]`` covers (``logit_positions``), 0 elsewhere
        (:func:`tempering.training.teacher.teacher_divergence`, shared with SDPO)."""
        # __post_init__ sets alpha; null (the mode's default) can only come back by assignment
        alpha = default_alpha(self.mode) if self.alpha is None else float(self.alpha)
        return teacher_divergence(logprobs, batch, self.mode, alpha, self.topk, self.add_tail, self.topk_support)

    def __call__(self, logprobs: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> LossOutput:
        mask = batch[WEIGHTS]
        is_active = active(mask)
        if self.mode == "sampled_token":
            out = ImportanceSamplingLoss()(logprobs, batch)
            teacher = batch.get(TEACHER_TOKEN_LOGPROBS)
            if teacher is not None and is_active.any():
                q = batch[SAMPLER_LOGPROBS]
                out.metrics["sdft/distill_loss"] = float((q - teacher)[is_active].mean())
            return out
        needed = (
            [LOGITS, TEACHER_TOPK_LOGPROBS, TEACHER_TOPK_IDS]
            if self.teacher_input == "topk"
            else [LOGITS, TEACHER_LOGITS]
        )
        for key in needed:
            if key not in batch:
                raise KeyError(f"SDFTLoss (mode {self.mode}) needs batch[{key!r}]; the batch has {sorted(batch)}")
        per_token = self.per_token(logprobs, batch)
        if self.is_clip is not None and SAMPLER_LOGPROBS in batch:
            per_token = per_token * capped_is_weight(logprobs, batch[SAMPLER_LOGPROBS].to(logprobs.dtype), self.is_clip)
        loss = aggregate(per_token, mask, self.aggregation)
        with torch.no_grad():
            mean = per_token[is_active].mean() if is_active.any() else per_token.new_zeros(())
        return LossOutput(loss, {"sdft/distill_loss": float(mean)})
