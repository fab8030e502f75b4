"""SDPO on the Tinker backend: the real SDK against the local Tinker server (tests/fake_tinker.py,
serving ``tiny_llama``). The teacher's token logprobs come from the service (prompt logprobs of
the teacher rows, with the teacher's weights), its top-k from ``topk_prompt_logprobs``; the
blended loss runs as the loss it maps to; what Tinker cannot do is refused as one line before
anything trains."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import tinker  # noqa: F401 - a dev dependency: missing is a failure, not a skip

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_tinker import sent, serve

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def server(monkeypatch, tmp_path):
    yield from serve(monkeypatch, tmp_path)


def run(out: Path, overrides: list[str]) -> list[dict]:
    """examples/sdpo/recipe.yaml on Tinker, shortened; the SDPO stage's metric rows."""
    from tempering.training.recipe import Recipe

    base = [
        f"output_dir={out}",
        "backend.name=tinker",
        "loggers=[jsonl]",
        "stages.warmup.steps=2",
        "stages.warmup.batch_size=4",
        "stages.warmup.eval.dataset=null",
        "stages.rl.eval.dataset=null",
        "stages.rl.steps=2",
        "stages.rl.prompts_per_step=2",
        "stages.rl.group_size=3",
        "stages.rl.reprompt.success_reward_threshold=0.0",
    ]
    with pytest.warns(UserWarning, match="backend 'tinker' ignores local-backend keys"):
        Recipe.from_yaml(str(REPO / "examples" / "sdpo" / "recipe.yaml"), [*base, *overrides]).run()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["stage"] == "rl" and "loss" in r]


@pytest.mark.parametrize("teacher", ["stage_start", "base", "live"])
def test_sampled_token_sdpo_on_tinker(server, tmp_path, fresh_registry, teacher):
    """The teacher's token logprobs come from the service with the teacher's weights; the blended
    loss (GRPO + sampled-token distillation) runs as a custom loss (no built-in computes the
    distillation surrogate): per step one forward pass, then a linear cross_entropy backward."""
    rows = run(tmp_path / teacher, [f"stages.rl.distillation.teacher={teacher}"])
    assert len(rows) == 2
    for r in rows:
        assert math.isfinite(r["loss"]) and r["tinker/custom_loss"] == 1.0
        assert r["sdpo/signal_frac"] == 1.0 and r["sdpo/distill_loss"] != 0.0 and math.isfinite(r["sdpo/teacher_kl"])
        assert "sdpo/policy_loss" in r  # the recipe blends 50/50
    assert [c.loss_fn for c in sent(server, "ForwardBackward")] == ["cross_entropy"] * 4  # 2 SFT + 2 SDPO steps


@pytest.mark.parametrize(
    "override, message",
    [
        (
            ["stages.rl.distillation.teacher=ema"],
            "stages[1].distillation.teacher: 'ema' needs a backend that averages weights",
        ),
        (
            ["stages.rl.distillation.teacher=base", "stages.rl.distillation.mode=full_logits"],
            "stages[1].distillation.mode: 'full_logits' (support: student) needs the teacher's full "
            "next-token distributions",
        ),
        (
            [
                "stages.rl.distillation.teacher=live",
                "stages.rl.distillation.mode=topk_logits",
                "stages.rl.distillation.topk=4",
                "stages.rl.distillation.topk_support=teacher",
            ],
            "stages[1].distillation.mode: 'topk_logits' trains on the student's logits, "
            "which this backend does not give a loss",
        ),
    ],
)
def test_what_tinker_cannot_do_is_one_line_before_training(server, tmp_path, fresh_registry, override, message):
    from tempering.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        run(tmp_path / "bad", override)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
    assert sent(server, "ForwardBackward") == [] and not (tmp_path / "bad" / "checkpoints").exists()
