"""Wall-clock per optimizer step: synchronous vs asynchronous (off-policy) RL, side by side.

Same model (the tiny Llama of the CPU demo, untrained: timing only), same data, same reward:
exact match after burning ``--burn-ms`` of CPU per sample (a busy loop, like a real checker),
run in a ``process_pool`` reward so it does not hold the trainer's GIL. Configurations:

1. ``grpo``       -- the synchronous GRPO stage: sample the batch, score it, train.
2. ``async k=0``  -- the ``offpolicy`` stage with ``stale: {max_steps_off_policy: 0}``: the same loop as
   below but the producer waits for the new weights after every step (on-policy, synchronous;
   a chunk's rewards still overlap the next chunk's sampling).
3. ``async k=1``, ``async k=3`` -- sampling and scoring of the next batches overlap training.

Ideal speedup of overlapping two phases that took ``S`` (sample + reward) and ``T`` (train)
when run one after the other: ``(S + T) / max(S, T)``; the measured speedup is the sync step
time over the async one. ``S`` and ``T`` are measured in the synchronous ``grpo`` run
(``time/sample + time/reward`` and ``time/train``).

The local backend runs training on one thread and sampling (``sampling_client``) on a second
one with its own model copy; ``torch.set_num_threads(1)`` (``num_threads: 1``) keeps each to
one core so that the two really run side by side. This machine's cores may be shared: the
load average is printed before and after.

Run: ``python benchmarks/async_vs_sync.py [--steps 12] [--burn-ms 3] [--workers 1]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Mapping
from typing import Any

os.environ.setdefault("TEMPERING_PROGRESS", "0")


BURN_ENV = "TEMPERING_BENCH_BURN_MS"  # read in the reward's worker processes (they inherit it)


def burn_exact_match(completion: str, example: Mapping[str, Any]) -> float:
    """Exact match after ``$TEMPERING_BENCH_BURN_MS`` ms of busy CPU (runs in the workers)."""
    from tempering.plugins.rewards.testing import burn_cpu

    burn_cpu(float(os.environ.get(BURN_ENV, "0")))
    return 1.0 if completion.strip() == str(example["answer"]).strip() else 0.0


def run_config(label: str, stage: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    from tempering.plugins.backends.local.backend import LocalBackend
    from tempering.plugins.rewards.pool import ProcessPoolReward
    from tempering.training.recipe import Recipe

    os.environ[BURN_ENV] = str(args.burn_ms)
    data = {"name": "arithmetic", "split": "train"}
    reward = ProcessPoolReward(reward=burn_exact_match, workers=args.workers, timeout=60.0)
    backend = LocalBackend(model="tiny_llama", num_threads=1, seed=0)
    common = {
        "dataset": data,
        "reward": reward,
        "steps": args.steps,
        "prompts_per_step": args.prompts,
        "group_size": args.group_size,
        "max_tokens": 4,
        "optimizer": {"learning_rate": 1e-4},
    }
    recipe = Recipe(
        name=label,
        output_dir=os.path.join(args.out, label.replace(" ", "_").replace("=", "")),
        loggers=[],
        resume=False,
        stages=[{**common, **stage}],
    )
    t0 = time.perf_counter()
    try:
        result = recipe.run(backend=backend)
    finally:
        backend.close()
    wall = time.perf_counter() - t0
    rows = [h for h in result.history if "reward/mean" in h][args.warmup :]
    times = [h["time"] for h in result.history if "reward/mean" in h]
    step_times = [b - a for a, b in zip(times, times[1:])][max(args.warmup - 1, 0) :]
    out: dict[str, Any] = {
        "label": label,
        "step_s": statistics.mean(step_times),
        "step_s_median": statistics.median(step_times),
        "wall_s": wall,
        "steps_timed": len(step_times),
    }
    if stage["name"] == "grpo":
        out["sample_s"] = statistics.mean(h["time/sample"] + h["time/reward"] for h in rows)
        out["sampling_only_s"] = statistics.mean(h["time/sample"] for h in rows)
        out["reward_only_s"] = statistics.mean(h["time/reward"] for h in rows)
        out["train_s"] = statistics.mean(h["time/train"] for h in rows)
    else:
        out["wait_s"] = statistics.mean(h["time/wait_rollouts"] for h in rows)
        out["train_s"] = statistics.mean(h["time/train"] for h in rows)
        out["staleness"] = statistics.mean(h["offpolicy/staleness_mean"] for h in rows)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per configuration")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the timing")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--burn-ms", type=float, default=3.0, help="CPU per sample in the reward")
    parser.add_argument("--workers", type=int, default=1, help="reward worker processes")
    parser.add_argument("--groups-per-sample", type=int, default=16, help="prompts per sample call (async)")
    parser.add_argument("--rounds", type=int, default=1, help="repeat every configuration, interleaved; report medians")
    parser.add_argument("--only", default="", help="comma-separated subset of: grpo,k0,k1,k3")
    parser.add_argument("--out", default="runs/bench_async_vs_sync")
    parser.add_argument("--json", default="", help="also write the results here")
    args = parser.parse_args()

    print(f"load average before: {os.getloadavg()}  cpus: {os.cpu_count()}  python {sys.version.split()[0]}")
    print(
        f"{args.prompts} prompts x {args.group_size} samples per step, reward burns {args.burn_ms} ms/sample "
        f"in {args.workers} worker process(es), {args.steps} steps ({args.warmup} warm-up left out)"
    )
    off = {"name": "offpolicy", "loss": "clipped_is"}
    stale = {"groups_per_sample": args.groups_per_sample}
    configs = {
        "grpo": ("sync grpo", {"name": "grpo", "loss": {"name": "grpo", "loss_type": "dapo"}, "log_kl": False}),
        "k0": ("async k=0", {**off, "stale": {**stale, "max_steps_off_policy": 0}}),
        "k1": ("async k=1", {**off, "stale": {**stale, "max_steps_off_policy": 1}}),
        "k3": ("async k=3", {**off, "stale": {**stale, "max_steps_off_policy": 3}}),
    }
    chosen = [c for c in (args.only.split(",") if args.only else configs) if c]
    runs: dict[str, list[dict[str, Any]]] = {key: [] for key in chosen}
    for r in range(args.rounds):  # interleaved, so that a change in the machine's load hits all alike
        for key in chosen:
            label, stage = configs[key]
            res = run_config(label, stage, args)
            runs[key].append(res)
            print(
                f"  round {r + 1}: {label:10s} {res['step_s']:.3f} s/step (median {res['step_s_median']:.3f}) "
                f"load {os.getloadavg()[0]:.2f}",
                flush=True,
            )
    results = []
    for key in chosen:
        rs = runs[key]
        merged = {k: statistics.median(r[k] for r in rs) for k in rs[0] if isinstance(rs[0][k], float)}
        results.append({"label": rs[0]["label"], **merged, "rounds": [r["step_s"] for r in rs]})

    base = next((r for r in results if r["label"] == "sync grpo"), None)
    print()
    if base is not None:
        s, t = base["sample_s"], base["train_s"]
        ideal = (s + t) / max(s, t)
        print(
            f"sync phases: sample+reward S = {s:.3f} s (sampling {base['sampling_only_s']:.3f} + reward "
            f"{base['reward_only_s']:.3f}), train T = {t:.3f} s -> ideal speedup (S+T)/max(S,T) = {ideal:.2f}x"
        )
    print(
        f"{'config':10s} {'s/step':>8s} {'speedup':>8s} {'of ideal gain':>13s} "
        f"{'staleness':>9s} {'trainer wait':>12s} {'train':>7s}"
    )
    for r in results:
        speed = base["step_s"] / r["step_s"] if base else float("nan")
        frac = (speed - 1) / (ideal - 1) if base and ideal > 1 else float("nan")
        stale = f"{r['staleness']:.2f}" if "staleness" in r else "-"
        wait = f"{r['wait_s']:.3f}" if "wait_s" in r else "-"
        print(
            f"{r['label']:10s} {r['step_s']:8.3f} {speed:7.2f}x {frac:12.0%} {stale:>9s} {wait:>12s} "
            f"{r['train_s']:7.3f}   rounds: {', '.join(f'{x:.3f}' for x in r['rounds'])}"
        )
        r["speedup"], r["fraction_of_ideal_gain"] = speed, frac
    print(f"\nload average after: {os.getloadavg()}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"args": vars(args), "ideal": ideal if base else None, "results": results}, fh, indent=2)


if __name__ == "__main__":
    main()
