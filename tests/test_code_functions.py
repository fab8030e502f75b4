"""The ``code_functions`` dataset: held-out functions never trained on, four literal asserts per
task, and every task solvable -- its reference solution passes all its tests in the sandbox."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sandbox_support import make_sandbox

from tempering.apps import cli
from tempering.plugins.datasets.code_functions import TASKS, code_functions
from tempering.plugins.rewards.sandbox.program import parse_tests
from tempering.registry import get_registry
from tempering.rollouts.scoring import RewardRunner
from tempering.types import Completion, Sample


def test_splits_hold_out_whole_functions() -> None:
    train, test = code_functions("train"), code_functions("test")
    assert (len(TASKS), len(train), len(test)) == (80, 64, 16)
    assert not {r["name"] for r in train} & {r["name"] for r in test}
    assert len({t.name for t in TASKS}) == 80
    assert [r["name"] for r in code_functions("test", size=20)][16:] == [r["name"] for r in test][:4]


def test_each_task_has_four_literal_asserts_and_shows_the_first() -> None:
    for row in code_functions("all"):
        tests = parse_tests(row["tests"], "tests")
        assert len(tests) == 4 and all(not t.expression.startswith("bool(") for t in tests), row["tests"]
        first = row["tests"][0].removeprefix("assert ").split(" == ")
        assert f"For example, {first[0]} returns {first[1]}." in row["prompt"]
        assert row["messages"] == [{"role": "user", "content": row["prompt"]}]


def test_every_reference_solution_passes_in_the_sandbox() -> None:
    sandbox = make_sandbox(workers=2)
    rows = code_functions("all")
    batch = [Sample(example=r, completion=Completion([], [], [], text=f"```python\n{r['reference']}```")) for r in rows]
    stats = RewardRunner(sandbox).score(batch)
    assert stats.failed == 0
    assert [(s.example["name"], s.reward_info["outcome"]) for s in batch if s.reward != 1.0] == []


def test_registered_and_bad_split_is_one_line() -> None:
    rows = get_registry().build("dataset", {"name": "code_functions", "split": "test"}, "stages[0].dataset")
    assert len(rows) == 16
    with pytest.raises(ValueError, match=r"^code_functions: split must be 'train', 'test' or 'all', got 'valid'$"):
        code_functions("valid")


def test_the_recipe_runs_end_to_end_on_a_tiny_model(tmp_path: Path) -> None:
    """``smollm2_code`` with the tiny chat Llama in place of SmolLM2: sampling, the sandbox
    reward, GRPO and the held-out evaluation run, and the programs' outcomes are counted."""
    make_sandbox()  # skips, with the reason, where the machine cannot isolate
    out = tmp_path / "run"
    args = ["backend.model=tiny_llama", "backend.model_kwargs={chat: true}", "stages.rl.steps=2"]
    args += ["stages.rl.prompts_per_step=2", "stages.rl.group_size=2", "stages.rl.max_tokens=12"]
    args += ["stages.rl.eval.max_tokens=12", "stages.rl.eval.every=2", "stages.rl.eval.at_start=false"]
    assert cli.main(["run", "smollm2_code", *args, "--output-dir", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "reward/mean" in r]
    evals = [r for r in rows if "eval/n" in r]
    assert len(train) == 2 and all(r["reward/failed"] == 0 for r in train)
    assert all(sum(v for k, v in r.items() if k.startswith("outcome/")) == 4 for r in train)
    assert evals[-1]["eval/n"] == 16
    assert sum(v for k, v in evals[-1].items() if k.startswith("eval/outcome/")) == 16
