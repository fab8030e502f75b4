""" "Done" no longer hides partial failures (issue 24 item 2): the stage's summary (what
``tempering run`` prints after "Done." and ``Recipe.run`` returns) counts failed samples by
cause over the whole stage, and tool errors and timeouts; each new tool cause is printed once,
like a sample cause; ``max_tool_error_fraction`` stops a stage whose tools keep failing."""

from __future__ import annotations

from typing import Any

import pytest
from test_failures import TINY, backend

from tempering.errors import TemperingError
from tempering.rollouts.environment import Environment, StepResult
from tempering.training.recipe import Recipe


def flaky(completion: str, example: dict) -> float:
    if example["answer"] in ("2", "3", "4", "5"):  # some examples, every step: a partial failure
        raise ValueError("judge hiccup")
    return 1.0


def test_partial_reward_failures_are_counted_by_cause_in_the_stage_summary(tmp_path, capsys):
    stage = {
        "id": "rl",
        "name": "grpo",
        "steps": 3,
        "prompts_per_step": 4,
        "group_size": 2,
        "max_tokens": 2,
        "max_failed_fraction": 1.0,
        "reward": flaky,
        "dataset": [{"prompt": f"{i}+0=", "answer": str(i)} for i in range(8)],
    }
    result = Recipe.from_dict(
        {"name": "s", "output_dir": str(tmp_path), "loggers": ["jsonl"], "backend": TINY, "stages": [stage]}
    ).run()
    summary = result.stages["rl"]
    assert summary["failed/raised:ValueError"] == 12.0  # half of the 24 samples, over all three steps
    assert summary["rollout/samples"] == 24.0
    assert capsys.readouterr().err.count("[raised:ValueError]") == 1


class FailingTools(Environment):
    """Every turn reports a tool call that timed out (as the default ``step`` would)."""

    async def step(self, response: Any) -> StepResult:
        return StepResult(
            reward=1.0,
            done=True,
            metrics={"tool_calls": 2.0, "tool_errors": 2.0, "tool_timeouts": 1.0},
            errors=["tool search timed out after 5s", "KeyError: 'q'"],
        )


def tool_stage(**over: Any) -> dict[str, Any]:
    return {
        "id": "rl",
        "name": "grpo",
        "steps": 2,
        "prompts_per_step": 2,
        "group_size": 2,
        "max_tokens": 4,
        "dataset": [{"prompt": "1+2?", "answer": "3"}],
        "sampler": {"name": "environment", "environment": FailingTools},
        **over,
    }


def test_tool_errors_and_timeouts_are_causes_printed_once_and_summed(tmp_path, capsys):
    result = Recipe.from_dict(
        {"name": "t", "output_dir": str(tmp_path), "loggers": ["jsonl"], "stages": [tool_stage()]}
    ).run(backend=backend(chat=True))
    summary = result.stages["rl"]
    assert (summary["env/tool_calls"], summary["env/tool_errors"], summary["env/tool_timeouts"]) == (16.0, 16.0, 8.0)
    err = capsys.readouterr().err
    assert err.count("[tool_error]") == 1 and err.count("[tool_timeout]") == 1
    assert "16 of 16 tool calls failed" not in err  # per step: "8 tool calls failed"
    assert "rl step 1: 8 tool calls failed [tool_error]: tool search timed out after 5s" in err


def test_max_tool_error_fraction_stops_the_stage_naming_the_key(tmp_path):
    with pytest.raises(
        TemperingError,
        match=r"stages\[0\]: 16 of 16 tool calls failed .*max_tool_error_fraction=0.5.*"
        r"raise stages\[0\]\.max_tool_error_fraction",
    ):
        Recipe.from_dict(
            {
                "name": "t",
                "output_dir": str(tmp_path),
                "loggers": ["jsonl"],
                "stages": [tool_stage(max_tool_error_fraction=0.5)],
            }
        ).run(backend=backend(chat=True))
