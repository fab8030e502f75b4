"""Rewards of an agentic search episode: answer correctness, and costs per tool call and per
context token (recall of the cited documents is ``retrieval_recall``).

Each is a registered reward, ``(final_answer_text, example) -> RewardResult``, so a ``weighted``
reward combines them with weights that are config keys (the ``search`` environment's
``reward``). The costs read what the text cannot tell -- how the episode went -- from
``example["episode"]``, which the ``search`` environment adds when it scores a finished
episode (:func:`tempering.plugins.environments.search.episode_stats`): ``tool_calls``,
``context_tokens`` (each turn's prompt, summed over the turns), ``peak_context``, ``pruned``,
``turns``. Costs are negative (higher is better, like every reward); a weight scales them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from tempering.interfaces import RewardResult
from tempering.rollouts.feedback import mismatch

EPISODE_KEY = "episode"


def answer_text(text: str, citation: str = r"\[([^\[\]]+)\]") -> str:
    """The answer part of a final answer: citations removed, whitespace and case folded, a
    final period dropped (``"Var [d12][d3]."`` -> ``"var"``)."""
    bare = re.sub(citation, " ", text)
    return " ".join(bare.split()).strip().rstrip(".").strip().lower()


def answer_correct(text: str, answer: str, citation: str = r"\[([^\[\]]+)\]") -> float:
    """1.0 if the answer part of ``text`` equals ``answer`` (folded alike), else 0.0."""
    return float(answer_text(text, citation) == answer_text(str(answer), citation))


@dataclass
class AnswerMatch:
    """1 if the final answer, its citations removed, equals ``example[answer_key]`` (case,
    spacing and a final period ignored). ``citation``: the regex of a citation. A wrong answer's
    feedback: ``expected 'var', got 'kam'`` (both folded, citations removed)."""

    column_keys: ClassVar[tuple[str, ...]] = ("answer_key",)
    answer_key: str = "answer"
    citation: str = r"\[([^\[\]]+)\]"

    def __post_init__(self) -> None:
        re.compile(self.citation)

    def __call__(self, completion: str, example: Mapping[str, Any]) -> RewardResult:
        if self.answer_key not in example:
            raise KeyError(f"answer_match: the example has no '{self.answer_key}' key (keys: {sorted(example)})")
        gold, answer = answer_text(str(example[self.answer_key]), self.citation), answer_text(completion, self.citation)
        correct = float(answer == gold)
        return RewardResult(
            correct, {"correct": correct, "answer": answer}, feedback=None if correct else mismatch(gold, answer)
        )


def episode(example: Mapping[str, Any], who: str) -> Mapping[str, Any]:
    """``example["episode"]``, or an error saying where it comes from."""
    stats = example.get(EPISODE_KEY)
    if not isinstance(stats, Mapping):
        raise KeyError(
            f"{who}: the example has no '{EPISODE_KEY}' statistics; they are added by the search "
            "environment, so use this reward in its 'reward' key"
        )
    return stats


@dataclass
class ToolCallCost:
    """``-(tool calls in the episode)``: with a weight, a cost per call (rewarding an agent
    that uses only the tools it needs)."""

    def __call__(self, completion: str, example: Mapping[str, Any]) -> RewardResult:
        calls = float(episode(example, "tool_call_cost")["tool_calls"])
        return RewardResult(-calls, {"tool_calls": calls})


@dataclass
class ContextTokenCost:
    """``-(tokens the model read over the episode)``: each turn's prompt, summed
    (``context_tokens``), or the largest prompt plus its turn with ``measure: peak``. With a
    weight, a cost per token: pruning documents from the context lowers it."""

    measure: str = "total"

    def __post_init__(self) -> None:
        if self.measure not in ("total", "peak"):
            raise ValueError(f"context_token_cost.measure: use total or peak (got '{self.measure}')")

    def __call__(self, completion: str, example: Mapping[str, Any]) -> RewardResult:
        stats = episode(example, "context_token_cost")
        tokens = float(stats["context_tokens" if self.measure == "total" else "peak_context"])
        return RewardResult(-tokens, {"tokens": tokens})
