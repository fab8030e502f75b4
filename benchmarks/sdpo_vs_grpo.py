"""SDPO vs GRPO where most rollouts fail but the feedback is informative (issue 23 item 6).

The bundled ``sdpo_feedback`` recipe (core/recipes/sdpo_feedback.yaml): a tiny Llama, an SFT
warmup on addition of numbers 0-29 -- half of its rows with ``exact_match``'s feedback on a wrong
earlier answer in front, so the model learns to read it -- stopped at 15% held-out accuracy,
then 30 RL steps of 16 prompts x 8 samples with the ``exact_match`` reward. ``sdpo``: the
recipe as it is (GRPO's loss blended 50/50 with self-distillation from the model re-prompted
with each failed sample's feedback, full distributions, forward KL). ``grpo``: the same stage
without the distillation (the same loss, steps, samples, learning rate). Same seed, same
warmup for both. Held-out accuracy (200 sums never trained on, greedy) after the warmup and
after RL; each run in a process of its own, one at a time, one thread.

``--recipe smollm2``: the same comparison on the real pretrained model,
``examples/real_models/smollm2_sdpo.yaml`` (SmolLM2-135M-Instruct with LoRA on ``math_questions``,
successful siblings as the teacher's context, top-100 JSD; no warmup, so "after warmup" is the
base model), 10 steps of 4 prompts x 8 samples by default, 6-9 minutes a run.

Run: ``python benchmarks/sdpo_vs_grpo.py [--recipe sdpo_feedback|smollm2] [--seeds 0 1 2]
[--only sdpo|grpo] [--steps N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import yaml

os.environ.setdefault("TEMPERING_PROGRESS", "0")


def sdpo_only_keys() -> set[str]:
    """The ``sdpo`` stage's keys that ``grpo`` does not have (its own and the stale ones), dropped
    for the GRPO run: taken from the two stages' fields, so a key added to either stays right."""
    import dataclasses

    from tempering.algorithms.grpo.algorithm import GRPO
    from tempering.algorithms.sdpo.algorithm import SDPO

    return {f.name for f in dataclasses.fields(SDPO)} - {f.name for f in dataclasses.fields(GRPO)}


#: The recipes compared: where the SDPO recipe is, and its default number of RL steps.
RECIPES = {
    "sdpo_feedback": ("bundled", 30),
    "smollm2": (os.path.join(os.path.dirname(__file__), "..", "examples", "real_models", "smollm2_sdpo.yaml"), 10),
}


def load_spec(name: str) -> dict[str, Any]:
    """The SDPO recipe ``name`` (:data:`RECIPES`) as a dict."""
    where = RECIPES[name][0]
    if where == "bundled":
        from tempering import recipes

        spec: dict[str, Any] = getattr(recipes, name)()
        return spec
    with open(where, encoding="utf-8") as f:
        loaded: dict[str, Any] = yaml.safe_load(f)
        return loaded


def recipe(
    algo: str, seed: int, out: str, steps: int, overrides: dict[str, Any] | None = None, name: str = "sdpo_feedback"
) -> dict[str, Any]:
    """Recipe ``name`` for ``algo`` (``sdpo`` as written, ``grpo`` without distillation)."""
    spec = load_spec(name)
    spec.update(seed=seed, output_dir=out, loggers=["jsonl"])
    rl = spec["stages"][-1]
    rl["steps"] = steps
    rl.update(overrides or {})
    if algo == "grpo":
        rl["name"] = "grpo"
        for key in sdpo_only_keys():
            rl.pop(key, None)
    return spec


def run_one(algo: str, seed: int, steps: int, overrides: dict[str, Any], name: str) -> dict[str, Any]:
    """One run (called in a child process): accuracies after the warmup and after RL."""
    from tempering.training.recipe import Recipe

    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        result = Recipe(**recipe(algo, seed, out, steps, overrides, name), resume=False).run()
        evals = [h for h in result.history if "eval/accuracy" in h and h.get("stage") == "rl"]
        rl = [h for h in result.history if "reward/mean" in h]
        return {  # the RL stage evaluates at its start (= after the warmup), every 10 steps and at the end
            "algo": algo,
            "seed": seed,
            "after_warmup": evals[0]["eval/accuracy"],
            "after_rl": evals[-1]["eval/accuracy"],
            "evals": [round(h["eval/accuracy"], 3) for h in evals],
            "train_reward_last10": statistics.mean(h["reward/mean"] for h in rl[-10:]),
            "seconds": time.perf_counter() - t0,
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--only", choices=("sdpo", "grpo"))
    parser.add_argument("--recipe", choices=sorted(RECIPES), default="sdpo_feedback")
    parser.add_argument("--steps", type=int, help="RL steps (default: 30 for sdpo_feedback, 10 for smollm2)")
    parser.add_argument("--set", default="{}", help="JSON overrides of the RL stage (e.g. a broken learning rate)")
    parser.add_argument("--child", nargs=2, metavar=("ALGO", "SEED"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    overrides = json.loads(args.set)
    steps = args.steps or RECIPES[args.recipe][1]
    if args.child:
        print(json.dumps(run_one(args.child[0], int(args.child[1]), steps, overrides, args.recipe)))
        return 0
    print(f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
    rows = []
    for seed in args.seeds:
        for algo in [args.only] if args.only else ["sdpo", "grpo"]:
            cmd = [sys.executable, __file__, "--child", algo, str(seed), "--steps", str(steps), "--set", args.set]
            cmd += ["--recipe", args.recipe]
            out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            if out.returncode:
                print(out.stderr[-2000:], file=sys.stderr)
                return out.returncode
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    print("| algo | seed | held-out after warmup | after RL | change | train reward (last 10 steps) | seconds |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['algo']} | {r['seed']} | {r['after_warmup']:.3f} | {r['after_rl']:.3f} | "
            f"{r['after_rl'] - r['after_warmup']:+.3f} | {r['train_reward_last10']:.3f} | {r['seconds']:.0f} |"
        )
    for algo in sorted({r["algo"] for r in rows}):
        ours = [r for r in rows if r["algo"] == algo]
        print(
            f"{algo}: after RL mean {statistics.mean(r['after_rl'] for r in ours):.3f} "
            f"(range {min(r['after_rl'] for r in ours):.3f}-{max(r['after_rl'] for r in ours):.3f}), change mean "
            f"{statistics.mean(r['after_rl'] - r['after_warmup'] for r in ours):+.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
