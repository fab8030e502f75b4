"""Re-exports of the group-relative advantage estimators, which live in
:mod:`tempering.rlmath.advantages` (shared by every RL stage, not GRPO's own).

Kept so that ``from tempering.algorithms.grpo.advantages import GroupNormAdvantage`` (tests,
recipes' plugin code, third-party plugins) keeps working; new code imports from
:mod:`tempering.rlmath.advantages`.
"""

from __future__ import annotations

from tempering.rlmath import advantages as _shared
from tempering.rlmath.advantages import *  # noqa: F403 - re-exporting the module is the point

__all__ = list(_shared.__all__)
