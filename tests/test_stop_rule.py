"""``eval.stop_at_accuracy`` checked cheaply and often (issue 24 item 11): a warmup whose
held-out accuracy jumps within a few steps stops near its target, not at the next periodic
evaluation."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tempering.errors import ConfigError
from tempering.testing import FakeBackend
from tempering.training.recipe import Recipe
from tempering.training.stage import EvalConfig, Stage, check_eval, stop_check
from tempering.types import AdamParams

HELD_OUT = [{"prompt": f"q{i}=", "answer": str(i % 10)} for i in range(40)]
ANSWERS = {e["prompt"]: e["answer"] for e in HELD_OUT}


@dataclass
class Steps(Stage):
    """A stage that only steps the optimizer: the fake model "learns" at ``LEARNS_AT``."""

    steps: int = 30

    def validate(self, ctx: Any) -> None:
        check_eval(ctx, self.eval, self)

    def train_step(self, ctx: Any, step: int) -> dict[str, Any]:
        ctx.backend.optim_step(AdamParams()).result()
        return {"loss": 1.0}


class Learner(FakeBackend):
    """Answers right from optimizer step ``learns_at`` on; counts the prompts it was asked."""

    def __init__(self, learns_at: int) -> None:
        super().__init__(complete=lambda prompt, i: ANSWERS[prompt] if self.step >= learns_at else "x")
        self.asked = 0

    def sample(self, prompts: list[list[int]], num_samples: int, params: Any) -> Any:
        self.asked += len(prompts)
        return super().sample(prompts, num_samples, params)


def run(tmp_path: Path, eval_cfg: dict[str, Any], learns_at: int = 3) -> tuple[list[dict[str, Any]], Learner]:
    backend = Learner(learns_at)
    stage = Steps(eval={"dataset": HELD_OUT, "max_tokens": 2, "at_start": False, "stop_at_accuracy": 0.5, **eval_cfg})
    Recipe(name="stop", output_dir=str(tmp_path), loggers=["jsonl"], stages=[stage]).run(backend=backend)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return rows, backend


def test_a_frequent_check_on_a_subset_stops_at_the_step_the_target_is_reached(tmp_path):
    rows, backend = run(tmp_path, {"every": 10, "stop_every": 1, "stop_size": 5})
    checks = [(r["step"], r["eval/stop_check_accuracy"]) for r in rows if "eval/stop_check_accuracy" in r]
    assert checks == [(1, 0.0), (2, 0.0), (3, 1.0)]
    assert [r["step"] for r in rows if r.get("stopped_early")] == [3]
    finals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    assert finals == [1.0], "the stage ends with one full evaluation"
    assert backend.asked == 3 * 5 + len(HELD_OUT), "three checks of 5 examples, then all 40 once"
    assert backend.step == 3


def test_without_stop_every_the_rule_waits_for_the_periodic_evaluation(tmp_path):
    rows, backend = run(tmp_path, {"every": 10})
    assert [r["step"] for r in rows if r.get("stopped_early")] == [10]
    assert not any("eval/stop_check_accuracy" in r for r in rows)
    assert backend.asked == len(HELD_OUT), "the periodic evaluation answers the rule: no second pass"


def test_a_periodic_evaluation_on_a_check_step_answers_the_rule_itself(tmp_path):
    rows, backend = run(tmp_path, {"every": 2, "stop_every": 2, "stop_size": 5}, learns_at=4)
    assert not any("eval/stop_check_accuracy" in r for r in rows)
    assert [r["step"] for r in rows if r.get("stopped_early")] == [4]
    assert backend.asked == 2 * len(HELD_OUT)


def test_stop_check_schedule():
    ev = EvalConfig(every=10, stop_every=3, stop_at_accuracy=0.4)
    assert [stop_check(ev, s, fresh_eval=s % 10 == 0) for s in (1, 3, 9, 10, 30)] == [
        None,
        "check",
        "check",
        "eval",
        "eval",
    ]
    assert stop_check(EvalConfig(every=10, stop_every=3), 3, False) is None  # no target: no check


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        ({"every": 10, "stop_every": -1}, r"^stages\[0\]\.eval\.stop_every: must be >= 0"),
        ({"every": 10, "stop_size": 0}, r"^stages\[0\]\.eval\.stop_size: must be a number of examples >= 1"),
        ({"every": 0}, r"^stages\[0\]\.eval\.stop_at_accuracy: needs eval\.every or eval\.stop_every > 0"),
    ],
)
def test_bad_stop_keys_are_one_line(tmp_path, cfg, message):
    with pytest.raises(ConfigError, match=message):
        run(tmp_path, cfg)
