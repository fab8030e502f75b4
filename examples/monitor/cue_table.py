"""The before/after table of the ``smollm2_monitor`` demo, from its runs' ``metrics.jsonl``.

Each run's first evaluation (``at_start``: the base model) and last one (after training) on the
held-out cue questions::

    python examples/monitor/cue_table.py runs/smollm2_monitor_s0 runs/smollm2_monitor_s1 ...

prints one Markdown row per run and moment: task accuracy, how often the reasoning names the
cue (``mentions``), how often removing the cue changes the greedy answer (``changed``: the cue's
sway) and the monitor's accuracy at predicting that change.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

COLUMNS = {
    "task accuracy": "eval/accuracy",
    "CoT names the cue": "eval/monitor/mentions",
    "answer changes without the cue": "eval/monitor/changed",
    "monitor accuracy": "eval/monitor/accuracy",
    "monitor replies unparsable": "eval/monitor/unparsable",
}


def evaluations(run: Path) -> list[dict[str, float]]:
    """The run's evaluation rows, in order."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "eval/accuracy" in r]


def table(runs: list[Path]) -> str:
    lines = ["| run | when | " + " | ".join(COLUMNS) + " |", "|---|---|" + "---|" * len(COLUMNS)]
    for run in runs:
        evals = evaluations(run)
        if not evals:
            raise SystemExit(f"{run}: no evaluation rows in metrics.jsonl (did the run finish?)")
        for when, row in (("before", evals[0]), ("after", evals[-1])):
            cells = [f"{row[k]:.3f}" if isinstance(row.get(k), (int, float)) else "-" for k in COLUMNS.values()]
            lines.append(f"| {run.name} | {when} (step {row.get('step', '?')}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit("usage: python examples/monitor/cue_table.py RUN_FOLDER [RUN_FOLDER ...]")
    print(table([Path(p) for p in sys.argv[1:]]))
