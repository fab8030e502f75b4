"""Stale SDPO (k = 3) vs on-policy SDPO with a slow environment (issue 23 item 7).

The environment's answer takes 50-200 ms per sample (uniform; ``asyncio.sleep``: waiting, as a
tool call or a remote checker makes a trainer wait, not compute), then ``exact_match`` scores it
and says what was wrong ("expected '46', got '45'"). ``reward_concurrency`` samples are checked
at a time. Both runs are the bundled ``sdpo_feedback`` recipe (core/recipes/sdpo_feedback.yaml:
its SFT warmup, then SDPO from the feedback) with this slow reward in the RL stage:

1. ``on-policy``: the sdpo stage as bundled -- sample the batch, wait for its rewards, score the
   teacher, train; the next batch is sampled with the new weights.
2. ``stale k=3``: ``stale: {max_steps_off_policy: 3}`` with the stale recipe's corrections (``loss:
   clipped_is`` -- the bundled GRPO loss's PPO clip, ``|A|`` capped at 3x its running mean --
   and the distillation weight clipped to [0.5, 2]): the producer samples and waits for rewards
   of the next batches while the trainer trains (docs/sdpo.md, "Stale SDPO").

Measured: the RL stage's wall-clock to the same number of steps (``time/step`` summed over its
steps, evaluations excluded) and the held-out accuracy it reaches (200 sums, greedy). The
ideal speedup of overlapping the on-policy run's two phases, rollout ``S`` (sampling and the
environment's waiting) and training ``T`` (teacher scoring and the optimizer step), is
``(S + T) / max(S, T)``. The load average is printed before and after: this machine's cores
may be shared.

Run: ``python benchmarks/sdpo_stale_vs_onpolicy.py [--seeds 0 1] [--steps 30] [--concurrency 16]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("TEMPERING_PROGRESS", "0")

LATENCY = (0.05, 0.2)
_rng = random.Random(0)


async def slow_exact_match(completion: str, example: dict[str, Any]) -> Any:
    """``exact_match`` (with its feedback) after 50-200 ms of waiting."""
    from tempering.plugins.rewards.basic import ExactMatch

    await asyncio.sleep(_rng.uniform(*LATENCY))
    return ExactMatch()(completion, example)


STALE = {"stale": {"max_steps_off_policy": 3}, "loss": {"name": "clipped_is"}}
STALE_DISTILLATION = {"is_clip": 2.0, "is_clip_low": 0.5}


def run_one(config: str, seed: int, steps: int, concurrency: int) -> dict[str, Any]:
    """One run (in a child process): the RL stage's time per step and its held-out accuracy."""
    from tempering.recipes import sdpo_feedback
    from tempering.training.recipe import Recipe

    spec = sdpo_feedback()
    rl = spec["stages"][1]
    rl.update(steps=steps, reward=slow_exact_match, reward_concurrency=concurrency, reward_timeout=10.0)
    rl["eval"] = {**rl["eval"], "every": 0, "at_start": True}  # at the start and the end only
    if config == "stale":
        rl.update(STALE)
        rl["distillation"] = {**rl.get("distillation", {}), **STALE_DISTILLATION}
    with tempfile.TemporaryDirectory() as out:
        spec.update(seed=seed, output_dir=out, loggers=["jsonl"])
        result = Recipe(**spec, resume=False).run()
    rows = [h for h in result.history if "sdpo/signal_frac" in h]
    evals = [h["eval/accuracy"] for h in result.history if "eval/accuracy" in h and h.get("stage") == "rl"]
    keys = ("step_time", "time/rollout", "time/wait_rollouts", "time/train", "time/teacher", "offpolicy/staleness_mean")
    mean = {k: statistics.mean(r[k] for r in rows) for k in keys if all(k in r for r in rows)}
    return {
        "config": config,
        "seed": seed,
        "rl_seconds": sum(r["step_time"] for r in rows),
        "steps": len(rows),
        "before_rl": evals[-2],
        "after_rl": evals[-1],
        **{f"mean {k}": v for k, v in mean.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--concurrency", type=int, default=16, help="samples the environment checks at a time")
    parser.add_argument("--child", nargs=2, metavar=("CONFIG", "SEED"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(run_one(args.child[0], int(args.child[1]), args.steps, args.concurrency)))
        return 0
    print(f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
    rows = []
    for seed in args.seeds:
        for config in ("on-policy", "stale"):
            cmd = [
                sys.executable,
                __file__,
                "--child",
                config,
                str(seed),
                "--steps",
                str(args.steps),
                "--concurrency",
                str(args.concurrency),
            ]
            t0 = time.perf_counter()
            out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            if out.returncode:
                print(out.stderr[-3000:], file=sys.stderr)
                return out.returncode
            row = {**json.loads(out.stdout.strip().splitlines()[-1]), "process_seconds": time.perf_counter() - t0}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    print("| seed | config | RL wall-clock (s) | speedup | held-out before RL | after RL | mean staleness |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for seed in args.seeds:
        base = next(r for r in rows if r["seed"] == seed and r["config"] == "on-policy")
        for r in (x for x in rows if x["seed"] == seed):
            print(
                f"| {seed} | {r['config']} | {r['rl_seconds']:.1f} | {base['rl_seconds'] / r['rl_seconds']:.2f}x | "
                f"{r['before_rl']:.3f} | {r['after_rl']:.3f} | {r.get('mean offpolicy/staleness_mean', 0.0):.2f} |"
            )
        s, t = base.get("mean time/rollout", 0.0), base["mean time/train"] + base.get("mean time/teacher", 0.0)
        if s and t:
            ideal = (s + t) / max(s, t)
            print(f"seed {seed} on-policy: S = {s:.3f} s, T = {t:.3f} s per step, ideal speedup {ideal:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
