"""The ``sandbox`` reward's cost per call: a bare interpreter start, then one call at a time
and a batch of calls side by side, under bubblewrap and under the weaker ``rlimits`` fallback.

Each call runs a correct 4-assert program (``add``); the median and 90th percentile of ``--n``
calls one after another (after a warm-up), then ``--batch`` calls through the reward runner
with ``--workers`` at once. The numbers in docs/sandbox.md come from this script.

Run: ``python benchmarks/sandbox_overhead.py [--n 20] [--batch 32] [--workers 2]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import time

from tempering.plugins.rewards.sandbox.reward import Sandbox
from tempering.rollouts.scoring import RewardRunner
from tempering.types import Completion, Sample

PROGRAM = "```python\ndef add(a, b):\n    return a + b\n```"
EXAMPLE = {
    "tests": ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add(0, 0) == 0", "assert add(1, 9) == 10"]
}


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    def bare() -> float:
        t = time.perf_counter()
        subprocess.run(["/usr/bin/python3", "-I", "-S", "-c", "pass"], check=True)
        return time.perf_counter() - t

    bare()
    print(f"bare python3 -I -S start: median {ms(statistics.median(bare() for _ in range(args.n)))}")
    for isolation in ("bubblewrap", "rlimits"):
        reward = Sandbox(isolation=isolation, workers=args.workers)
        asyncio.run(reward(PROGRAM, EXAMPLE))
        times = []
        for _ in range(args.n):
            t = time.perf_counter()
            result = asyncio.run(reward(PROGRAM, EXAMPLE))
            times.append(time.perf_counter() - t)
            assert result.reward == 1.0, result
        p90 = sorted(times)[int(0.9 * (len(times) - 1))]
        print(f"{isolation}: one call median {ms(statistics.median(times))}, p90 {ms(p90)}")
        batch = [Sample(example=EXAMPLE, completion=Completion([], [], [], text=PROGRAM)) for _ in range(args.batch)]
        t = time.perf_counter()
        RewardRunner(reward).score(batch)
        took = time.perf_counter() - t
        print(f"{isolation}: {args.batch} calls, workers={args.workers}: {took:.2f} s ({ms(took / args.batch)} a call)")


if __name__ == "__main__":
    main()
