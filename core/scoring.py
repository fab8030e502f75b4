"""Running rewards: sync or async, one sample at a time or streamed, never crashing the run.

A reward that raises, returns NaN/inf or exceeds ``timeout`` marks its sample ``failed``: the
sample stays in its group (so counts stay honest) and the loop masks it out of the loss.
Failures are counted in :class:`ScoreStats` and surface in the step's metrics.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tempering.interfaces import RewardResult
from tempering.types import Sample, is_bad_number


@dataclass
class ScoreStats:
    scored: int = 0
    failed: int = 0
    timeouts: int = 0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)

    def as_metrics(self) -> dict[str, float]:
        return {"reward/failed": float(self.failed), "reward/timeouts": float(self.timeouts), "reward/seconds": self.seconds}


@dataclass
class RewardRunner:
    """Applies ``reward(completion_text, example)`` to samples.

    ``concurrency`` bounds async rewards in flight (remote judges, HTTP rewards); ``timeout``
    applies to async rewards (sync ones run inline: put heavy sync rewards in a process pool
    reward, which enforces its own timeout).
    """

    reward: Callable[..., Any]
    timeout: float | None = 60.0
    concurrency: int = 64
    max_logged_errors: int = 5

    def score(self, samples: Iterable[Sample]) -> ScoreStats:
        """Score in place; blocks until every sample has a reward or a recorded failure."""
        samples = list(samples)
        if not _is_async(self.reward):
            return self._score_sync(samples)
        return asyncio.run(self.ascore(samples))

    def _score_sync(self, samples: list[Sample]) -> ScoreStats:
        stats = ScoreStats()
        t0 = time.perf_counter()
        for s in samples:
            try:
                self._apply(s, self.reward(s.completion.text, s.example), stats)
            except Exception as exc:  # noqa: BLE001 - a reward bug must not kill the run
                self._fail(s, f"{type(exc).__name__}: {exc}", stats)
        stats.seconds = time.perf_counter() - t0
        return stats

    async def ascore(self, samples: Iterable[Sample]) -> ScoreStats:
        stats = ScoreStats()
        t0 = time.perf_counter()
        sem = asyncio.Semaphore(self.concurrency)

        async def one(s: Sample) -> None:
            async with sem:
                try:
                    value = self.reward(s.completion.text, s.example)
                    if inspect.isawaitable(value):
                        value = await asyncio.wait_for(value, self.timeout)
                    self._apply(s, value, stats)
                except asyncio.TimeoutError:
                    stats.timeouts += 1
                    self._fail(s, f"timed out after {self.timeout}s", stats)
                except Exception as exc:  # noqa: BLE001
                    self._fail(s, f"{type(exc).__name__}: {exc}", stats)

        await asyncio.gather(*(one(s) for s in samples))
        stats.seconds = time.perf_counter() - t0
        return stats

    def _apply(self, s: Sample, value: Any, stats: ScoreStats) -> None:
        info: dict[str, Any] = {}
        if isinstance(value, RewardResult):
            value, info = value.reward, value.info
        elif isinstance(value, dict):
            info = {k: v for k, v in value.items() if k != "reward"}
            value = value.get("reward")
        if is_bad_number(value):
            self._fail(s, f"reward returned {value!r} (not a finite number)", stats)
            return
        s.reward, s.reward_info, s.failed, s.error = float(value), info, False, None
        stats.scored += 1

    def _fail(self, s: Sample, message: str, stats: ScoreStats) -> None:
        s.reward, s.failed, s.error = 0.0, True, message
        stats.failed += 1
        if len(stats.errors) < self.max_logged_errors:
            stats.errors.append(message)


def _is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))
