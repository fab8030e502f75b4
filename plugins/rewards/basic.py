"""Verifiable rewards that need nothing but the example's reference answer."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from tempering.rollouts.feedback import Scored, mismatch


@dataclass
class ExactMatch:
    """1.0 if the completion equals ``example[answer_key]`` (after ``strip``), else 0.0.

    A miss is a :class:`~tempering.rollouts.feedback.Scored` 0.0 -- still a float to a caller that
    uses it as a number -- whose feedback says what was expected and what came
    (``expected '42', got '41'``, the answer clipped); a hit is a plain 1.0, nothing to say."""

    column_keys: ClassVar[tuple[str, ...]] = ("answer_key",)  # config keys naming dataset columns it reads
    answer_key: str = "answer"
    strip: bool = True
    case_sensitive: bool = True

    def __call__(self, completion: str, example: Mapping[str, Any]) -> float:
        if self.answer_key not in example:
            raise KeyError(f"exact_match: the example has no '{self.answer_key}' key (keys: {sorted(example)})")
        got, want = completion, str(example[self.answer_key])
        if self.strip:
            got, want = got.strip(), want.strip()
        if (got if self.case_sensitive else got.lower()) == (want if self.case_sensitive else want.lower()):
            return 1.0
        return Scored(0.0, mismatch(want, got))
