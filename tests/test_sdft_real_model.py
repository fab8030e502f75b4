"""SDFT learns a new skill on a real pretrained model (SmolLM2-135M-Instruct, ``tempering
install-model smollm2``): the bundled ``smollm2_sdft`` recipe, shortened.

The skill is answering a request with one tool call (``weather(city="Oslo")``), which the base
model never does (held-out exact match 0). Measured numbers, the full recipe and the SFT
comparison: docs/systems.md#sdft."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tempering.apps import cli

SHORT = [
    "stages.learn.steps=STEPS",
    "stages.learn.eval.dataset.size=30",
    "stages.learn.eval.every=0",
]


@pytest.mark.slow
def test_sdft_teaches_smollm2_a_tool_call_format(tmp_path: Path) -> None:
    """MEASURED. With learning rate 0 the greedy evaluation is the base model's, exactly 0 (checked once: the
    test then fails on the accuracy bound)."""
    out = tmp_path / "run"
    assert cli.main(["run", "smollm2_sdft", *SHORT, "--output-dir", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    steps = [r for r in rows if "sdft/demo_logprob_student" in r]
    assert evals[0] == 0.0, evals  # the base model never answers with the call
    assert evals[-1] >= BOUND, evals
