"""A run whose groups stopped varying says so: collapse is reported, not hidden behind "Done.".

An RL stage learns from the reward's spread *within* each group of samples of one prompt. When
every sample of a prompt gets the same reward (``groups/zero_variance_frac``: the share of such
groups), the advantages are 0 and the step teaches nothing (``loss=0``): the policy has
collapsed onto one answer, or the reward never varies at all. One such step is common; many in a
row are a dead run.

:class:`CollapseWatch` counts the steps in a row whose ``groups/zero_variance_frac`` is at least
:data:`THRESHOLD`; once there are ``collapse_steps`` of them (a stage key, default
:data:`DEFAULT_STEPS`; 0 turns the watch off) it prints one line, once per stage, with the step
and what to try, and the stage's summary (the lines after "Done.") carries
``collapsed_at_step``. With the stage key ``stop_on_collapse: true`` or ``tempering run
--stop-on-collapse`` (``TEMPERING_STOP_ON_COLLAPSE=1``) the stage stops there instead: a
:class:`~tempering.errors.StopRun`, so the run checkpoints the step and ends with one line.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from tempering.errors import StopRun
from tempering.runs.failures import announce

METRIC = "groups/zero_variance_frac"
#: A step counts towards collapse when at least this share of its groups had no reward spread.
THRESHOLD = 0.9
DEFAULT_STEPS = 10
#: Set by ``tempering run --stop-on-collapse``: every stage stops on collapse.
STOP_ENV = "TEMPERING_STOP_ON_COLLAPSE"


def stop_requested(stage_key: bool) -> bool:
    """Whether to stop on collapse: the stage's ``stop_on_collapse`` or the command line's flag."""
    return bool(stage_key) or os.environ.get(STOP_ENV, "0") not in ("", "0")


class CollapseWatch:
    """Watches one stage's steps (see the module docs). ``steps``: how many steps in a row at
    or above :data:`THRESHOLD` make a collapse (0: never); ``path``: the stage's config path,
    for the keys named in the message."""

    def __init__(self, stage: str, path: str, steps: int, stop: bool) -> None:
        self.stage, self.path, self.steps, self.stop = stage, path, steps, stop
        self.streak = 0
        self.collapsed_at: int | None = None

    def observe(self, metrics: Mapping[str, Any], step: int) -> None:
        """After step ``step`` (1-based) is logged: count it; say so once (and stop, if asked)
        when the streak reaches ``steps``. A step that logged no groups leaves the streak."""
        frac = metrics.get(METRIC)
        if not self.steps or not isinstance(frac, (int, float)):
            return
        self.streak = self.streak + 1 if frac >= THRESHOLD else 0
        if self.streak < self.steps or self.collapsed_at is not None:
            return
        self.collapsed_at = step
        what = (
            f"collapsed at step {step}: {METRIC} >= {THRESHOLD:g} for {self.steps} "
            f"steps in a row (last {frac:.2f}; every sample of a prompt got the same reward, so the loss "
            "has nothing to learn from)"
        )
        advice = (
            "try a higher temperature, a KL penalty to the reference (beta), a lower learning rate, "
            "or data with a reward that varies"
        )
        if self.stop:
            raise StopRun(f"{what}; {advice}")
        announce(
            f"tempering: stage '{self.stage}' has {what}. {advice}; to stop a run there, set "
            f"{self.path}.stop_on_collapse: true or run with --stop-on-collapse"
        )

    def summary(self) -> dict[str, Any]:
        """For the stage's summary: the step it collapsed at, if it did."""
        return {} if self.collapsed_at is None else {"collapsed_at_step": self.collapsed_at}
