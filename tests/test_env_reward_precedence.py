"""A stage ``reward:`` that an environment's own score overrides (issue 24 item 12): when the
environment's ``score`` returns a number, the stage's reward is not called -- that was silent.
A reward the user wrote now gets one warning naming its key; the default reward (never
written) stays quiet."""

from __future__ import annotations

import warnings

from test_failures import backend

from tempering.rollouts.environment import Environment, StepResult
from tempering.training.recipe import Recipe


class ScoresItself(Environment):
    """Every model turn ends the episode with the environment's own reward."""

    async def step(self, response):
        return StepResult(reward=1.0, done=True)


def stage(**over):
    return {
        "id": "rl",
        "name": "grpo",
        "steps": 2,
        "prompts_per_step": 2,
        "group_size": 2,
        "max_tokens": 8,
        "dataset": [{"prompt": "1+2?", "answer": "3"}],
        "sampler": {"name": "environment", "environment": ScoresItself},
        **over,
    }


def run(tmp_path, **over):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        Recipe.from_dict(
            {"name": "p", "output_dir": str(tmp_path), "loggers": ["jsonl"], "stages": [stage(**over)]}
        ).run(backend=backend(chat=True))
    return [str(w.message) for w in seen if "is not used" in str(w.message)]


def test_a_written_stage_reward_that_the_environment_overrides_warns_once(tmp_path):
    said = run(tmp_path / "a", reward={"name": "exact_match", "case_sensitive": False})
    assert len(said) == 1  # two steps, eight episodes: once
    assert said[0].startswith("tempering: stages[0].reward is not used")
    assert "environment's score returned a number" in said[0] and "return None from its score" in said[0]


def test_the_default_reward_stays_quiet(tmp_path):
    assert run(tmp_path / "b") == []
