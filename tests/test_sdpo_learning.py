"""SDPO learns (issue 23 item 6, the slow test): the student moves to its feedback-conditioned
teacher, on-policy and three steps stale.

An untrained tiny Llama answers sums; every answer is wrong, and exact_match's feedback says what
was expected ("expected '46', got '45'"). The teacher is the model as the stage began
(``stage_start``, frozen), re-prompted with that feedback; the loss is the distillation alone
(``distillation: {weight: 1}``, full distributions, forward KL). Measured (seed 0, 20 steps of
8 prompts x 4): the distillation loss's mean over the last 3 steps is 0.12x its mean over the
first 3 on-policy (0.0099 -> 0.0012); with the learning rate at 1e-12 it is 1.1x, and with the
distillation term's sign flipped 52x (0.06 -> 3.19: the student runs from the teacher). The
bound, 0.5x, fails both. Stale (k = 3, fixed staleness): 0.11x, 1.1x and 54x. About 10-25 s each on 2
cores. The held-out comparison with GRPO is benchmarks/sdpo_vs_grpo.py (docs/sdpo.md)."""

from __future__ import annotations

import statistics

import pytest

from tempering.training.recipe import Recipe

CHARS = "0123456789+= abcdefghijklmnopqrstuvwxyz',.\"\\"
MODEL = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "intermediate_size": 128, "chars": CHARS}
BOUND = 0.5  # last-3 over first-3 distillation loss; measured 0.12 (stale 0.11), broken 1.1 and 52-54


def distillation_losses(tmp_path, stale) -> list[float]:
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]
    spec = {
        "name": "sdpo",
        "dataset": rows,
        "reward": "exact_match",
        "steps": 20,
        "prompts_per_step": 8,
        "group_size": 4,
        "max_tokens": 3,
        "optimizer": {"learning_rate": 3e-3},
        "distillation": {"teacher": "stage_start", "mode": "full_logits", "alpha": 0.0},
        "reprompt": {
            "use_successful_as_teacher": False,
            "reprompt_template": "{feedback}{prompt}",
            "feedback_template": "{feedback_raw} ",
        },
        "stale": stale,
        "log_kl": False,
    }
    result = Recipe(
        name="learn",
        output_dir=str(tmp_path),
        loggers=[],
        seed=0,
        backend={"name": "local", "model": "tiny_llama", "model_kwargs": MODEL, "num_threads": 1},
        stages=[spec],
    ).run()
    rows = [h for h in result.history if "sdpo/distill_loss" in h]
    assert len(rows) == 20 and all(h["sdpo/signal_frac"] == 1.0 for h in rows)  # every sample has feedback
    return [h["sdpo/distill_loss"] for h in rows]


@pytest.mark.slow
@pytest.mark.parametrize(
    "stale", [None, {"max_steps_off_policy": 3, "fixed_staleness": True}], ids=["on_policy", "stale_k3"]
)
def test_the_student_moves_to_its_feedback_conditioned_teacher(tmp_path, stale):
    losses = distillation_losses(tmp_path, stale)
    ratio = statistics.mean(losses[-3:]) / statistics.mean(losses[:3])
    assert ratio < BOUND, [round(x, 4) for x in losses]
