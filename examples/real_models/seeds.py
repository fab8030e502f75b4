"""Run a recipe over several seeds and print its held-out accuracy per seed, with the range.

    python examples/real_models/seeds.py smollm2_math --seeds 0 1 2
    python examples/real_models/seeds.py examples/real_models/smollm2_sft_json.yaml --seeds 0 1 \\
        --after '{name: math_questions, split: test, size: 100}' --after-reward math_answer

Each seed runs as ``tempering run RECIPE seed=S output_dir=runs/<name>_s<S>`` (plus any
``--set key=value`` overrides), one after the other, with its wall time. The table shows every
held-out evaluation the recipe logged (``eval/accuracy`` by stage and step) and the mean training
reward over the first and last quarter of RL steps. ``--after`` scores each finished run on a
second dataset with ``tempering eval`` (e.g. what a model could already do, to measure
forgetting); repeat ``--after`` (each with its ``--after-reward``) for several. The numbers in
docs/real-models.md and docs/systems.md were measured with this script.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from typing import Any


def read_rows(run_dir: str) -> list[dict[str, Any]]:
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def summarise(rows: list[dict[str, Any]]) -> dict[str, float]:
    """``eval@<stage>:<step>`` accuracies and ``reward first/last quarter`` of each RL stage."""
    out: dict[str, float] = {}
    rewards: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        if "eval/accuracy" in row:
            out[f"eval@{row.get('stage')}:{row.get('step')}"] = float(row["eval/accuracy"])
        elif "reward/mean" in row:
            rewards[str(row.get("stage"))].append(float(row["reward/mean"]))
    for stage, values in rewards.items():
        q = max(1, len(values) // 4)
        out[f"reward {stage} first {q}"] = sum(values[:q]) / q
        out[f"reward {stage} last {q}"] = sum(values[-q:]) / q
    return out


def after_eval(run_dir: str, dataset: str, reward: str | None, max_tokens: int, index: int = 0) -> float:
    out = os.path.join(run_dir, "evals", "after" if index == 0 else f"after{index + 1}")
    cmd = [
        sys.executable,
        "-m",
        "tempering",
        "eval",
        run_dir,
        "--dataset",
        dataset,
        "--max-tokens",
        str(max_tokens),
        "--out",
        out,
    ]
    if reward:
        cmd += ["--reward", reward]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "eval.json"), encoding="utf-8") as fh:
        metrics = json.load(fh)["metrics"]
    return float(metrics.get("accuracy", metrics.get("eval/accuracy", float("nan"))))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", help="a bundled recipe name or a YAML path")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a recipe override")
    parser.add_argument("--name", help="run folder prefix (default: the recipe's file name)")
    parser.add_argument(
        "--after", action="append", default=[], help="dataset scored with `tempering eval` after each run (repeatable)"
    )
    parser.add_argument(
        "--after-reward",
        action="append",
        default=[],
        help="reward for the --after of the same position (default: the recipe's)",
    )
    parser.add_argument("--after-max-tokens", type=int, default=16)
    parser.add_argument("--skip-existing", action="store_true", help="summarise finished runs again without rerunning")
    args = parser.parse_args(argv)

    name = args.name or os.path.splitext(os.path.basename(args.recipe))[0]
    table: dict[int, dict[str, float]] = {}
    for seed in args.seeds:
        run_dir = os.path.join("runs", f"{name}_s{seed}")
        t0 = time.perf_counter()
        if not (args.skip_existing and os.path.exists(os.path.join(run_dir, "metrics.jsonl"))):
            cmd = [
                sys.executable,
                "-m",
                "tempering",
                "run",
                args.recipe,
                f"seed={seed}",
                f"output_dir={run_dir}",
                *args.set,
            ]
            print("$", " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)
        summary = summarise(read_rows(run_dir))
        summary["minutes"] = (time.perf_counter() - t0) / 60
        for i, dataset in enumerate(args.after):
            reward = args.after_reward[i] if i < len(args.after_reward) else None
            key = "after" if len(args.after) == 1 else f"after {i + 1}"
            summary[key] = after_eval(run_dir, dataset, reward, args.after_max_tokens, i)
        table[seed] = summary
        print(f"seed {seed}: " + ", ".join(f"{k} {v:.3f}" for k, v in summary.items()), flush=True)

    keys = list(dict.fromkeys(k for s in table.values() for k in s))
    print(f"\n{'':32}" + "".join(f"{'seed ' + str(s):>9}" for s in table) + f"{'range':>15}")
    for key in keys:
        values = [table[s].get(key, float("nan")) for s in table]
        print(f"{key:32}" + "".join(f"{v:9.3f}" for v in values) + f"{min(values):7.2f}-{max(values):.2f}")


if __name__ == "__main__":
    main()
