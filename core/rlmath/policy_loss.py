"""Policy-gradient losses on importance ratios.

Two families, because two kinds of caller exist:

* **Per-token losses** ``(B, T)`` that a caller aggregates itself
  (:mod:`tempering.rlmath.aggregation`): :func:`clipped_surrogate` (PPO/GRPO) and
  :func:`grpo_token_loss` (the surrogate plus GRPO's k3 KL penalty, TRL 1.16's
  ``GRPOTrainer._compute_loss``).
* **Sums over tokens**, written exactly as Tinker's built-in losses compute them (docs
  ``tinker/losses``), so a loss of ours and the service's built-in give the same value and
  gradient: :func:`importance_sampling_loss`, :func:`ppo_loss`, :func:`cispo_loss`,
  :func:`tis_loss`, :func:`dro_loss`. A normaliser (token mean, sequence mean) is folded into
  the advantages before the call (:func:`tempering.rlmath.aggregation.fold_normaliser`).
  ``mask`` selects the positions that count; ``None`` sums every position (Tinker's built-ins
  have no mask: their callers zero the inputs of positions that do not count).

With ``r = exp(lp - q)`` the ratio of the trained policy to the sampler's, ``A`` the
advantages and ``sg`` a stop-gradient:

* :func:`importance_sampling_loss`: ``-sum(r * A)`` -- unbiased, unbounded;
* :func:`ppo_loss`: ``-sum(min(r * A, clip(r, low, high) * A))``;
* :func:`cispo_loss`: ``-sum(sg(clip(r, low, high)) * lp * A)``;
* :func:`tis_loss`: ``-sum(sg(min(r, C)) * lp * A)`` (``cispo`` with thresholds ``{0, C}``);
* :func:`dro_loss`: ``-sum(lp * A - beta / 2 * (lp - q)**2)``.

Why both clip styles exist: PPO's ``min`` is pessimistic -- once the ratio has left the trust
region in the direction ``A`` pushes, the token's gradient is 0, so a stale batch cannot drag
the policy further. CISPO/TIS keep every token's gradient (``w * A * grad lp`` with ``w`` the
clipped ratio), which learns from rare tokens PPO would switch off; their *value* is not an
estimate of the objective (it is ``lp``-weighted), only their gradient is.
"""

from __future__ import annotations

import torch

from tempering.rlmath.kl import k3_kl
from tempering.rlmath.masks import masked
from tempering.rlmath.ratios import log_importance_weights

__all__ = [
    "cispo_loss",
    "clipped_objective",
    "clipped_surrogate",
    "dro_loss",
    "grpo_token_loss",
    "importance_sampling_loss",
    "ppo_loss",
    "tis_loss",
]


def _over(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``x`` on the positions that count (all of them without a mask), ready to sum."""
    return x if mask is None else masked(x, mask)


# --------------------------------------------------------------------------- per token
def clipped_objective(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    low: float,
    high: float,
    cap: float | None = None,
) -> torch.Tensor:
    """PPO's pessimistic surrogate *objective* per token, ``min(r' A, clip(r, low, high) A)``
    with ``r' = min(r, cap)`` when ``cap`` is set (INTELLECT-2's two-sided clip: a huge ratio
    with a negative advantage cannot blow the loss up). ``low``/``high`` are ratio bounds (e.g.
    0.8 / 1.2). Shapes broadcast. Losses negate it."""
    clipped = torch.clamp(ratio, low, high)
    unclipped = ratio if cap is None else torch.clamp(ratio, max=cap)
    return torch.minimum(unclipped * advantages, clipped * advantages)


def clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
    delta: float | None = None,
) -> torch.Tensor:
    """PPO/GRPO per-token loss ``-min(r' A, clip(r, 1-eps_low, 1+eps_high) A)``, where ``r' =
    min(r, delta)`` when ``delta`` is set (two-sided clipping). Shapes broadcast."""
    return -clipped_objective(ratio, advantages, 1 - epsilon_low, 1 + epsilon_high, delta)


def grpo_token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    delta: float | None = None,
    importance_sampling_level: str = "token",
    beta: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    use_bias_correction_kl: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-token GRPO loss before aggregation.

    ``l_t = clipped_surrogate(r_t, A_t) + beta * r_t * k3_t`` (the KL term times the ratio
    when ``use_bias_correction_kl``, TRL 1.16's default: that makes its gradient the unbiased
    reverse-KL gradient off-policy, DeepSeek-V3.2; it changes the gradient even on-policy,
    where the ratio's value is 1).

    Returns ``(per_token_loss (B, T), ratio, kl_term)``: ``ratio`` is ``(B, T)`` or ``(B, 1)``
    (sequence level), and ``kl_term`` is the ``(B, T)`` KL penalty per token before ``beta``
    (``ratio * k3`` with bias correction, ``k3`` without), or ``None`` when ``beta == 0``.
    Values on masked positions are meaningless; the aggregation masks them.
    """
    ratio = torch.exp(log_importance_weights(logprobs, old_logprobs, mask, importance_sampling_level))
    per_token = clipped_surrogate(ratio, advantages, epsilon_low, epsilon_high, delta)
    per_token = per_token.expand_as(logprobs)
    kl_term = None
    if beta != 0.0:
        if ref_logprobs is None:
            raise ValueError("GRPO loss with beta != 0 needs reference logprobs (batch['ref_logprobs'])")
        kl_term = k3_kl(logprobs, ref_logprobs, mask)
        if use_bias_correction_kl:
            kl_term = kl_term * ratio
        per_token = per_token + beta * kl_term
    return per_token, ratio, kl_term


# --------------------------------------------------------------------------- sums over tokens
def importance_sampling_loss(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Tinker ``importance_sampling``: ``-sum(r * A)`` over the mask (no clipping)."""
    return -_over(ratio * advantages, mask).sum()


def ppo_loss(
    ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor | None, low: float = 0.8, high: float = 1.2
) -> torch.Tensor:
    """Tinker ``ppo``: ``-sum(min(r * A, clamp(r, low, high) * A))`` over the mask."""
    return -_over(clipped_objective(ratio, advantages, low, high), mask).sum()


def cispo_loss(
    logprobs: torch.Tensor,
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None,
    low: float = 0.0,
    high: float = 4.0,
) -> torch.Tensor:
    """Tinker ``cispo``: ``-sum(sg(clamp(r, low, high)) * lp * A)`` over the mask."""
    coef = torch.clamp(ratio, low, high).detach()
    return -_over(coef * logprobs * advantages, mask).sum()


def tis_loss(
    logprobs: torch.Tensor, ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor | None, cap: float = 2.0
) -> torch.Tensor:
    """Truncated importance sampling (Yao et al.): ``-sum(sg(min(r, C)) * lp * A)``, which is
    ``cispo`` with thresholds ``{0, C}``."""
    return cispo_loss(logprobs, ratio, advantages, mask, 0.0, cap)


def dro_loss(
    logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    beta: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Tinker ``dro``: ``-sum(lp * A - beta / 2 * (lp - q)**2)`` -- a plain policy gradient
    with a quadratic penalty that keeps ``lp`` near the sampler's ``q`` instead of a ratio."""
    return -_over(logprobs * advantages - 0.5 * beta * (logprobs - sampler_logprobs) ** 2, mask).sum()
