"""An advantage estimator is any callable ``(rewards[N], group_ids[N]) -> advantages[N]``.

This module imports torch at the top, which is fine: the registry refers to it by a lazy
string, so it is only imported when a recipe uses ``advantage: rank``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RankAdvantage:
    """Rank-based group advantages, robust to the scale and outliers of the reward.

    Within each group of ``n`` rewards the advantage is ``scale * (rank / (n - 1) - 0.5)``,
    where ``rank`` counts the group's smaller rewards (ties share their mean rank): the best
    gets ``+scale/2``, the worst ``-scale/2``, and a group's advantages sum to zero. A group
    of one, a group whose rewards are all equal and NaN rewards get 0.
    """

    scale: float = 1.0

    def __call__(self, rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
        if rewards.dim() != 1 or rewards.shape != group_ids.shape:
            raise ValueError(
                f"rank: rewards and group_ids must be 1-D of one length, got {tuple(rewards.shape)} "
                f"and {tuple(group_ids.shape)}"
            )
        out = torch.zeros_like(rewards)
        valid = ~torch.isnan(rewards)
        for gid in torch.unique(group_ids[valid]):
            idx = torch.nonzero(valid & (group_ids == gid), as_tuple=True)[0]
            r = rewards[idx]
            n = r.numel()
            if n < 2:
                continue
            below = (r.unsqueeze(1) > r.unsqueeze(0)).sum(dim=1)
            ties = (r.unsqueeze(1) == r.unsqueeze(0)).sum(dim=1)  # counts itself
            rank = below.to(rewards.dtype) + (ties - 1).to(rewards.dtype) / 2
            out[idx] = self.scale * (rank / (n - 1) - 0.5)
        return out
