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


def should_recompute(mode: str, params: SamplingParams) -> bool:
    """Whether the ratio's "old" logprobs need a forward pass of the sampling weights.

    The sampler's logprobs are those of the tempered / top-k / top-p distribution it drew from,
    while the trainer scores the plain policy: under ``auto`` they are reused only when
    sampling was plain (temperature 1, no filters), where the two agree.
    """
    plain = params.temperature == 1.0 and params.top_p >= 1.0 and params.top_k <= 0
    return mode == "always" or (mode == "auto" and not plain)


def recompute_sampler_logprobs(backend: Any, batch: Any) -> None:
    """Replace each row's ``sampler_logprobs`` by the backend's forward-pass logprobs (0 where
    the row has weight 0, as :meth:`tempering.types.Datum.from_completion` lays them out)."""
    for d, lp in zip(batch.data, backend.logprobs(batch).result()):
        d.sampler_logprobs = [x if w else 0.0 for x, w in zip(lp, d.weights)]
