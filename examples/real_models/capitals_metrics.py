"""Score the capitals skill of finished runs (or a model folder) three ways.

    python examples/real_models/capitals_metrics.py runs/smollm2_sft_json_s0 runs/smollm2_sdft_json_s0
    model="$(python -c 'from tempering.plugins.models import smollm2; print(smollm2.smollm2_folder())')"
    python examples/real_models/capitals_metrics.py "$model"

Each folder is evaluated once on the 30 held-out countries with ``tempering eval`` (greedy, 16
tokens, written to ``FOLDER/evals/capitals``; a model folder's go to ``runs/base_capitals``).

Exact match (the recipes' ``eval/accuracy``) is all or nothing, so it cannot tell a model that
learnt the format but lost the fact from one that kept the fact but not the format. Each held-out
answer is also checked for:

- ``json``: it starts with a JSON object whose ``capital`` is a string (the format);
- ``named``: the right capital appears anywhere in it (the fact, in any format).

The numbers in docs/real-models.md (SFT vs SDFT) were computed with this script.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

TEST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "capitals_test.jsonl")


def first_json_capital(text: str) -> str | None:
    """The ``capital`` string of the JSON object the answer starts with, if any."""
    try:
        value, _ = json.JSONDecoder().raw_decode(text.lstrip())
    except ValueError:
        return None
    capital = value.get("capital") if isinstance(value, dict) else None
    return capital if isinstance(capital, str) else None


def score(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Exact, json and named rates of evaluation rollouts (one per held-out question)."""
    exact = fmt = named = 0
    for row in rows:
        text = str(row.get("completion") or "")
        capital = str(row["example"]["capital"])
        exact += text.strip() == str(row["example"]["answer"]).strip()
        fmt += first_json_capital(text) is not None
        named += capital.lower() in text.lower()
    n = max(1, len(rows))
    return {"n": float(len(rows)), "exact": exact / n, "json": fmt / n, "named": named / n}


def evaluate(folder: str) -> list[dict[str, Any]]:
    """All held-out answers of ``folder``'s latest weights, from ``tempering eval`` (run once)."""
    is_run = os.path.exists(os.path.join(folder, "run.json"))
    out = os.path.join(folder, "evals", "capitals") if is_run else os.path.join("runs", "base_capitals")
    path = os.path.join(out, "rollouts.jsonl")
    if not os.path.exists(path):
        cmd = [
            sys.executable,
            "-m",
            "tempering",
            "eval",
            folder,
            "--dataset",
            TEST,
            "--reward",
            "exact_match",
            "--max-tokens",
            "16",
            "--out",
            out,
        ]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="run folders or model folders")
    args = parser.parse_args(argv)
    print(f"{'folder':36}{'n':>5}{'exact':>8}{'json':>8}{'named':>8}")
    for folder in args.runs:
        s = score(evaluate(folder))
        print(
            f"{os.path.basename(folder.rstrip('/')):36}{int(s['n']):>5}{s['exact']:8.2f}{s['json']:8.2f}{s['named']:8.2f}"
        )


if __name__ == "__main__":
    main()
