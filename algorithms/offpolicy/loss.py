"""Off-policy policy-gradient losses with corrected (clipped / truncated) importance ratios.

The registered losses here (``ppo``, ``cispo``, ``tis``, ``clipped_is``) read the batch and call
the pure functions of :mod:`tempering.rlmath.policy_loss` (the formulas, written once, shared
with the Tinker backend's built-ins); what stays here is the losses' own: their knobs and Tinker
names. The corrections around them (the sampler-matched objective, the advantage cap, the folded
normaliser) are the stale-rollout component's, :mod:`tempering.training.stale`.

Layout as in :mod:`tempering.algorithms.grpo.loss`: ``logprobs`` and every per-position tensor
are ``(B, T)`` over target positions; ``batch["weights"]`` is the loss mask (non-zero on the
completion tokens that count), ``batch["sampler_logprobs"]`` the behaviour policy's logprobs
``q`` and ``batch["advantages"]`` per-token advantages ``A``. The ratio is
``rho = exp(lp_theta - q)``, per token, or with ``level="sequence"`` one per sequence
(``exp`` of the masked mean log-ratio, GSPO's length-normalised form) broadcast to its tokens.

Every loss is a **sum over tokens**, exactly as Tinker's built-in losses compute it, so any
normaliser (token mean, sequence mean) must be folded into ``advantages`` before the call (the
stale-rollout component does it: :func:`~tempering.rlmath.aggregation.fold_normaliser`). With
``level="token"`` each loss names the Tinker built-in that computes the same value and gradient
(``tinker_builtin``) and the ``loss_fn_config`` to send (``tinker_loss_fn_config``):

=============== ================================================================ ==================
name            per-token loss (summed over mask)                                Tinker built-in
=============== ================================================================ ==================
``ppo``         ``-min(rho*A, clip(rho, low, high)*A)``; low/high 0.8/1.2         ``ppo``
``cispo``       ``-sg(clip(rho, low, high)) * A * lp``; low/high 0.0/4.0          ``cispo``
``tis``         ``-sg(min(rho, C)) * A * lp`` (truncated IS, Yao et al.; C=2)     ``cispo`` {0, C}
``clipped_is``  ``ppo``'s formula, 0.8/1.2, on advantages capped at 3x running    ``ppo`` (capped A)
                mean ``|A|``
=============== ================================================================ ==================

``importance_sampling`` (``-rho*A``, unclipped) is registered by ``tempering.algorithms.sdft``
(:func:`~tempering.rlmath.policy_loss.importance_sampling_loss` is its formula).
Tinker's definitions (docs ``tinker/losses``, pages importance-sampling, ppo, cispo):
``prob_ratio = exp(target_logprobs - sampling_logprobs)``; importance_sampling
``loss = -(prob_ratio * advantages).sum()``; ppo ``clipped_ratio = clamp(prob_ratio,
clip_low_threshold, clip_high_threshold)``, ``loss = -min(prob_ratio * A, clipped_ratio *
A).sum()``; cispo ``loss = -(clamp(prob_ratio, low, high).detach() * target_logprobs *
A).sum()`` with default thresholds ``{0.0, 4.0}``.

``sg`` is stop-gradient: the coefficient losses (cispo, tis) have gradient ``w * A * grad(lp)``
with ``w`` the clipped ratio, which never vanishes (unlike PPO's clip, whose gradient is 0 once
the ratio has left the trust region in the direction ``A`` pushes); their *value* is not an
estimate of the objective (it is ``lp``-weighted), only their gradient is.

``clipped_is`` is the "clipped importance ratios and capped advantages" recipe for stale
rollouts: the ratio clipped to ``[clip_low_threshold, clip_high_threshold]`` (+-0.2) inside
PPO's pessimistic ``min`` (a trust region around the *sampler's* policy, so a stale batch
cannot drag the policy further than the clip allows), on advantages whose per-token ``|A|`` is
capped at ``advantage_cap`` times its running mean. Every loss here has the ``advantage_cap``
and ``advantage_cap_momentum`` knobs (off except for ``clipped_is``); the stage applies the cap
(:class:`~tempering.rlmath.advantage_cap.AdvantageCap`) before the call, so on Tinker the loss is
still the built-in ``ppo``.
Measured on the arithmetic task at staleness 3 (docs/offpolicy.md), the coefficient forms
(``cispo``, ``tis``, and the clipped ratio used as a coefficient) drift at a high learning rate
while the PPO-style ``min`` does not: a coefficient's gradient never switches off, so nothing
stops a stale batch from pushing the policy ever further from the policy that sampled it.

Metrics (python floats; over loss tokens): ``ratio/mean``, ``ratio/max``, ``ratio/min`` of the
raw ``rho``; ``ratio/clipped_frac``, the share of tokens whose ratio the loss clipped
(truncated, or outside PPO's region with the sign of ``A`` that makes the clip bind);
``is/ess`` = ``(sum w)^2 / (n * sum w^2)`` over the raw per-token ratios (1 = on-policy, -> 1/n
when one token dominates) and ``is/ess_seq`` the same over per-sequence weights
``exp(sum_t log rho_t)``; ``is/kl`` = mean ``rho - 1 - log rho``, the k3 estimate of
``KL(q || pi_theta)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from tempering.interfaces import LossOutput
from tempering.loss_contract import ADVANTAGES, SAMPLER_LOGPROBS, WEIGHTS
from tempering.rlmath.diagnostics import ratio_stats
from tempering.rlmath.policy_loss import cispo_loss, ppo_loss, tis_loss
from tempering.rlmath.ratios import IS_LEVELS, log_importance_weights

__all__ = ["LEVELS", "CISPOLoss", "ClippedISLoss", "PPOLoss", "TISLoss"]

LEVELS = IS_LEVELS


# --------------------------------------------------------------------------- registered losses
@dataclass
class _RatioLoss:
    """Shared plumbing: reads the batch, builds the ratio, adds diagnostics.

    ``level``: ``token`` ratios or one ``sequence`` ratio (masked-mean log-ratio, GSPO).
    ``advantage_cap`` (multiple of the running mean ``|A|``, null = off) and
    ``advantage_cap_momentum`` are read by the stage, which caps the advantages before the
    call (:class:`~tempering.rlmath.advantage_cap.AdvantageCap`)."""

    level: str = "token"
    advantage_cap: float | None = None
    advantage_cap_momentum: float = 0.9

    needs_logits: ClassVar[bool] = False
    sums_over_tokens: ClassVar[bool] = True  # the normaliser is folded into the advantages
    reads: ClassVar[frozenset[str]] = frozenset({WEIGHTS, SAMPLER_LOGPROBS, ADVANTAGES})  # the loss contract
    _builtin: ClassVar[str] = ""

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"{type(self).__name__}.level must be one of {LEVELS}, got {self.level!r}")
        if self.advantage_cap is not None and self.advantage_cap <= 0:
            raise ValueError(f"{type(self).__name__}.advantage_cap must be > 0 (or null), got {self.advantage_cap}")
        if not 0.0 <= self.advantage_cap_momentum < 1.0:
            raise ValueError(
                f"{type(self).__name__}.advantage_cap_momentum must be in [0, 1), got {self.advantage_cap_momentum}"
            )
        self._check()

    def _check(self) -> None:  # per-loss parameter checks
        pass

    @property
    def tinker_builtin(self) -> str | None:
        """The Tinker loss computing exactly this (token level only; GSPO-style sequence
        ratios are a custom loss there)."""
        return self._builtin if self.level == "token" else None

    @property
    def tinker_loss_fn_config(self) -> dict[str, float] | None:
        return self._config() if self.level == "token" else None

    def _config(self) -> dict[str, float]:
        raise NotImplementedError

    def _loss(
        self, logprobs: torch.Tensor, ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def __call__(self, logprobs: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> LossOutput:
        for key in (WEIGHTS, SAMPLER_LOGPROBS, ADVANTAGES):
            if key not in batch:
                raise KeyError(f"{type(self).__name__} needs batch[{key!r}]; the batch has {sorted(batch)}")
        mask = batch["weights"].to(logprobs.dtype)
        q = batch["sampler_logprobs"].to(logprobs.dtype)
        adv = batch["advantages"].to(logprobs.dtype)
        log_ratio = log_importance_weights(logprobs, q, mask, self.level)
        ratio = torch.exp(log_ratio).expand_as(logprobs)
        loss, clipped = self._loss(logprobs, ratio, adv, mask)
        token_lr = log_importance_weights(logprobs.detach(), q, mask, "token")
        return LossOutput(loss, ratio_stats(token_lr, mask, clipped.expand_as(logprobs)))


@dataclass
class _ThresholdLoss(_RatioLoss):
    """A ratio loss with Tinker's two thresholds, sent as its ``loss_fn_config``."""

    clip_low_threshold: float = 0.0
    clip_high_threshold: float = 4.0

    def _config(self) -> dict[str, float]:
        return {"clip_low_threshold": self.clip_low_threshold, "clip_high_threshold": self.clip_high_threshold}


