"""Tracebacks of failures (issue 24 item 3): an environment, group score or reward that raises
keeps its formatted traceback -- the user's frames, not the harness's -- in ``rollouts.jsonl``
(``reward_info.traceback``); the first one is printed; ``TEMPERING_DEBUG=1`` (``tempering run
--debug``) re-raises the first failure instead of counting it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_failures import backend

from tempering.rollouts.environment import Environment, StepResult
from tempering.training.recipe import Recipe


class Lookup(Environment):
    """``step`` looks up a key the example does not have: a plugin author's bug."""

    async def reset(self, example: dict[str, Any]) -> list[dict[str, Any]]:
        self.example = example
        return [{"role": "user", "content": example["q"]}]

    async def step(self, response: Any) -> StepResult:
        return StepResult(reward=float(response.text == users_helper(self.example)), done=True)


def users_helper(example: dict[str, Any]) -> str:
    return example["word"]  # KeyError: 'word'


def recipe(out: Path, **over: Any) -> Recipe:
    stage = {
        "id": "rl",
        "name": "grpo",
        "steps": 1,
        "prompts_per_step": 2,
        "group_size": 2,
        "max_tokens": 4,
        "max_failed_fraction": 1.0,
        "dataset": [{"q": "1+2?", "answer": "3"}],
        "sampler": {"name": "environment", "environment": Lookup},
        **over,
    }
    return Recipe.from_dict({"name": "tb", "output_dir": str(out), "loggers": ["jsonl"], "stages": [stage]})


def test_an_environment_exception_keeps_its_traceback_in_the_rollout_log_and_prints_it(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TEMPERING_DEBUG", raising=False)
    recipe(tmp_path).run(backend=backend(chat=True))
    failed = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    failed = [r for r in failed if r["failed"]]
    assert failed and all(r["error"] == "episode: KeyError: 'word'" for r in failed)
    tb = failed[0]["reward_info"]["traceback"]
    assert tb.startswith("Traceback (most recent call last):") and tb.rstrip().endswith("KeyError: 'word'")
    assert "in users_helper" in tb and 'return example["word"]' in tb and "in step" in tb  # the user's frames
    assert "episode.py" not in tb and "asyncio" not in tb  # not the harness's
    err = capsys.readouterr().err
    assert err.count("Traceback (most recent call last):") == 1 and "in users_helper" in err


def test_a_raising_reward_keeps_its_traceback_too(tmp_path, monkeypatch):
    monkeypatch.delenv("TEMPERING_DEBUG", raising=False)

    def my_reward(completion: str, example: dict) -> float:
        return float(example["missing"])

    stage = {
        "id": "rl",
        "name": "grpo",
        "steps": 1,
        "prompts_per_step": 2,
        "group_size": 2,
        "max_tokens": 2,
        "max_failed_fraction": 1.0,
        "reward": my_reward,
        "dataset": {"name": "arithmetic", "size": 4},
    }
    Recipe.from_dict({"name": "tb", "output_dir": str(tmp_path), "loggers": ["jsonl"], "stages": [stage]}).run(
        backend=backend()
    )
    failed = [r for r in map(json.loads, (tmp_path / "rollouts.jsonl").read_text().splitlines()) if r["failed"]]
    assert failed and "in my_reward" in failed[0]["reward_info"]["traceback"]


def test_debug_re_raises_the_first_failure(tmp_path, monkeypatch):
    monkeypatch.setenv("TEMPERING_DEBUG", "1")
    with pytest.raises(KeyError, match="word"):
        recipe(tmp_path).run(backend=backend(chat=True))


def test_the_cli_debug_flag_sets_the_variable(monkeypatch):
    from tempering.apps import cli

    monkeypatch.setenv("TEMPERING_DEBUG", "0")  # recorded, so the variable main sets is removed after
    seen: list[Any] = []
    monkeypatch.setattr(cli, "cmd_run", lambda args: seen.append(__import__("os").environ.get("TEMPERING_DEBUG")) or 0)
    assert cli.main(["run", "arithmetic", "--debug"]) == 0
    assert seen == ["1"]
