"""Verifiable rewards that need nothing but the example's reference answer."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass
class ExactMatch:
    """1.0 if the completion equals ``example[answer_key]`` (after ``strip``), else 0.0."""

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
        if not self.case_sensitive:
            got, want = got.lower(), want.lower()
        return 1.0 if got == want else 0.0