@dataclass
class PPOLoss(_ThresholdLoss):
    """Tinker's ``ppo``: ``-sum(min(rho*A, clip(rho, clip_low_threshold, clip_high_threshold)*A))``.

    Defaults 0.8 / 1.2 (Tinker's). ``ratio/clipped_frac`` counts tokens where the clip binds
    (``rho > high`` with ``A > 0`` or ``rho < low`` with ``A < 0``): their gradient is 0."""

    clip_low_threshold: float = 0.8
    clip_high_threshold: float = 1.2
    _builtin: ClassVar[str] = "ppo"

    def _check(self) -> None:
        if not 0 <= self.clip_low_threshold <= 1 <= self.clip_high_threshold:
            raise ValueError(
                "PPOLoss: need 0 <= clip_low_threshold <= 1 <= clip_high_threshold, "
                f"got {self.clip_low_threshold}, {self.clip_high_threshold}"
            )

    def _loss(
        self, logprobs: torch.Tensor, ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        lo, hi = self.clip_low_threshold, self.clip_high_threshold
        clipped = ((ratio > hi) & (adv > 0)) | ((ratio < lo) & (adv < 0))
        return ppo_loss(ratio, adv, mask, lo, hi), clipped


@dataclass
class CISPOLoss(_ThresholdLoss):
    """Tinker's ``cispo``: ``-sum(sg(clip(rho, clip_low_threshold, clip_high_threshold)) * A * lp)``.

    Defaults 0.0 / 4.0 (Tinker's one-sided default: only large ratios are capped)."""

    clip_low_threshold: float = 0.0
    clip_high_threshold: float = 4.0
    _builtin: ClassVar[str] = "cispo"

    def _check(self) -> None:
        if not 0 <= self.clip_low_threshold <= self.clip_high_threshold:
            raise ValueError(
                f"{type(self).__name__}: need 0 <= low <= high, "
                f"got {self.clip_low_threshold}, {self.clip_high_threshold}"
            )

    def _loss(
        self, logprobs: torch.Tensor, ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        lo, hi = self.clip_low_threshold, self.clip_high_threshold
        return cispo_loss(logprobs, ratio, adv, mask, lo, hi), (ratio < lo) | (ratio > hi)


@dataclass
class TISLoss(_RatioLoss):
    """Truncated importance sampling: ``-sum(sg(min(rho, C)) * A * lp)``, ``C = truncation``
    (default 2, as Yao et al.'s TIS). Exactly Tinker's ``cispo`` with thresholds ``{0, C}``."""

    truncation: float = 2.0
    _builtin: ClassVar[str] = "cispo"

    def _check(self) -> None:
        if self.truncation <= 0:
            raise ValueError(f"TISLoss.truncation must be > 0, got {self.truncation}")

    def _config(self) -> dict[str, float]:
        return {"clip_low_threshold": 0.0, "clip_high_threshold": self.truncation}

    def _loss(
        self, logprobs: torch.Tensor, ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return tis_loss(logprobs, ratio, adv, mask, self.truncation), ratio > self.truncation


@dataclass
class ClippedISLoss(PPOLoss):
    """The "clipped importance ratios and capped advantages" recipe for stale rollouts:
    ``-sum(min(rho*A', clip(rho, c_low, c_high)*A'))`` with ``c_low/c_high = 0.8/1.2`` (+-0.2)
    and ``A'`` the advantages with per-token ``|A|`` capped at ``advantage_cap = 3`` times its
    running mean (EMA, ``advantage_cap_momentum``). Tinker: ``ppo`` with these thresholds,
    after the stage has capped the advantages."""

    advantage_cap: float | None = 3.0
