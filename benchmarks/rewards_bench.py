"""Reward scoring: sequential vs process pool vs streamed-as-completed, in one run.

The reward burns 50 ms of CPU per sample (a busy loop, not a sleep: it holds the GIL like a
real checker -- a sympy simplification, a unit-test runner). A batch is 64 samples.

1. ``sequential``: ``RewardRunner(reward).score(batch)``: inline, one sample after another.
2. ``process pool``: the same reward wrapped in ``process_pool`` (one worker per core).
3. Samples that *arrive over time* (a producer yields one every ``gap`` ms, as a sampler
   returning completions one by one would), scored with the process pool either
   ``after batch`` (wait for the last sample, then score all) or ``streamed``
   (``RewardRunner.score_as_completed``: each sample is scored as soon as it arrives).

Run: ``python benchmarks/rewards_bench.py [--n 64] [--ms 50] [--gaps 5,25] [--workers 0]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections.abc import AsyncIterator

from tempering.plugins.rewards.pool import ProcessPoolReward
from tempering.plugins.rewards.testing import length
from tempering.rollouts.scoring import RewardRunner, ScoreStats
from tempering.types import Completion, Sample


def make_batch(n: int, ms: float) -> list[Sample]:
    return [Sample(example={"burn_ms": ms}, completion=Completion([], [], [], text="x" * (i % 7))) for i in range(n)]


async def arriving(samples: list[Sample], gap_s: float, arrived: list[float]) -> AsyncIterator[Sample]:
    """Yield ``samples`` one every ``gap_s`` seconds (recording when each arrived)."""
    for s in samples:
        await asyncio.sleep(gap_s)
        arrived.append(time.perf_counter())
        yield s


def check(samples: list[Sample], stats) -> None:
    assert stats.failed == 0 and stats.scored == len(samples), stats
    assert all(s.reward == float(len(s.completion.text)) for s in samples)


def bench_sequential(n: int, ms: float) -> float:
    batch = make_batch(n, ms)
    t0 = time.perf_counter()
    stats = RewardRunner(length).score(batch)
    dt = time.perf_counter() - t0
    check(batch, stats)
    return dt


def bench_pool(pool: ProcessPoolReward, n: int, ms: float) -> float:
    batch = make_batch(n, ms)
    t0 = time.perf_counter()
    stats = RewardRunner(pool).score(batch)
    dt = time.perf_counter() - t0
    check(batch, stats)
    return dt


def bench_after_batch(pool: ProcessPoolReward, n: int, ms: float, gap_s: float) -> tuple[float, float]:
    """Wait for the whole batch to arrive, then score it. Returns (total, time to first result)."""
    batch = make_batch(n, ms)
    runner = RewardRunner(pool)
    first: list[float] = []

    async def main_with_first():
        t0 = time.perf_counter()
        got = [s async for s in arriving(batch, gap_s, [])]  # wait for the last sample
        stats = ScoreStats()
        async for _ in runner.stream(got, stats):  # = ascore(got), plus the first result's time
            if not first:
                first.append(time.perf_counter())
        return t0, stats

    t0, stats = asyncio.run(main_with_first())
    dt = time.perf_counter() - t0
    check(batch, stats)
    return dt, first[0] - t0


def bench_streamed(pool: ProcessPoolReward, n: int, ms: float, gap_s: float) -> tuple[float, float]:
    batch = make_batch(n, ms)
    first: list[float] = []
    t0 = time.perf_counter()
    stats = RewardRunner(pool).score_as_completed(
        arriving(batch, gap_s, []), on_scored=lambda s: first or first.append(time.perf_counter())
    )
    dt = time.perf_counter() - t0
    check(batch, stats)
    return dt, first[0] - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=64, help="samples per batch")
    ap.add_argument("--ms", type=float, default=50.0, help="CPU milliseconds per reward call")
    ap.add_argument("--gaps", default="5,25", help="producer gaps in ms (comma list)")
    ap.add_argument("--workers", type=int, default=0, help="pool workers (0 = one per core)")
    ap.add_argument("--repeats", type=int, default=2, help="best of this many runs per row")
    ap.add_argument("--json", action="store_true", help="also print the results as JSON")
    args = ap.parse_args()
    gaps = [float(g) / 1000 for g in args.gaps.split(",") if g.strip()]

    pool = ProcessPoolReward(length, workers=args.workers, timeout=60.0)
    pool.start()  # process start-up is not part of any row
    cores = os.cpu_count()
    best = lambda f: min(f() for _ in range(args.repeats))
    bestpair = lambda f: min((f() for _ in range(args.repeats)), key=lambda p: p[0])
    try:
        seq = best(lambda: bench_sequential(args.n, args.ms))
        par = best(lambda: bench_pool(pool, args.n, args.ms))
        rows = []
        for gap in gaps:
            after, after_first = bestpair(lambda gap=gap: bench_after_batch(pool, args.n, args.ms, gap))
            stream, stream_first = bestpair(lambda gap=gap: bench_streamed(pool, args.n, args.ms, gap))
            rows.append((gap, after, after_first, stream, stream_first))
    finally:
        pool.close()

    ideal = args.n * args.ms / 1000
    print(
        f"rewards_bench: {args.n} samples x {args.ms:.0f} ms CPU-bound reward, {cores} cores, "
        f"{pool.workers} pool workers, best of {args.repeats}"
    )
    print(f"  {'mode':<44} {'seconds':>8} {'ratio':>22}")
    print(f"  {'sequential (inline)':<44} {seq:8.3f} {'1.00x (ideal ' + format(ideal, '.2f') + ' s)':>22}")
    print(f"  {'process pool':<44} {par:8.3f} {format(seq / par, '.2f') + 'x faster than seq':>22}")
    for gap, after, after_first, stream, stream_first in rows:
        arrival = args.n * gap
        print(f"  arrivals every {gap * 1000:.0f} ms ({arrival:.2f} s for the batch), process pool:")
        after_cell, stream_cell = (f"first result {first:.2f} s" for first in (after_first, stream_first))
        print(f"  {'  score after the whole batch arrived':<44} {after:8.3f} {after_cell:>22}")
        print(f"  {'  streamed, scored as they arrive':<44} {stream:8.3f} {stream_cell:>22}")
        print(f"  {'  streamed vs after-batch':<44} {'':>8} {format(after / stream, '.2f') + 'x faster':>22}")
    if args.json:
        print(
            json.dumps(
                {
                    "n": args.n,
                    "ms": args.ms,
                    "cores": cores,
                    "workers": pool.workers,
                    "sequential_s": seq,
                    "pool_s": par,
                    "pool_speedup": seq / par,
                    "arrivals": [
                        {
                            "gap_ms": g * 1000,
                            "after_batch_s": a,
                            "after_first_s": af,
                            "streamed_s": s,
                            "streamed_first_s": sf,
                            "streamed_speedup": a / s,
                        }
                        for g, a, af, s, sf in rows
                    ],
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
