"""``eval.reward`` defaults to the stage's own reward (issue 24 item 16a): a stage rewarding
with ``{name: exact_match, case_sensitive: false}`` was evaluated with the plain built-in
(case-sensitive), reporting 0% held-out accuracy for a model at 60% in training. A stage
without a reward (SFT, DPO) is still evaluated with ``exact_match``; an explicit ``eval.reward``
wins."""

from __future__ import annotations

import json
from typing import Any

from test_failures import TINY

from tempering.apps.checkpoint_eval import spec_from_recipe
from tempering.training.recipe import Recipe

EVAL = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}, {"prompt": "3+3=", "answer": "6"}]


def run(tmp_path, **stage: Any) -> list[dict[str, Any]]:
    spec = {
        "id": "rl",
        "name": "grpo",
        "steps": 1,
        "prompts_per_step": 2,
        "group_size": 2,
        "max_tokens": 2,
        "dataset": {"name": "arithmetic", "size": 8},
        **stage,
    }
    Recipe.from_dict(
        {"name": "ev", "output_dir": str(tmp_path), "loggers": ["jsonl"], "backend": TINY, "stages": [spec]}
    ).run()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "eval/reward" in r]


def quarter(completion: str, example: dict) -> float:
    return 0.75  # no mean of exact_match over 3 examples is 0.75


def test_the_evaluation_scores_with_the_stages_reward_by_default(tmp_path):
    evals = run(tmp_path / "a", reward=quarter, eval={"dataset": EVAL})
    assert evals and all(r["eval/reward"] == 0.75 for r in evals)


def test_an_explicit_eval_reward_still_wins(tmp_path):
    evals = run(tmp_path / "b", reward=quarter, eval={"dataset": EVAL, "reward": lambda c, e: 0.25})
    assert evals and all(r["eval/reward"] == 0.25 for r in evals)


def test_tempering_eval_on_a_run_folder_defaults_to_the_stages_reward_too():
    lenient = {"name": "exact_match", "case_sensitive": False}
    stage = {"name": "grpo", "reward": lenient, "eval": {"dataset": {"name": "arithmetic"}}}
    assert spec_from_recipe({"stages": [stage]})["reward"] == lenient
    sft = {"name": "sft", "eval": {"dataset": {"name": "arithmetic"}}}
    assert spec_from_recipe({"stages": [sft]})["reward"] == "tempering:exact_match"
