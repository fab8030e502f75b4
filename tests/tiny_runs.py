"""Shared pieces of the tests that run a stage on the tiny in-code Llama: one recipe builder
and a scripted two-turn environment (the distill, SDPO and SDFT tests all need them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tempering.rollouts.environment import StepResult
from tempering.training.recipe import Recipe


def tiny_recipe(tmp_path: Path, name: str, spec: dict[str, Any], model_kwargs: dict[str, Any], **run: Any) -> Recipe:
    """A one-stage recipe on ``tiny_llama(**model_kwargs)`` (one thread, no loggers) in
    ``tmp_path / name``; ``run``: the recipe's own keys (``max_total_steps``, ...)."""
    return Recipe(
        name=name,
        output_dir=str(tmp_path / name),
        loggers=[],
        backend={"name": "local", "model": "tiny_llama", "model_kwargs": model_kwargs, "num_threads": 1},
        stages=[spec],
        **run,
    )


class TwoTurns:
    """Answers every model turn with a tool message; the episode ends after two turns."""

    def __init__(self) -> None:
        self.turns = 0

    async def reset(self, example: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"role": "user", "content": example["prompt"]}]

    def tools(self) -> list[dict[str, Any]]:
        return []

    async def step(self, response: Any) -> StepResult:
        self.turns += 1
        return StepResult([{"role": "tool", "content": "42"}], reward=0.0, done=self.turns >= 2)

    async def cleanup(self) -> None:
        pass
