"""Rollouts: sample groups of completions for examples and score them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tempering.data import encode_prompt
from tempering.scoring import RewardRunner, ScoreStats
from tempering.types import Group, Sample, SamplingParams


def sample_groups(
    backend: Any, examples: Sequence[Mapping[str, Any]], group_size: int, params: SamplingParams, first_id: int = 0
) -> list[Group]:
    """``group_size`` completions per example, as unscored groups."""
    prompts = [encode_prompt(backend.tokenizer, e) for e in examples]
    completions = backend.sample(prompts, group_size, params).result()
    return [
        Group(dict(e), [Sample(example=dict(e), completion=c) for c in comps], group_id=first_id + i)
        for i, (e, comps) in enumerate(zip(examples, completions))
    ]


def score_groups(runner: RewardRunner, groups: Sequence[Group]) -> ScoreStats:
    return runner.score(s for g in groups for s in g.samples)
