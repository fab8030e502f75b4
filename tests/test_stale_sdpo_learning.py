"""SmolLM2-135M-Instruct learns the slow retry task with stale SDPO (issue 36 item 4, the
systems test): a short ``smollm2_stale_sdpo`` -- STEPS steps of stale SDPO (3 steps stale,
clipped IS, capped advantages) through the ``retry`` environment with a LATENCY_S checker --
raises the held-out pass rate on EVAL_SIZE questions (whole episodes, greedy) before vs after,
and the rollouts it trained on were stale.

Measured: see BOUND and docs/systems.md ("Stale SDPO on a slow multi-turn task").
"""

from __future__ import annotations

from typing import Any

import pytest

from tempering.recipes import smollm2_stale_sdpo
from tempering.training.recipe import Recipe

STEPS, EVAL_SIZE, LATENCY_S = 4, 32, 2.0
BOUND = 0.1  # the held-out pass rate's gain


def short_run(tmp_path: Any, learning_rate: float, seed: int = 0) -> list[dict[str, Any]]:
    """The metrics of a short run (the recipe with fewer steps, a faster checker and a smaller,
    greedy held-out set)."""
    overrides = [
        f"stages.rl.steps={STEPS}",
        f"stages.rl.eval.every={STEPS}",
        f"stages.rl.eval.dataset.size={EVAL_SIZE}",
        "stages.rl.eval.temperature=0.0",
        f"stages.rl.sampler.environment.latency_s={LATENCY_S}",
        f"stages.rl.optimizer.learning_rate={learning_rate:.1e}",  # YAML reads 1e-12 as text, 1.0e-12 as a number
        f"seed={seed}",
        "loggers=[jsonl]",
        f"output_dir={tmp_path}",
    ]
    return Recipe.from_dict(smollm2_stale_sdpo(), overrides).run().history


@pytest.mark.systems
@pytest.mark.slow
def test_stale_sdpo_raises_smollm2s_pass_rate_on_the_slow_retry_task(tmp_path: Any) -> None:
    history = short_run(tmp_path, 4.0e-4)
    evals = [h for h in history if "eval/n" in h]
    assert [e["step"] for e in evals] == [0, STEPS]
    gain = evals[-1]["eval/accuracy"] - evals[0]["eval/accuracy"]
    assert gain >= BOUND, (evals[0], evals[-1])
    steps = [h for h in history if "offpolicy/staleness_max" in h]
    assert max(s["offpolicy/staleness_max"] for s in steps) >= 1  # trained on stale episodes
