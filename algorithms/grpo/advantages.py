"""Re-exports of the group-relative advantage estimators, which live in
:mod:`tempering.rlmath.advantages` (shared by every RL stage, not GRPO's own).

Kept so that ``from tempering.algorithms.grpo.advantages import GroupNormAdvantage`` (tests,
recipes' plugin code, third-party plugins) keeps working; new code imports from
:mod:`tempering.rlmath.advantages`.
"""

from __future__ import annotations

from tempering.rlmath.advantages import (
    GroupNormAdvantage,
    MeanOnlyAdvantage,
    RLOOAdvantage,
    group_stats,
    zero_variance_groups,
)

__all__ = [
    "GroupNormAdvantage",
    "MeanOnlyAdvantage",
    "RLOOAdvantage",
    "group_stats",
    "zero_variance_groups",
]
