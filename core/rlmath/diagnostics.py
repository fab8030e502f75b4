"""Diagnostics of importance ratios and clipping: how far off-policy a batch is, and how much
of it the loss's clip switched off.

They are logged, never differentiated (``torch.no_grad``), and return python floats:

- :func:`clip_metrics`: the clip fractions and ratio statistics TRL 1.16's ``GRPOTrainer``
  logs, under its names, so a GRPO run reads like TRL's.
- :func:`ratio_stats`: off-policy health over the loss tokens: the raw ratio's mean / max /
  min, the share the loss clipped, the effective sample size (``is/ess``: 1 on-policy, -> 1/n
  when one token dominates; ``is/ess_seq`` over per-sequence weights) and ``is/kl``, the k3
  estimate of ``KL(q || pi_theta)``.
"""

from __future__ import annotations

import torch

from tempering.rlmath.masks import active

__all__ = ["clip_metrics", "ratio_stats"]


@torch.no_grad()
def clip_metrics(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
    delta: float | None = None,
) -> dict[str, float]:
    """TRL's clip metrics: ``clip_ratio/low_mean`` (share of completion tokens with ``r < 1 -
    epsilon_low`` and ``A < 0``), ``clip_ratio/high_mean`` (``r' > 1 + epsilon_high`` and ``A >
    0``), ``clip_ratio/region_mean`` (either), ``clip_ratio/low_min`` / ``clip_ratio/high_max``
    (min / max over sequences of the per-sequence shares), ``ratio/mean`` and ``ratio/max``.

    ``ratio`` is ``(B, T)`` or ``(B, 1)`` (sequence level, GSPO); in the latter case each row's
    advantage is its masked mean and every statistic is over the rows that have completion
    tokens (TRL divides by all rows)."""
    is_active = active(mask)
    if ratio.size(-1) == 1 and mask.size(-1) != 1:  # sequence level: one value per row
        rows = is_active.any(-1)
        adv = (advantages * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
        weight = rows.unsqueeze(-1).to(ratio.dtype)
        seq_weight = weight
    else:
        adv = advantages
        weight = mask.to(ratio.dtype)
        seq_weight = mask.to(ratio.dtype)
    high_ratio = ratio if delta is None else torch.clamp(ratio, max=delta)
    low = ((ratio < 1 - epsilon_low) & (adv < 0)).to(ratio.dtype)
    high = ((high_ratio > 1 + epsilon_high) & (adv > 0)).to(ratio.dtype)
    region = torch.maximum(low, high)
    count = weight.sum().clamp(min=1.0)

    def mean(x: torch.Tensor) -> float:
        return float(((x * weight).sum() / count).item())

    def per_seq(x: torch.Tensor) -> torch.Tensor:
        n = seq_weight.sum(-1)
        frac = (x * seq_weight).sum(-1) / n.clamp(min=1.0)
        kept: torch.Tensor = frac[n > 0]
        return kept

    low_seq, high_seq = per_seq(low), per_seq(high)
    ratio_active = ratio.expand_as(weight)[weight != 0]
    return {
        "clip_ratio/low_mean": mean(low),
        "clip_ratio/high_mean": mean(high),
        "clip_ratio/region_mean": mean(region),
        "clip_ratio/low_min": float(low_seq.min().item()) if low_seq.numel() else 0.0,
        "clip_ratio/high_max": float(high_seq.max().item()) if high_seq.numel() else 0.0,
        "ratio/mean": float(ratio_active.mean().item()) if ratio_active.numel() else 1.0,
        "ratio/max": float(ratio_active.max().item()) if ratio_active.numel() else 1.0,
    }


@torch.no_grad()
def ratio_stats(log_ratio: torch.Tensor, mask: torch.Tensor, clipped: torch.Tensor | None = None) -> dict[str, float]:
    """Importance-ratio diagnostics over the loss tokens (see the module docstring):
    ``ratio/mean``, ``ratio/max``, ``ratio/min``, ``ratio/clipped_frac``, ``is/ess``,
    ``is/ess_seq``, ``is/kl``.

    ``log_ratio`` is the per-token ``lp_theta - q`` (``(B, T)``); ``clipped`` an optional
    ``(B, T)`` bool tensor of tokens whose ratio the loss clipped.
    """
    is_active = active(mask)
    lr = log_ratio.float()[is_active]
    out: dict[str, float] = {}
    if lr.numel() == 0:
        return {
            "ratio/mean": 1.0,
            "ratio/max": 1.0,
            "ratio/min": 1.0,
            "ratio/clipped_frac": 0.0,
            "is/ess": 1.0,
            "is/ess_seq": 1.0,
            "is/kl": 0.0,
        }
    n = lr.numel()
    rho = torch.exp(lr)
    out["ratio/mean"] = float(rho.mean())
    out["ratio/max"] = float(rho.max())
    out["ratio/min"] = float(rho.min())
    out["ratio/clipped_frac"] = float(clipped[is_active].float().mean()) if clipped is not None else 0.0
    # ESS in log space: exp(2 logsumexp(lw) - logsumexp(2 lw)) / n -- no overflow for huge ratios
    out["is/ess"] = float(torch.exp(2 * torch.logsumexp(lr, 0) - torch.logsumexp(2 * lr, 0)) / n)
    rows = is_active.any(-1)
    seq = torch.where(is_active, log_ratio.float(), torch.zeros_like(log_ratio, dtype=torch.float32)).sum(-1)[rows]
    m = seq.numel()
    out["is/ess_seq"] = float(torch.exp(2 * torch.logsumexp(seq, 0) - torch.logsumexp(2 * seq, 0)) / m) if m else 1.0
    out["is/kl"] = float((torch.expm1(lr) - lr).mean())
    return out
