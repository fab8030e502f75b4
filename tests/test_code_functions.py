"""The ``code_functions`` dataset: held-out functions never trained on, four literal asserts per
task, and every task solvable -- its reference solution passes all its tests in the sandbox."""

from __future__ import annotations

import pytest

from tests.sandbox_support import make_sandbox

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
    batch = [
        Sample(example=r, completion=Completion([], [], [], text=f"```python\n{r['reference']}```")) for r in rows
    ]
    stats = RewardRunner(sandbox).score(batch)
    assert stats.failed == 0
    assert [(s.example["name"], s.reward_info["outcome"]) for s in batch if s.reward != 1.0] == []


def test_registered_and_bad_split_is_one_line() -> None:
    rows = get_registry().build("dataset", {"name": "code_functions", "split": "test"}, "stages[0].dataset")
    assert len(rows) == 16
    with pytest.raises(ValueError, match=r"^code_functions: split must be 'train', 'test' or 'all', got 'valid'$"):
        code_functions("valid")
