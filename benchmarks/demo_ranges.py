"""Run the bundled demos over several seeds and print the ranges a README may publish.

A demo's published numbers must hold across seeds and machines (a tiny model "gets" a task at a
step that depends on the seed and on the CPU's float rounding), so they are measured, not
quoted from one run: each (recipe, seed) runs as its own ``tempering run`` process on one
thread, ``--jobs`` at a time, and the table gives per seed where the warmup stopped, its
held-out accuracy there, the held-out accuracy at the end of the run and the wall time, then
the min-max range over seeds. Wall times are only comparable when ``--jobs`` does not exceed
the machine's cores (and nothing else runs).

    python benchmarks/demo_ranges.py --recipes arithmetic tool_use --seeds 0 1 2 --jobs 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Outcome:
    """What one demo run reached (``None`` where the run did not get there)."""

    recipe: str
    seed: int
    returncode: int
    wall_s: float
    warmup_steps: int | None = None
    warmup_accuracy: float | None = None
    final_accuracy: float | None = None


def run_one(recipe: str, seed: int, out: Path, overrides: list[str]) -> Outcome:
    folder = out / f"{recipe}_seed{seed}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TEMPERING_PROGRESS": "0"}
    cmd = [
        sys.executable,
        "-m",
        "tempering",
        "run",
        recipe,
        f"seed={seed}",
        f"output_dir={folder}",
        "loggers=[jsonl]",
        *overrides,
    ]
    t0 = time.perf_counter()
    with open(out / f"{recipe}_seed{seed}.log", "w", encoding="utf-8") as log:
        rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    outcome = Outcome(recipe, seed, rc, time.perf_counter() - t0)
    metrics = folder / "metrics.jsonl"
    if metrics.exists():
        read(outcome, [json.loads(line) for line in metrics.read_text(encoding="utf-8").splitlines() if line.strip()])
    return outcome


def read(outcome: Outcome, rows: list[dict[str, Any]]) -> None:
    """The first stage is the warmup: its last step and last full evaluation; the last full
    evaluation of the run is the final accuracy."""
    first = rows[0].get("stage") if rows else None
    for row in rows:
        if row.get("stage") == first:
            outcome.warmup_steps = int(row.get("step", 0)) or outcome.warmup_steps
            if "eval/accuracy" in row:
                outcome.warmup_accuracy = float(row["eval/accuracy"])
        if "eval/accuracy" in row:
            outcome.final_accuracy = float(row["eval/accuracy"])


def span(values: list[float | None], fmt: str) -> str:
    got = [v for v in values if v is not None]
    if not got:
        return "-"
    lo, hi = min(got), max(got)
    return format(lo, fmt) if lo == hi else f"{format(lo, fmt)}-{format(hi, fmt)}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", nargs="+", default=["arithmetic", "tool_use"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--jobs", type=int, default=1, help="runs at a time, one thread each (<= cores for fair times)")
    ap.add_argument("--out", default="runs/demo_ranges")
    ap.add_argument("--set", nargs="*", default=[], dest="overrides", help="recipe overrides for every run")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(
        f"machine: {platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores, "
        f"python {platform.python_version()}, jobs {args.jobs}",
        flush=True,
    )
    plan = [(r, s) for r in args.recipes for s in args.seeds]
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        outcomes = list(pool.map(lambda rs: run_one(rs[0], rs[1], out, args.overrides), plan))
    fmt = "{:<12} {:>4} {:>3} {:>13} {:>16} {:>14} {:>8}"
    print(fmt.format("recipe", "seed", "rc", "warmup steps", "warmup accuracy", "final accuracy", "wall s"))
    for o in outcomes:
        cells = [o.warmup_steps, o.warmup_accuracy, o.final_accuracy]
        print(
            fmt.format(
                o.recipe,
                o.seed,
                o.returncode,
                *("-" if c is None else f"{c:.3f}" if isinstance(c, float) else c for c in cells),
                f"{o.wall_s:.0f}",
            )
        )
    print("ranges over seeds:")
    for recipe in args.recipes:
        mine = [o for o in outcomes if o.recipe == recipe]
        print(
            f"  {recipe}: warmup stops at step {span([o.warmup_steps for o in mine], 'g')}, "
            f"held-out accuracy {span([o.warmup_accuracy for o in mine], '.1%')} after the warmup, "
            f"{span([o.final_accuracy for o in mine], '.1%')} at the end; "
            f"{span([o.wall_s for o in mine], '.0f')} s each"
        )
    return 0 if all(o.returncode == 0 for o in outcomes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
