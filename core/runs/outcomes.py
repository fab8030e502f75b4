"""Outcomes: what happened to a *scored* sample, by a reward's own label, counted per step.

A failure (:mod:`tempering.runs.failures`) is a sample the run could not score; an outcome is
a score's reason: the ``sandbox`` reward scores a program that looped forever 0 *because* of
a ``timeout``, one that passed every test 1 because it ``passed``. A reward that puts a short
label in its ``info["outcome"]`` (:class:`tempering.interfaces.RewardResult`) has it counted
as ``outcome/<label>`` in the step's metrics (``eval/outcome/<label>`` in an evaluation), so
a run shows how often its programs hit each limit without reading ``rollouts.jsonl``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tempering.types import Sample

OUTCOME_KEY = "outcome"  # where a reward puts its label, in ``sample.reward_info``
OUTCOME_PREFIX = "outcome/"


def outcome_metrics(samples: Iterable[Sample], prefix: str = "") -> dict[str, float]:
    """``{prefix}outcome/<label>``: how many scored samples carry each label (failed ones are
    counted as failures instead)."""
    counts: dict[str, float] = {}
    for s in samples:
        label: Any = (s.reward_info or {}).get(OUTCOME_KEY)
        if not s.failed and isinstance(label, str) and label:
            counts[label] = counts.get(label, 0.0) + 1.0
    return {f"{prefix}{OUTCOME_PREFIX}{k}": v for k, v in sorted(counts.items())}
