"""Retrieval-augmented answers: recall of the cited documents minus a length cost.

reward = |cited & gold| / |gold| - cost_coef * cost, where ``cost`` is the completion's length
in ``cost_unit`` (tokens, words or characters).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tempering.interfaces import RewardResult, Tokenizer


def cited_ids(text: str, pattern: str = r"\[(doc\d+)\]") -> list[str]:
    """Document ids cited in ``text``, first occurrence order, without duplicates. The id is
    the pattern's first group if it has one, else the whole match."""
    rx = re.compile(pattern)
    seen: dict[str, None] = {}
    for m in rx.finditer(text):
        seen.setdefault(m.group(1) if rx.groups else m.group(0), None)
    return list(seen)


def _gold(value: Any) -> list[str]:
    if isinstance(value, str):
        return [v.strip() for v in re.split(r"[,\s]+", value) if v.strip()]
    return [str(v).strip() for v in value]


@dataclass
class RetrievalRecall:
    """Recall of cited document ids against ``example[gold_key]``, minus a token-cost penalty.

    ``pattern``: regex of a citation (default ``[doc3]`` -> ``doc3``). Gold ids: a list or a
    comma/space separated string; an example without gold ids raises (recall is undefined).
    ``cost_unit``: ``tokens`` (needs ``tokenizer``, a runtime object), ``words`` or ``chars``.
    Feedback when a gold document is not cited: ``cited 1 of 2 supporting documents; missing d12``.
    """

    column_keys: ClassVar[tuple[str, ...]] = ("gold_key",)  # config keys naming dataset columns it reads
    gold_key: str = "gold_ids"
    pattern: str = r"\[(doc\d+)\]"
    case_sensitive: bool = False
    cost_coef: float = 0.0
    cost_unit: str = "chars"
    tokenizer: Tokenizer | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.cost_unit not in ("tokens", "words", "chars"):
            raise ValueError(f"retrieval_recall.cost_unit: use tokens, words or chars (got '{self.cost_unit}')")
        if self.cost_unit == "tokens" and self.tokenizer is None:
            raise ValueError("retrieval_recall: cost_unit 'tokens' needs a tokenizer (pass tokenizer=...)")
        re.compile(self.pattern)  # a bad regex fails at build time, not per sample

    def cost(self, completion: str) -> int:
        if self.cost_unit == "chars":
            return len(completion)
        if self.cost_unit == "words":
            return len(completion.split())
        if self.tokenizer is None:
            raise ValueError("cost_unit 'tokens' counts with the model's tokenizer; none was given")
        return len(self.tokenizer(completion, add_special_tokens=False)["input_ids"])

    def __call__(self, completion: str, example: Mapping[str, Any]) -> RewardResult:
        if self.gold_key not in example:
            raise KeyError(f"retrieval_recall: the example has no '{self.gold_key}' key (keys: {sorted(example)})")
        fold = (lambda s: s) if self.case_sensitive else str.lower
        gold = {fold(g) for g in _gold(example[self.gold_key])}
        if not gold:
            raise ValueError(f"retrieval_recall: '{self.gold_key}' is empty: recall is undefined")
        cited = cited_ids(completion, self.pattern)
        hits = sorted(gold & {fold(c) for c in cited})
        recall = len(hits) / len(gold)
        cost = self.cost(completion)
        missing = sorted(gold - set(hits))
        return RewardResult(
            recall - self.cost_coef * cost,
            {"recall": recall, "cited": cited, "hits": hits, "cost": cost, "penalty": self.cost_coef * cost},
            feedback=f"cited {len(hits)} of {len(gold)} supporting documents; missing {', '.join(missing)}"
            if missing
            else None,
        )
