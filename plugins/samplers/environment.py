"""The ``environment`` sampler: multi-turn episodes of a registered environment.

Every sample is one episode (:func:`tempering.rollouts.episode.run_episode`) with a fresh environment
instance; the episodes of a batch share the model through a :class:`~tempering.rollouts.episode.ModelQueue`,
so their turns are sampled in batched calls. An episode's reward is the sum of its step rewards
plus the environment's group reward, if it has one; a final step that leaves the reward to the
stage (``None``) is scored by the stage's ``reward`` on the final answer's text.

A sample's ``feedback`` joins, in order, what its episode said (each turn's failed tool calls
and ``StepResult.feedback``, running out of turns or context), the group reward's feedback and
the stage reward's, when they score it (:mod:`tempering.rollouts.feedback`).

What each way of ending does to the sample:

* ``done`` / ``parse_error``: trained with its reward;
* ``max_turns`` / ``context``: ``on_max_turns`` / ``on_context_limit`` -- ``zero`` (reward 0,
  trained) or ``mask`` (out of the loss and the advantages, counted as ``env/masked``);
* ``error`` (the environment raised): failed -- masked, counted in ``reward/failed``, its text
  in ``first_error``, exactly like a failing reward; cause ``episode_error``, or
  ``env_timeout`` when ``reset``/``step``/the group score did not return within ``env_timeout``
  seconds (environment code runs on a loop of its own, so a call that blocks is caught too).
"""

from __future__ import annotations

import asyncio
import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tempering.errors import ConfigError
from tempering.plugins.samplers.common import with_stops
from tempering.rollouts.episode import (
    LIMIT_ACTIONS,
    EnvironmentCalls,
    EnvironmentTimeout,
    EpisodeLimits,
    ModelQueue,
    run_episode,
)
from tempering.rollouts.feedback import feedback_of, join_feedback
from tempering.rollouts.rollout import Rollout, SamplerContext
from tempering.rollouts.scoring import ScoreStats
from tempering.runs.failures import debug, format_traceback, mark_failed
from tempering.types import Completion, Group, Sample, SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    from tempering.interfaces import SamplingClient


