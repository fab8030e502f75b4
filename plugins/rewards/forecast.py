"""Rewards for probability forecasts: the (negated) Brier score and the Brier skill score.

The completion states a probability (``0.7``, ``70%``, ``Probability: 0.7``); the example holds
the outcome ``y`` (1/0, true/false, yes/no). Brier = (p - y)^2 is a loss (lower is better), so
the ``brier`` reward is its negation, ``-(p - y)^2`` in [-1, 0]: **higher is better**, 0 is a
perfect forecast. ``brier_skill`` = 1 - Brier / Brier_ref against a reference forecast p_ref
(the base rate; 0.5 by default, or read per example): 1 is perfect, 0 is no better than the
reference, negative is worse.

A completion without a readable probability is a failure (masked out of the loss, counted),
since 0 would be a perfect Brier reward. For RL on a model that often answers in words,
``unparsed_reward`` scores it instead (say -1, the worst Brier): the model then learns to
answer in the format. Such a sample reports ``unparsed: 1`` and no forecast, so calibration
(:mod:`tempering.runs.calibration`) leaves it out and counts only the forecasts it read.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from tempering.interfaces import RewardResult
from tempering.plugins.rewards.common import RewardError, find_numbers


class ForecastParseError(RewardError, ValueError):
    """No probability could be read from the completion."""


def parse_probability(text: str, pattern: str | None = None) -> float:
    """The forecast probability in ``text``: the last percentage (``70%`` -> 0.7) or number in
    [0, 1], whichever comes last; with ``pattern``, the last match of that regex (its first
    group if it has one) is parsed the same way. Raises :class:`ForecastParseError`.
    """
    if pattern:
        matches = list(re.finditer(pattern, text))
        if not matches:
            raise ForecastParseError(f"no match of {pattern!r} in the completion {text[-200:]!r}")
        m = matches[-1]
        text = m.group(1) if m.groups() else m.group(0)
    for tok in reversed(find_numbers(text)):
        p = tok.value / 100 if tok.percent else tok.value
        if 0 <= p <= 1:
            return float(p)
    raise ForecastParseError(f"no probability (a number in [0, 1] or a percentage) in {text[-200:]!r}")


_TRUE = {"1", "1.0", "true", "yes", "y", "t"}
_FALSE = {"0", "0.0", "false", "no", "n", "f"}


def parse_outcome(value: object, key: str) -> float:
    """An outcome as 0.0 or 1.0 (``True``/``1``/``"yes"``...); a probability in [0, 1] is also
    accepted (a soft label)."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        if 0 <= value <= 1:
            return float(value)
        raise ValueError(f"the outcome '{key}' must be 0/1 (or in [0, 1]), got {value!r}")
    if isinstance(value, str):
        v = value.strip().lower()
        if v in _TRUE:
            return 1.0
        if v in _FALSE:
            return 0.0
        try:
            return parse_outcome(float(v), key)
        except ValueError:
            pass
    raise ValueError(f"the outcome '{key}' must be 0/1, true/false or yes/no, got {value!r}")


def _outcome(example: Mapping[str, Any], key: str, who: str) -> float:
    if key not in example:
        raise KeyError(f"{who}: the example has no outcome key '{key}' (keys: {sorted(example)})")
    return parse_outcome(example[key], key)


def _forecast(completion: str, pattern: str | None, unparsed_reward: float | None) -> float | RewardResult:
    """The completion's probability, or -- with ``unparsed_reward`` set and none readable -- the
    result that scores it (``unparsed: 1``, the parse error as feedback)."""
    try:
        return parse_probability(completion, pattern)
    except ForecastParseError as exc:
        if unparsed_reward is None:
            raise
        return RewardResult(float(unparsed_reward), {"unparsed": 1.0}, feedback=str(exc))


@dataclass
class Brier:
    """``-(p - y)^2``: the negated Brier score, so that **higher is better** (0 = perfect,
    -1 = confidently wrong). A completion without a readable probability raises (a failure,
    not a score), unless ``unparsed_reward`` scores it (see the module docs)."""

    column_keys: ClassVar[tuple[str, ...]] = ("outcome_key",)  # config keys naming dataset columns it reads
    outcome_key: str = "outcome"
    pattern: str | None = None
    unparsed_reward: float | None = None

    def __call__(self, completion: str, example: Mapping[str, Any]) -> RewardResult:
        y = _outcome(example, self.outcome_key, "brier")
        p = _forecast(completion, self.pattern, self.unparsed_reward)
        if isinstance(p, RewardResult):
            return p
        brier = (p - y) ** 2
        return RewardResult(-brier, {"p": p, "y": y, "brier": brier})


@dataclass
class BrierSkill:
    """``1 - Brier / Brier_ref`` with ``Brier_ref = (p_ref - y)^2``.

    ``p_ref`` is the reference forecast (a base rate, 0.5 by default); ``p_ref_key`` reads it
    from each example instead (falling back to ``p_ref`` when the key is absent). Brier_ref = 0
    (the reference was exactly right) leaves the skill undefined: that raises. ``unparsed_reward``
    as for :class:`Brier`.
    """

    column_keys: ClassVar[tuple[str, ...]] = ("outcome_key",)
    outcome_key: str = "outcome"
    p_ref: float = 0.5
    p_ref_key: str | None = None
    pattern: str | None = None
    unparsed_reward: float | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.p_ref <= 1:
            raise ValueError(f"brier_skill.p_ref must be in [0, 1], got {self.p_ref}")

    def __call__(self, completion: str, example: Mapping[str, Any]) -> RewardResult:
        y = _outcome(example, self.outcome_key, "brier_skill")
        p = _forecast(completion, self.pattern, self.unparsed_reward)
        if isinstance(p, RewardResult):
            return p
        p_ref = float(example[self.p_ref_key]) if self.p_ref_key and self.p_ref_key in example else self.p_ref
        if not 0 <= p_ref <= 1:
            raise ValueError(f"brier_skill: the reference probability must be in [0, 1], got {p_ref!r}")
        brier, ref = (p - y) ** 2, (p_ref - y) ** 2
        if ref == 0:
            raise RewardError(f"brier_skill: the reference forecast {p_ref} equals the outcome {y}: skill undefined")
        return RewardResult(1.0 - brier / ref, {"p": p, "y": y, "brier": brier, "brier_ref": ref, "p_ref": p_ref})
