"""docs/writing-a-plugin.md's third-party algorithm (issue 22): the example runs as written --
an RLStage subclass with its own loss, built on the typed context, the shared RL maths and the
loss contract -- and its config is checked like a built-in's."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "writing-a-plugin.md"


def example(tmp_path: Path) -> Path:
    text = DOC.read_text(encoding="utf-8")
    blocks = [
        b for b in re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M) if b.startswith("# algorithm example")
    ]
    assert len(blocks) == 1
    path = tmp_path / "reinforce_example.py"
    path.write_text(blocks[0], encoding="utf-8")
    return path


def run(tmp_path: Path, code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TEMPERING_PROGRESS": "0"}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )


def test_the_documented_algorithm_trains(tmp_path: Path) -> None:
    path = example(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TEMPERING_PROGRESS": "0"}
    proc = subprocess.run(
        [sys.executable, path.name], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "['reinforce_loo'] -> runs/reinforce_example" in proc.stdout, proc.stdout
    rows = [
        json.loads(line)
        for line in (tmp_path / "runs" / "reinforce_example" / "metrics.jsonl").read_text().splitlines()
    ]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(0.0 <= r["reinforce/moving_rows"] <= 1.0 and r["skipped"] == 0.0 for r in steps)
    meta = json.loads((tmp_path / "runs" / "reinforce_example" / "run.json").read_text())
    assert "reinforce_loo" in json.dumps(meta)


@pytest.mark.parametrize(
    ("loss", "message"),
    [
        (
            "{'name': 'reinforce', 'aggregation': 'grp'}",
            r"stages\[0\]\.loss\.aggregation: must be one of .*Did you mean 'grpo'\?$",
        ),
        ("'dpo'", r"stages\[0\]\.loss: the DPOLoss loss reads"),
    ],
)
def test_its_config_is_checked_like_a_builtin(tmp_path: Path, loss: str, message: str) -> None:
    example(tmp_path)
    code = f"""
import sys
import reinforce_example as ex
from tempering.errors import ConfigError
from tempering.training.recipe import Recipe
from tempering.testing import make_registry
registry = make_registry(ex)
recipe = Recipe.from_dict({{
    "output_dir": "runs/bad", "loggers": [], "backend": {{"name": "local", "model": "tiny_llama"}},
    "stages": [{{
        "name": "reinforce_loo", "steps": 1, "loss": {loss}, "dataset": {{"name": "arithmetic", "size": 8}},
    }}],
}})
try:
    recipe.run(registry=registry)
except ConfigError as exc:
    print("ERROR", exc)
    sys.exit(0)
print("NO ERROR")
"""
    proc = run(tmp_path, code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith("ERROR ") and re.search(message, line), line


def test_its_minimal_loss_is_a_loss(tmp_path: Path) -> None:
    """Issue 38: the Loss protocol requires the call alone, so the docs' Reinforce (no
    needs_logits, no tinker_builtin) is an instance, and the optional capabilities read as
    absent through the loss contract."""
    example(tmp_path)
    code = """
import reinforce_example as ex
from tempering import loss_contract as lc
from tempering.interfaces import Loss
loss = ex.Reinforce()
print(isinstance(loss, Loss), lc.needs_logits(loss), lc.needs_all_positions(loss), lc.builtin_name(loss))
"""
    proc = run(tmp_path, code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["True", "False", "False", "None"]