@dataclass
class EnvironmentSampler:
    """Config keys: ``environment`` (a registered name or ``{name: ..., <its keys>}``, required),
    ``max_turns``, ``max_total_tokens`` (context budget, 0 = none), ``tool_timeout`` (seconds),
    ``on_max_turns`` / ``on_context_limit`` (``zero`` or ``mask``) and ``batch_wait`` (seconds
    a model request waits for other episodes' before its batch goes; null = until every live
    episode waits, which is reproducible). The stage's ``max_tokens`` bounds each turn.

    ``env_timeout`` (default 600 s, null = no limit): seconds per environment call -- ``reset``,
    one ``step`` (its tool calls included), ``cleanup``, the group score. Generous, because an
    agent's step may run a build or a test suite; its purpose is that an environment that never
    answers fails its episodes (cause ``env_timeout``) instead of hanging the run."""

    environment: Any = None
    max_turns: int = 8
    max_total_tokens: int = 0
    tool_timeout: float = 30.0
    on_max_turns: str = "zero"
    on_context_limit: str = "zero"
    batch_wait: float | None = None
    env_timeout: float | None = 600.0
    context: SamplerContext | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        path = self.context.path if self.context is not None else "sampler"
        if self.environment is None:
            raise ConfigError("the environment sampler needs 'environment: <registered name>'", f"{path}.environment")
        for key in ("on_max_turns", "on_context_limit"):
            if getattr(self, key) not in LIMIT_ACTIONS:
                raise ConfigError(f"use {' or '.join(LIMIT_ACTIONS)} (got '{getattr(self, key)}')", f"{path}.{key}")
        if self.max_turns < 1:
            raise ConfigError(f"must be >= 1, got {self.max_turns}", f"{path}.max_turns")
        if self.max_total_tokens < 0:
            raise ConfigError(f"must be >= 0 (0 = no budget), got {self.max_total_tokens}", f"{path}.max_total_tokens")
        if self.env_timeout is not None and not self.env_timeout > 0:
            raise ConfigError(
                f"must be > 0 (seconds) or null for no limit, got {self.env_timeout}", f"{path}.env_timeout"
            )
        self.limits = EpisodeLimits(
            self.max_turns,
            self.max_total_tokens,
            self.tool_timeout,
            self.on_max_turns,
            self.on_context_limit,
            self.env_timeout,
            f"{path}.env_timeout",
        )
        self._warned_reward = False
        self._factory = self.context.factory("environment", self.environment, "environment") if self.context else None

    @property
    def reward_runner(self) -> Any:
        return self.context.reward if self.context is not None else None

    async def sample(
        self,
        client: SamplingClient,
        examples: list[dict[str, Any]],
        group_size: int,
        params: SamplingParams,
        first_id: int = 0,
    ) -> Rollout:
        assert self.context is not None and self._factory is not None, "EnvironmentSampler needs its stage's context"
        renderer = self.context.renderer()
        params = with_stops(params, renderer.stop())
        queue = ModelQueue(client, params, self.batch_wait, seed=params.seed)
        envs = [[self._factory() for _ in range(group_size)] for _ in examples]
        cap = min((e.max_concurrent for row in envs for e in row if getattr(e, "max_concurrent", None)), default=None)
        gate = asyncio.Semaphore(cap) if cap else None
        if gate is None:
            queue.join(*range(len(examples) * group_size))  # all join before any samples: no half batches

        async def episode(env: object, example: dict[str, Any], key: int) -> Any:
            if gate is None:
                return await run_episode(env, example, renderer, queue, key, self.limits, params.max_tokens)
            async with gate:  # the environment's session limit: join the batch once a slot is free
                queue.join(key)
                return await run_episode(env, example, renderer, queue, key, self.limits, params.max_tokens)

        jobs = [
            episode(env, example, i * group_size + j)
            for i, (example, row) in enumerate(zip(examples, envs))
            for j, env in enumerate(row)
        ]
        t0 = time.perf_counter()
        results = await asyncio.gather(*jobs)
        t1 = time.perf_counter()
        groups, to_score = [], []
        for i, example in enumerate(examples):
            made = [self._sample(example, *results[i * group_size + j]) for j in range(group_size)]
            samples = [sample for sample, _ in made]
            await self._group_reward(envs[i][0], samples)
            to_score += [sample for sample, by_stage in made if by_stage]
            groups.append(Group(dict(example), samples, group_id=first_id + i))
        stats = ScoreStats()
        if to_score:
            if self.context.reward is None:
                for s in to_score:
                    mark_failed(s, "no_reward", "the environment left the reward to the stage, which has none")
            else:
                bonus = {id(s): s.reward for s in to_score}  # group rewards already added
                stats = await self.context.reward.ascore(to_score)
                for s in to_score:
                    s.reward += bonus[id(s)] if not s.failed else 0.0
        metrics = {
            "time/episodes": t1 - t0,
            "time/reward": time.perf_counter() - t1,
            "env/model_calls": float(queue.calls),
        }
        return Rollout(groups, stats, metrics)

    def _sample(self, example: dict[str, Any], traj: Any, total: float | None) -> tuple[Sample, bool]:
        """The episode as a sample, and whether the stage's reward scores it (the environment
        left its score to the stage: ``score`` returned None). Returned, not kept in
        ``reward_info``, which holds what the reward said, not control flags."""
        last = traj.turns[-1].completion if traj.turns else Completion([], [], [], "error")
        if traj.turns:
            last.text = traj.turns[-1].response.text
        sample = Sample(example=dict(example), completion=last, trajectory=traj, feedback=join_feedback(traj.feedback))
        sample.reward_info = {"stop": traj.stop, "turns": len(traj.turns)}
        action = {"max_turns": self.on_max_turns, "context": self.on_context_limit}.get(traj.stop)
        by_stage = False
        if traj.stop == "error":
            mark_failed(sample, traj.failure or "episode_error", f"episode: {traj.errors[0]}", traj.traceback)
        elif action == "mask":
            sample.masked = True
        elif action == "zero":
            sample.reward = 0.0
        elif total is None:
            by_stage = True
        else:
            sample.reward = float(total)
            self._warn_reward_unused()
        return sample, by_stage

    def _warn_reward_unused(self) -> None:
        """Once per sampler: the stage's ``reward``, which the user wrote, is not called for an
        episode the environment scored itself (its precedence was silent before)."""
        key = self.context.reward_key if self.context is not None else None
        if key is None or self._warned_reward:
            return
        self._warned_reward = True
        warnings.warn(
            f"tempering: {key} is not used for the episodes the environment scores itself: the environment's score "
            f"returned a number, which wins over the stage's reward. To score final answers with {key}, return None "
            f"from its score (the Environment.score default); otherwise remove {key}",
            UserWarning,
            stacklevel=2,
        )

    async def _group_reward(self, env: object, samples: list[Sample]) -> None:
        """Add the environment's group reward (if it defines one) to each trainable sample, and
        its feedback (a :class:`~tempering.rollouts.feedback.Scored` value's) to the sample's."""
        fn = getattr(env, "group_reward", None)
        if fn is None:
            return
        calls = EnvironmentCalls(self.limits.env_timeout, self.limits.env_timeout_key)
        try:
            values = await calls.call("group_reward", fn, [s.trajectory for s in samples])
            notes = [feedback_of(v, "environment.group_reward()") for v in values]
            values = [float(v) for v in values]
            if len(values) != len(samples):
                raise ValueError(f"returned {len(values)} values for a group of {len(samples)}")
        except Exception as exc:  # a judge failure fails the group, never the run
            if debug():
                raise
            timed_out = isinstance(exc, EnvironmentTimeout)
            cause = "env_timeout" if timed_out else "group_reward"
            trace = None if timed_out else format_traceback(exc)
            for s in samples:
                if not s.failed:
                    mark_failed(s, cause, f"group_reward: {type(exc).__name__}: {exc}", trace)
            return
        finally:
            calls.close()
        for s, v, note in zip(samples, values, notes):
            s.reward += v
            s.feedback = join_feedback([s.feedback, note])
