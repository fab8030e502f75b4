"""SmolLM2-135M-Instruct learns to forecast (issue 36 item 3, the slow test): a short
``smollm2_forecast`` -- STEPS GRPO steps on the brier reward -- raises the held-out reward
(the negated Brier score, an answer without a probability scoring -1) on EVAL_SIZE questions,
greedy, before vs after.

Measured (seed 0, one thread, 3.8 min on the loaded machine; 2.3 min under pytest later): held-out reward
-0.713 -> -0.243 (gain 0.47), readable answers 17 -> 40 of 40. With the learning rate at
1e-12 (3.3 min): -0.713 -> -0.713 (gain 0.000, readable 17 -> 17); the bound, a gain of 0.1,
fails that. It checks the answer format being learned; calibration itself is not learned at
this size (docs/systems.md).
"""

from __future__ import annotations

from typing import Any

import pytest

from tempering.recipes import smollm2_forecast
from tempering.training.recipe import Recipe

STEPS, EVAL_SIZE = 5, 40
BOUND = 0.1  # the held-out reward's gain; measured 0.47, and 0.000 with lr 1e-12


def before_and_after(tmp_path: Any, learning_rate: float, seed: int = 0) -> tuple[dict[str, Any], dict[str, Any]]:
    """The held-out evaluation before and after a short run (the recipe with fewer steps and a
    smaller held-out set)."""
    overrides = [
        f"stages.rl.steps={STEPS}",
        f"stages.rl.eval.every={STEPS}",
        f"stages.rl.eval.dataset.size={EVAL_SIZE}",
        f"stages.rl.optimizer.learning_rate={learning_rate:.1e}",  # YAML reads 1e-12 as text, 1.0e-12 as a number
        f"seed={seed}",
        "loggers=[jsonl]",
        f"output_dir={tmp_path}",
    ]
    result = Recipe.from_dict(smollm2_forecast(), overrides).run()
    evals = [h for h in result.history if "eval/n" in h]
    assert [e["step"] for e in evals] == [0, STEPS]
    return evals[0], evals[-1]


@pytest.mark.systems
@pytest.mark.slow
def test_smollm2_learns_to_state_a_probability(tmp_path: Any) -> None:
    before, after = before_and_after(tmp_path, 2.0e-4)
    gain = after["eval/reward"] - before["eval/reward"]
    assert gain >= BOUND, (before, after)
    assert after["eval/forecasts"] > before["eval/forecasts"]
    assert (tmp_path / "reliability" / f"rl-step{STEPS:06d}.png").stat().st_size > 5_000
