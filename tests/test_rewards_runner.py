"""RewardRunner: failure semantics (raise, NaN, timeout), the streaming API and its hooks."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from tempering.interfaces import RewardResult
from tempering.rollouts.scoring import RewardRunner, ScoreStats
from tempering.types import Completion, Sample


def mk(texts, **example) -> list[Sample]:
    return [Sample(example=dict(example), completion=Completion([], [], [], text=t)) for t in texts]


# --------------------------------------------------------------------------- failures
def test_sync_failures_are_recorded_and_counted():
    def reward(c, e):
        if c == "raise":
            raise ValueError("bad checker")
        if c == "nan":
            return math.nan
        if c == "inf":
            return RewardResult(math.inf)
        if c == "dict":
            return {"reward": 0.25, "why": "partial"}
        return 1.0

    ss = mk(["ok", "raise", "nan", "inf", "dict"])
    stats = RewardRunner(reward).score(ss)
    assert (stats.scored, stats.failed, stats.timeouts) == (2, 3, 0)
    assert [s.failed for s in ss] == [False, True, True, True, False]
    assert "ValueError: bad checker" in ss[1].error and "nan" in ss[2].error and "inf" in ss[3].error
    assert ss[4].reward == 0.25 and ss[4].reward_info == {"why": "partial"}
    assert all(s.reward == 0.0 for s in ss[1:4])
    assert stats.as_metrics()["reward/failed"] == 3.0


def test_async_timeout_is_a_counted_failure_and_others_finish():
    async def reward(c, e):
        await asyncio.sleep(5 if c == "slow" else 0.01)
        return 1.0

    ss = mk(["a", "slow", "b"])
    t0 = time.perf_counter()
    stats = RewardRunner(reward, timeout=0.2).score(ss)
    assert time.perf_counter() - t0 < 2.0
    assert (stats.scored, stats.failed, stats.timeouts) == (2, 1, 1)
    assert ss[1].failed and "timed out after 0.2s" in ss[1].error


def test_score_works_inside_a_running_event_loop():
    async def reward(c, e):
        return 2.0

    async def main() -> ScoreStats:
        ss = mk(["x"])
        stats = RewardRunner(reward).score(ss)  # would be asyncio.run() inside a loop
        assert ss[0].reward == 2.0
        return stats

    assert asyncio.run(main()).scored == 1


def test_max_concurrency_hint_and_aclose_hook():
    class Limited:
        max_concurrency = 2

        def __init__(self):
            self.now = self.peak = 0
            self.closed = 0

        async def __call__(self, c, e):
            self.now += 1
            self.peak = max(self.peak, self.now)
            await asyncio.sleep(0.02)
            self.now -= 1
            return 1.0

        async def aclose(self):
            self.closed += 1

    r = Limited()
    stats = RewardRunner(r, concurrency=64).score(mk(["x"] * 8))
    assert stats.scored == 8 and r.peak == 2 and r.closed == 1


# --------------------------------------------------------------------------- streaming
async def producer(n: int, gap: float, log: list[str] | None = None):
    for i in range(n):
        await asyncio.sleep(gap)
        if log is not None:
            log.append(f"in{i}")
        yield Sample(example={"i": i}, completion=Completion([], [], [], text=str(i)))


def test_stream_scores_as_samples_arrive_and_yields_as_completed():
    log: list[str] = []

    async def reward(c, e):  # later samples finish faster: completion order != arrival order
        await asyncio.sleep(0.15 if e["i"] == 0 else 0.01)
        return float(e["i"])

    async def main():
        runner = RewardRunner(reward)
        stats = ScoreStats()
        out = []
        async for s in runner.stream(producer(4, 0.03, log), stats):
            log.append(f"out{s.example['i']}")
            out.append(s)
        return out, stats

    out, stats = asyncio.run(main())
    assert stats.scored == 4 and stats.failed == 0
    assert [s.reward for s in out] == [1.0, 2.0, 3.0, 0.0]  # sample 0 was slowest
    # scoring overlapped with production: sample 1 came out before sample 3 went in
    assert log.index("out1") < log.index("in3"), log


def test_stream_backpressure_records_failures_and_accepts_plain_iterables():
    inflight = {"now": 0, "peak": 0}

    async def reward(c, e):
        inflight["now"] += 1
        inflight["peak"] = max(inflight["peak"], inflight["now"])
        await asyncio.sleep(0.01)
        inflight["now"] -= 1
        if c == "3":
            raise RuntimeError("nope")
        return 1.0

    async def main():
        stats = ScoreStats()
        got = [s async for s in RewardRunner(reward, concurrency=2).stream(mk([str(i) for i in range(6)]), stats)]
        return got, stats

    got, stats = asyncio.run(main())
    assert len(got) == 6 and inflight["peak"] == 2
    assert (stats.scored, stats.failed) == (5, 1)
    failed = [s for s in got if s.failed]
    assert len(failed) == 1 and failed[0].completion.text == "3" and "RuntimeError: nope" in failed[0].error


def test_stream_with_sync_reward_and_producer_error():
    async def broken():
        yield mk(["a"])[0]
        raise OSError("sampler died")

    async def main():
        return [s async for s in RewardRunner(lambda c, e: 1.0).stream(broken())]

    with pytest.raises(OSError, match="sampler died"):
        asyncio.run(main())


def test_score_as_completed_blocks_and_calls_back():
    seen = []

    async def reward(c, e):
        await asyncio.sleep(0.01)
        if c == "nan":
            return math.nan
        return 1.0

    stats = RewardRunner(reward).score_as_completed(producer(3, 0.005), on_scored=lambda s: seen.append(s.reward))
    assert stats.scored == 3 and sorted(seen) == [1.0, 1.0, 1.0] and stats.seconds > 0
    stats = RewardRunner(reward).score_as_completed(mk(["nan", "x"]))
    assert (stats.scored, stats.failed) == (1, 1)


# --------------------------------------------------------------------------- feedback
def test_a_rewards_feedback_goes_to_sample_feedback_not_reward_info():
    from tempering.rollouts.feedback import Scored

    def reward(c, e):
        if c == "result":
            return RewardResult(0.0, {"why": "x"}, feedback="expected '42', got '41'")
        if c == "dict":
            return {"reward": 0.5, "feedback": "  half right  ", "why": "partial"}
        if c == "scored":
            return Scored(0.0, "too long")
        if c == "empty":
            return RewardResult(1.0, feedback="")
        if c == "bad":
            return {"reward": 1.0, "feedback": 3}
        return 1.0

    ss = mk(["result", "dict", "scored", "empty", "plain", "bad"])
    stats = RewardRunner(reward).score(ss)
    assert [s.feedback for s in ss] == ["expected '42', got '41'", "half right", "too long", None, None, None]
    assert [s.reward for s in ss] == [0.0, 0.5, 0.0, 1.0, 1.0, 0.0]
    assert ss[0].reward_info == {"why": "x"} and ss[1].reward_info == {"why": "partial"}  # feedback is not info
    assert (stats.scored, stats.failed) == (5, 1)
    assert ss[5].failed and ss[5].reward_info["failure"] == "bad_feedback"
    assert ss[5].error == "reward returned feedback 3 of type int, not text or None"


def test_a_rewards_feedback_is_appended_to_what_the_sample_already_says_and_clipped():
    [s] = mk(["41"])
    s.feedback = "tool mul raised ValueError: no"  # an episode's turns said this first
    RewardRunner(lambda c, e: RewardResult(0.0, feedback="x" * 600)).score([s])
    assert s.feedback == "tool mul raised ValueError: no\n" + "x" * 497 + "..."
