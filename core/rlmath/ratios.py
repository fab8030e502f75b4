"""Importance weights: how much more (or less) likely the policy being trained makes a token
than the policy that sampled it.

Every off-policy correction starts from ``log(pi_theta / pi_old)`` per token, where ``pi_old`` is
the behaviour ("old", sampler) policy whose logprobs the batch carries. GRPO/PPO clip the
ratio, CISPO/TIS use it as a stopped coefficient, and GSPO replaces it by one ratio per
sequence (the length-normalised ``exp(mean_t log-ratio)``), which is less noisy for long
completions. Working in log space until the last ``exp`` keeps masked positions at exactly 0
(ratio 1) and avoids overflow from padding values.
"""

from __future__ import annotations

import torch

from tempering.rlmath.masks import active

__all__ = ["IS_LEVELS", "capped_is_weight", "clipped_is_weight", "gspo_token_ratio", "log_importance_weights"]

#: ``token``: one ratio per token; ``sequence``: one per row (GSPO).
IS_LEVELS = ("token", "sequence")


def log_importance_weights(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor, level: str = "token"
) -> torch.Tensor:
    """``log(pi / pi_old)``: per token ``(B, T)`` (0 on masked positions), or with
    ``level="sequence"`` the masked mean per row, ``(B, 1)`` (GSPO)."""
    log_ratio = torch.where(active(mask), logprobs - old_logprobs, torch.zeros_like(logprobs))
    if level == "token":
        return log_ratio
    if level == "sequence":
        return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    raise ValueError(f"importance_sampling_level must be one of {IS_LEVELS}, got {level!r}")


def gspo_token_ratio(
    logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, sequence_mask: torch.Tensor
) -> torch.Tensor:
    """GSPO-token's ratio for *one sequence* (Tinker's ``gspo`` built-in): every token carries
    the value of the sequence ratio ``s = exp(mean over sequence_mask of (lp - q))`` and the
    gradient of its own logprob, ``s_t = sg(s) * exp(lp_t - sg(lp_t))``.

    Why: with one advantage per sequence, ``sum_t s_t * A`` has GSPO's sequence-ratio
    gradient, while the per-token form lets a token's advantage vary. ``sequence_mask`` all
    zero gives ``s = 1``.
    """
    in_ratio = sequence_mask != 0
    log_ratio = (
        (logprobs.detach() - sampler_logprobs)[in_ratio].mean() if bool(in_ratio.any()) else logprobs.new_zeros(())
    )
    return torch.exp(log_ratio + logprobs - logprobs.detach())


def capped_is_weight(logprobs: torch.Tensor, old_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """``min(exp(lp - lp_old), cap)``, detached: a per-token weight that corrects a loss for
    samples drawn by older weights without ever up-weighting a token more than ``cap`` times
    (TRL's ``distillation_is_clip`` for SDFT/SDPO). On-policy its value is 1. The one-sided
    case of :func:`clipped_is_weight`."""
    return clipped_is_weight(logprobs, old_logprobs, None, cap)


def clipped_is_weight(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, low: float | None, high: float | None
) -> torch.Tensor:
    """``clamp(exp(lp - lp_old), low, high)``, detached (``None``: no bound on that side): the
    per-token importance weight of a loss on stale samples, clipped two-sidedly -- a cap keeps
    one token from dominating, a floor keeps the tokens the policy has moved away from in the
    loss. The log-ratio is clamped to [-20, 20] first, so a stray padding value cannot
    overflow; it is a coefficient, so no gradient flows through it. On-policy its value is 1."""
    weight = torch.exp((logprobs - old_logprobs).detach().clamp(-20.0, 20.0))
    return weight if low is None and high is None else weight.clamp(min=low, max=high)
