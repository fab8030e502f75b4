"""Running rewards: sync or async, one sample at a time or streamed, never crashing the run.

A reward that raises, exceeds ``timeout`` or returns anything but a finite real number marks
its sample ``failed`` (with a cause, see :mod:`tempering.runs.failures`): the sample stays in its
group (so counts stay honest) and the loop masks it out of the loss. Values are strict
(:func:`reward_number`): a bool counts as 0/1, but the string ``"1.0"`` or ``None`` is a
failure whose message names the type it got -- a reward that returns text has a bug, and
reading it as a number would hide it. Failures are counted in :class:`ScoreStats` and surface
in the step's metrics.

A reward's feedback in words (``RewardResult.feedback``, a mapping's ``"feedback"`` key, a
:class:`~tempering.rollouts.feedback.Scored` float's) is appended to ``Sample.feedback``, not put in
``reward_info``; feedback that is not text fails the sample (cause ``bad_feedback``).

Three ways to score:

* :meth:`RewardRunner.score` -- a list in, blocks until every sample is scored;
* ``await`` :meth:`RewardRunner.ascore` -- the same inside a running event loop;
* :meth:`RewardRunner.stream` -- an (async) iterable of samples in, scored samples out *as they
  complete*, so scoring overlaps with whatever produces the samples (a sampler that returns
  completions one by one); :meth:`RewardRunner.score_as_completed` is its blocking form.

Optional hooks a reward may define (the runner only uses them when present):

* ``max_concurrency`` (int): the most calls the reward can usefully run at once (a process
  pool's worker count). The runner then keeps at most that many calls in flight, so its
  ``timeout`` measures a call's run time, not its wait for a free worker.
* ``async aclose()``: release resources bound to the current event loop (HTTP clients). The
  runner calls it at the end of :meth:`score` / :meth:`score_as_completed`, which own their
  event loop; the reward must reopen what it needs on its next call.
* ``async score_batch(samples, policy)`` (:class:`~tempering.interfaces.PolicyReward`): a reward
  that samples the policy being trained scores the whole batch in one call, with the
  :class:`~tempering.interfaces.Policy` its caller passes (``score(samples, policy=...)``; the
  ``completion`` sampler passes the weights that sampled the batch). ``timeout`` then bounds
  the batch's call; the batch's metrics land in :attr:`ScoreStats.metrics`. Without a policy,
  or streamed one sample at a time, each sample fails with the cause ``no_policy``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
import numbers
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tempering.interfaces import Policy, PolicyReward, RewardResult
from tempering.rollouts.feedback import FEEDBACK_KEY, feedback_of, join_feedback
from tempering.runs.failures import debug, mark_failed, raised
from tempering.types import Sample

T = TypeVar("T")


class RewardValueError(ValueError):
    """A reward returned something that is not a finite real number; ``cause`` is
    ``not_a_number`` or ``not_finite``."""

    def __init__(self, message: str, cause: str) -> None:
        super().__init__(message)
        self.cause = cause


def reward_number(value: object) -> float:
    """``value`` as a reward: a finite real number (int, float, a numpy scalar, a Fraction; a
    bool counts as 0/1), else :class:`RewardValueError` naming what it got."""
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, numbers.Real):
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise RewardValueError(f"returned {shown} of type {type(value).__name__}, not a real number", "not_a_number")
    x = float(value)
    if not math.isfinite(x):
        raise RewardValueError(f"returned {value!r} (not a finite number)", "not_finite")
    return x


@dataclass
class ScoreStats:
    scored: int = 0
    failed: int = 0
    timeouts: int = 0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)
    #: a :class:`~tempering.interfaces.PolicyReward`'s own metrics for the batch
    metrics: dict[str, float] = field(default_factory=dict)

    def as_metrics(self) -> dict[str, float]:
        return {
            "reward/failed": float(self.failed),
            "reward/timeouts": float(self.timeouts),
            "reward/seconds": self.seconds,
        }


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

    # ------------------------------------------------------------------ batch
    def score(self, samples: Iterable[Sample], policy: Policy | None = None) -> ScoreStats:
        """Score in place; blocks until every sample has a reward or a recorded failure.
        ``policy``: the weights that sampled ``samples``, for a reward that samples them too
        (:class:`~tempering.interfaces.PolicyReward`); other rewards ignore it."""
        samples = list(samples)
        if not isinstance(self.reward, PolicyReward) and not _is_async(self.reward):
            return self._score_sync(samples)

        async def owned() -> ScoreStats:
            try:
                return await self.ascore(samples, policy)
            finally:
                await _aclose(self.reward)

        return run_coroutine(owned())

    def _score_sync(self, samples: list[Sample]) -> ScoreStats:
        stats = ScoreStats()
        t0 = time.perf_counter()
        for s in samples:
            try:
                value = self.reward(s.completion.text, s.example)
                if inspect.isawaitable(value):  # a sync callable that returned a coroutine
                    value = run_coroutine(self._with_timeout(value))
                self._apply(s, value, stats)
            except (asyncio.TimeoutError, TimeoutError) as exc:
                self._timeout(s, exc, stats)
            except Exception as exc:  # a reward bug must not kill the run
                if debug():
                    raise  # TEMPERING_DEBUG: the first failure ends the run in its own traceback
                self._fail(s, raised(exc), f"{type(exc).__name__}: {exc}", stats, exc)
        stats.seconds = time.perf_counter() - t0
        return stats

    async def ascore(self, samples: Iterable[Sample], policy: Policy | None = None) -> ScoreStats:
        """:meth:`score` inside a running event loop. A sync reward is called inline, one sample
        after the other, as :meth:`score` does (no task per sample for what cannot overlap)."""
        if isinstance(self.reward, PolicyReward):
            return await self._score_batch(list(samples), self.reward, policy)
        if not _is_async(self.reward):
            return self._score_sync(list(samples))
        stats = ScoreStats()
        t0 = time.perf_counter()
        sem = asyncio.Semaphore(self._limit())

        async def one(s: Sample) -> None:
            async with sem:
                await self._score_one(s, stats)

        await asyncio.gather(*(one(s) for s in samples))
        stats.seconds = time.perf_counter() - t0
        return stats

    async def _score_batch(self, samples: list[Sample], reward: PolicyReward, policy: Policy | None) -> ScoreStats:
        """A :class:`~tempering.interfaces.PolicyReward`'s one call for the whole batch. The call
        failing (raising, timing out, a result count that is not the batch's) fails every
        sample; a result that is an exception fails its own sample only."""
        stats = ScoreStats()
        t0 = time.perf_counter()
        if policy is None:
            for s in samples:
                self._no_policy(s, stats)
            return stats
        try:
            scored = await self._with_timeout(reward.score_batch(samples, policy))
            if len(scored.results) != len(samples):
                raise ValueError(f"score_batch returned {len(scored.results)} results for {len(samples)} samples")
        except (asyncio.TimeoutError, TimeoutError) as exc:
            for s in samples:
                self._timeout(s, exc, stats)
        except Exception as exc:
            if debug():
                raise
            for s in samples:
                self._fail(s, raised(exc), f"{type(exc).__name__}: {exc}", stats, exc)
        else:
            for s, value in zip(samples, scored.results):
                if isinstance(value, BaseException):
                    self._fail(s, raised(value), f"{type(value).__name__}: {value}", stats, value)
                else:
                    self._apply(s, value, stats)
            stats.metrics.update(scored.metrics)
        stats.seconds = time.perf_counter() - t0
        return stats

    def _no_policy(self, s: Sample, stats: ScoreStats) -> None:
        name = getattr(self.reward, "__name__", None) or type(self.reward).__name__
        self._fail(
            s,
            "no_policy",
            f"reward {name} samples the policy being trained, and nothing gave it the policy here: "
            "use it as the reward of an RL stage (or its eval) with the completion sampler",
            stats,
        )

    # ------------------------------------------------------------------ streaming
    async def stream(
        self, samples: AsyncIterable[Sample] | Iterable[Sample], stats: ScoreStats | None = None
    ) -> AsyncIterator[Sample]:
        """Score each sample as soon as it arrives; yield samples in the order they finish.

        ``samples`` may be an async iterable (a producer that yields completions as a sampler
        returns them) or a plain iterable. At most ``concurrency`` (or the reward's
        ``max_concurrency``) are scored at once; the producer is not read further ahead than
        that (backpressure). Failures are recorded on the sample, as with :meth:`score`; pass
        ``stats`` to have them counted there (``stats.seconds`` is the stream's wall time).
        An exception raised by the producer itself propagates after in-flight samples are
        cancelled.
        """
        stats = stats if stats is not None else ScoreStats()
        t0 = time.perf_counter()
        sem = asyncio.Semaphore(self._limit())
        finished: asyncio.Queue[Any] = asyncio.Queue()
        tasks: set[asyncio.Task[None]] = set()
        in_flight = 0

        async def one(s: Sample) -> None:
            try:
                await self._score_one(s, stats)
            finally:
                sem.release()
                finished.put_nowait(s)

        async def feed() -> None:
            nonlocal in_flight
            try:
                if isinstance(samples, AsyncIterable):
                    async for s in samples:
                        await sem.acquire()
                        in_flight += 1
                        tasks.add(asyncio.ensure_future(one(s)))
                else:
                    for s in samples:
                        await sem.acquire()
                        in_flight += 1
                        tasks.add(asyncio.ensure_future(one(s)))
                finished.put_nowait(_FEED_DONE)
            except Exception as exc:  # noqa: BLE001 - re-raised in the consumer
                finished.put_nowait(_FeedError(exc))

        feeder = asyncio.ensure_future(feed())
        feed_done = False
        try:
            while not (feed_done and in_flight == 0):
                item = await finished.get()
                if item is _FEED_DONE:
                    feed_done = True
                elif isinstance(item, _FeedError):
                    raise item.error
                else:
                    in_flight -= 1
                    stats.seconds = time.perf_counter() - t0
                    yield item
        finally:
            feeder.cancel()
            for task in tasks:
                task.cancel()
            await asyncio.gather(feeder, *tasks, return_exceptions=True)
            stats.seconds = time.perf_counter() - t0

    def score_as_completed(
        self,
        samples: AsyncIterable[Sample] | Iterable[Sample],
        on_scored: Callable[[Sample], Any] | None = None,
    ) -> ScoreStats:
        """Blocking form of :meth:`stream`: score samples as they arrive, call ``on_scored``
        with each one as it finishes, return the counts once the producer is exhausted."""

        async def main() -> ScoreStats:
            stats = ScoreStats()
            try:
                async for s in self.stream(samples, stats):
                    if on_scored is not None:
                        out = on_scored(s)
                        if inspect.isawaitable(out):
                            await out
            finally:
                await _aclose(self.reward)
            return stats

        return run_coroutine(main())

    async def aclose(self) -> None:
        """Release the reward's loop-bound resources (its ``aclose``), if it has any."""
        await _aclose(self.reward)

    # ------------------------------------------------------------------ one sample
    def _limit(self) -> int:
        hint = getattr(self.reward, "max_concurrency", None)
        limit = max(1, int(self.concurrency))
        if isinstance(hint, int) and hint > 0:
            limit = min(limit, hint)
        return limit

    async def _with_timeout(self, value: Awaitable[T]) -> T:
        return await asyncio.wait_for(value, self.timeout)

    async def _score_one(self, s: Sample, stats: ScoreStats) -> None:
        """Score one sample; never raises (except cancellation)."""
        if isinstance(self.reward, PolicyReward):  # it scores whole batches, with their policy
            self._no_policy(s, stats)
            return
        try:
            value = self.reward(s.completion.text, s.example)
            if inspect.isawaitable(value):
                value = await self._with_timeout(value)
            self._apply(s, value, stats)
        except (asyncio.TimeoutError, TimeoutError) as exc:
            self._timeout(s, exc, stats)
        except Exception as exc:
            if debug():
                raise  # TEMPERING_DEBUG: the first failure ends the run in its own traceback
            self._fail(s, raised(exc), f"{type(exc).__name__}: {exc}", stats, exc)

    def _apply(self, s: Sample, value: Any, stats: ScoreStats) -> None:
        """Record a reward's return on ``s``: the number, its ``info`` (``reward_info``) and its
        feedback, appended to what the sample already has (an episode's turns said theirs)."""
        try:
            feedback = feedback_of(value)
        except TypeError as exc:
            self._fail(s, "bad_feedback", str(exc), stats)
            return
        info: dict[str, Any] = {}
        if isinstance(value, RewardResult):
            value, info = value.reward, value.info
        elif isinstance(value, dict):
            info = {k: v for k, v in value.items() if k not in ("reward", FEEDBACK_KEY)}
            value = value.get("reward")
        try:
            number = reward_number(value)
        except RewardValueError as exc:
            self._fail(s, exc.cause, f"reward {exc}", stats)
            return
        s.reward, s.reward_info, s.failed, s.error = number, info, False, None
        s.feedback = join_feedback([s.feedback, feedback])
        stats.scored += 1

    def _timeout(self, s: Sample, exc: BaseException, stats: ScoreStats) -> None:
        stats.timeouts += 1
        self._fail(s, "timeout", str(exc) or f"timed out after {self.timeout}s", stats)
        s.reward_info["timeout"] = True  # counted per sample, wherever the sample goes

    def _fail(self, s: Sample, cause: str, message: str, stats: ScoreStats, exc: BaseException | None = None) -> None:
        mark_failed(s, cause, message, exc)
        stats.failed += 1
        if len(stats.errors) < self.max_logged_errors:
            stats.errors.append(message)


_FEED_DONE = object()


@dataclass
class _FeedError:
    error: BaseException


def run_coroutine(coro: Awaitable[T]) -> T:
    """``asyncio.run(coro)``, also from code that already runs inside an event loop (a
    notebook, an async trainer): then the coroutine runs on a fresh loop in a helper thread.

    The result is handed back through a box, not as the main task's result: on the main
    thread, Python 3.11's ``asyncio.run`` ends with ``signal.getsignal(SIGINT)``, which builds
    (and drops) an error message holding ``repr(main task)`` -- and with it the repr of the
    task's result. For a batch of rollouts that repr is every token of every sample: 4 ms of a
    250 ms GRPO step on the tiny model, more the larger the batch."""
    box: list[T] = []

    async def boxed() -> None:
        box.append(await coro)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(boxed())
    else:
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tempering-reward") as pool:
            pool.submit(asyncio.run, boxed()).result()
    return box[0]


async def _aclose(reward: object) -> None:
    close = getattr(reward, "aclose", None)
    if close is None:
        return
    try:
        out = close()
        if inspect.isawaitable(out):
            await out
    except Exception:  # noqa: BLE001 - cleanup must not turn a scored batch into an error
        pass


def _is_async(fn: object) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))
