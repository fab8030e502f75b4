"""Rollouts: the one path from examples to scored groups, shared by every RL stage and by
evaluation.

A *sampler* (component kind ``sampler``) turns a batch of examples into groups of scored
samples: ``completion`` (one completion per sample, scored by the stage's reward) or
``environment`` (multi-turn episodes with tools). Stages never sample by hand: the synchronous
path (:func:`collect`: GRPO, SDFT, evaluation) and the asynchronous producer
(:class:`tempering.rollouts.async_rollout.AsyncRollouts`: off-policy RL) both call
``sampler.sample(client, examples, group_size, params)``, with the live backend or a sampling
client of a weight snapshot as ``client``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from tempering.interfaces import Sampler, SamplingClient, Tokenizer
from tempering.rollouts.scoring import RewardRunner, ScoreStats, run_coroutine
from tempering.runs.failures import SAMPLES_KEY, failure_metrics
from tempering.runs.outcomes import outcome_metrics
from tempering.types import Batch, Group, SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    from tempering.interfaces import Backend


@dataclass
class SamplerContext:
    """What a sampler gets from its stage at build time (runtime objects, not config).

    ``renderer()`` builds the stage's renderer on first use (a single-turn sampler on raw text
    prompts never needs one); ``reward`` scores what the sampler cannot (None: leave samples
    unscored, as SDFT does); ``build(kind, spec, key)`` and ``factory(kind, spec, key)``
    resolve nested components through the registry with the sampler's config path.
    ``chat_prompts``: a text ``prompt`` is rendered as a user turn through the renderer, not
    sent as raw text (the stage's rule: :func:`tempering.rollouts.renderer.chat_text_prompts`).
    ``reward_key``: the config path of ``reward`` when the user wrote it (None for the default),
    so a sampler that does not use it for some samples can say so (an environment scoring its
    own episodes).
    """

    tokenizer: Tokenizer
    renderer: Callable[[], Any]
    reward: RewardRunner | None
    build: Callable[[str, Any, str], Any]
    factory: Callable[[str, Any, str], Callable[[], Any]]
    path: str = "sampler"
    chat_prompts: bool = False
    reward_key: str | None = None


@dataclass
class Rollout:
    """Scored groups (in the order of the examples), the reward runner's counts and the
    sampler's own metrics (``time/sample``, ``time/reward``, ...)."""

    groups: list[Group]
    stats: ScoreStats = field(default_factory=ScoreStats)
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class RolloutBatch:
    """What a rollout source hands a stage for one step: the groups (in slot order) and the
    source's own metrics (sampling time, staleness, ...)."""

    groups: list[Group]
    metrics: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class RolloutSource(Protocol):
    """Where an RL stage's batches of scored groups come from, one per step: sampled now with the
    live weights (:class:`tempering.training.rl.SyncRollouts`) or by a background producer from
    weights up to k steps old (:class:`tempering.rollouts.async_rollout.AsyncRollouts`).
    ``position`` is the example stream's position just past the last batch taken (what a
    checkpoint keeps to resume there); ``close`` stops whatever the source runs."""

    @property
    def position(self) -> int: ...

    def next_batch(self, step: int) -> RolloutBatch: ...

    def close(self) -> None: ...


def collect(
    sampler: Sampler,
    client: SamplingClient,
    examples: Sequence[Mapping[str, Any]],
    group_size: int,
    params: SamplingParams,
    first_id: int = 0,
) -> Rollout:
    """Blocking form of ``sampler.sample``, on an event loop of its own. Rewards holding
    loop-bound resources (HTTP clients) are closed after, as :meth:`RewardRunner.score` does."""

    async def main() -> Rollout:
        try:
            return await sampler.sample(client, [dict(e) for e in examples], group_size, params, first_id)
        finally:
            runner = getattr(sampler, "reward_runner", None)
            if runner is not None:
                await runner.aclose()

    return run_coroutine(main())


def rollout_metrics(groups: Sequence[Group]) -> dict[str, Any]:
    """Counts every RL stage logs for its rollouts: failures (``reward/failed``, with the first
    error's text, and per cause: ``failed/<cause>``, ``first_error/<cause>``, see
    :mod:`tempering.runs.failures`), the number of samples (``rollout/samples``), masked samples,
    completion lengths and stops, and -- for multi-turn samples -- turns, tool calls and errors,
    parse errors and how episodes ended (``env/stop/<cause>`` fractions)."""
    samples = [s for g in groups for s in g.samples]
    n = max(len(samples), 1)
    out: dict[str, Any] = {
        "reward/failed": float(sum(s.failed for s in samples)),
        "reward/timeouts": float(sum(bool(s.reward_info.get("timeout")) for s in samples if s.failed)),
        "completion/mean_len": sum(s.num_generated for s in samples) / n,
        "completion/stop_frac": sum(s.completion.stop_reason == "stop" for s in samples) / n,
    }
    errors = [s.error for s in samples if s.failed and s.error]
    if errors:
        out["first_error"] = errors[0]
    out[SAMPLES_KEY] = float(len(samples))
    out.update(failure_metrics(samples, tracebacks=True))
    out.update(outcome_metrics(samples))
    trajectories = [s.trajectory for s in samples if s.trajectory is not None]
    if trajectories:
        out["env/masked"] = float(sum(s.masked for s in samples))
        totals: dict[str, float] = {}
        for t in trajectories:
            for k, v in t.metrics.items():
                totals[k] = totals.get(k, 0.0) + v
        out["env/turns_mean"] = totals.pop("turns", 0.0) / len(trajectories)
        for k, v in sorted(totals.items()):
            out[f"env/{k}"] = v
        for cause in sorted({t.stop for t in trajectories}):
            out[f"env/stop/{cause}"] = sum(t.stop == cause for t in trajectories) / len(trajectories)
        tool_errors = [e for t in trajectories for e in t.errors]
        if tool_errors:
            out["env/first_error"] = tool_errors[0]
    return out


def should_recompute(mode: str, params: SamplingParams) -> bool:
    """Whether the ratio's "old" logprobs need a forward pass of the sampling weights.

    The sampler's logprobs are those of the tempered / top-k / top-p distribution it drew from,
    while the trainer scores the plain policy: under ``auto`` they are reused only when
    sampling was plain (temperature 1, no filters), where the two agree.
    """
    plain = params.temperature == 1.0 and params.top_p >= 1.0 and params.top_k <= 0
    return mode == "always" or (mode == "auto" and not plain)


def recompute_sampler_logprobs(backend: Backend, batch: Batch) -> None:
    """Replace each row's ``sampler_logprobs`` by the backend's forward-pass logprobs (0 where
    the row has weight 0, as :meth:`tempering.types.Segment.to_datum` lays them out)."""
    for d, lp in zip(batch.data, backend.logprobs(batch).result()):
        d.sampler_logprobs = [x if w else 0.0 for x, w in zip(lp, d.weights)]
