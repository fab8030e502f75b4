"""One validation style (issue 22 item 5): a component's schema is its fields plus one check
yielding (key, message) problems; the registry runs it once, before building, and reports the
first problem at its full key path; a dataclass built in Python runs the same check."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pytest

from tempering.algorithms.grpo.loss import GRPOLoss
from tempering.errors import ConfigError
from tempering.registry import get_registry
from tempering.schema import Problem, check_config_at, config_problems, one_of, raise_problems
from tempering.training.stage import OptimizerConfig, sub_config


@dataclass
class Temperature:
    temperature: float = 1.0
    kind: str = "soft"

    @staticmethod
    def check_config(config: Mapping[str, Any]) -> Iterator[Problem | None]:
        if not config["temperature"] > 0:
            yield Problem("temperature", f"must be > 0, got {config['temperature']}")
        yield one_of("kind", config["kind"], ("soft", "hard"), f"use soft or hard, got {config['kind']!r}")

    def __post_init__(self) -> None:
        raise_problems(self)


def test_one_check_serves_the_registry_and_python_callers():
    assert config_problems(Temperature, {"temperature": 0.0, "kind": "sfot"}) == [
        Problem("temperature", "must be > 0, got 0.0"),
        Problem("kind", "use soft or hard, got 'sfot'. Did you mean 'soft'?"),
    ]
    assert config_problems(Temperature, {"temperature": 1.0, "kind": "hard"}) == []
    with pytest.raises(ConfigError) as err:
        check_config_at(Temperature, {"temperature": 2.0, "kind": "sfot"}, "stages[0].loss")
    assert str(err.value) == "stages[0].loss.kind: use soft or hard, got 'sfot'. Did you mean 'soft'?"
    with pytest.raises(ValueError, match="must be > 0, got -1"):
        Temperature(temperature=-1)
    assert config_problems(object, {}) == []  # no check: nothing to report


def test_the_registry_checks_a_builtin_before_building_with_the_key_path():
    with pytest.raises(ConfigError) as err:
        get_registry().check("loss", {"name": "grpo", "loss_type": "dpao"}, "stages[1].loss")
    message = str(err.value)
    assert message.startswith("stages[1].loss.loss_type: GRPOLoss.loss_type must be one of (")
    assert message.endswith(", got 'dpao'. Did you mean 'dapo'?") and "\n" not in message
    with pytest.raises(ConfigError, match=r"^stages\[0\]\.loss\.epsilon_high: GRPOLoss: epsilon_low and epsilon_high"):
        get_registry().check("loss", {"name": "grpo", "epsilon_high": -0.1}, "stages[0].loss")
    with pytest.raises(ConfigError, match=r"^stages\[0\]\.advantage\.scale: .*Did you mean 'group'\?$"):
        get_registry().check("advantage", {"name": "group_norm", "scale": "grop"}, "stages[0].advantage")
    with pytest.raises(ValueError, match="loss_type"):
        GRPOLoss(loss_type="nope")


def test_a_nested_block_is_checked_by_its_own_schema():
    with pytest.raises(ConfigError) as err:
        sub_config(OptimizerConfig, {"learning_rate": 1e-3, "schedule": "cosin"}, "stages[0].optimizer")
    assert str(err.value) == (
        "stages[0].optimizer.schedule: use one of constant, linear, cosine (got 'cosin'). Did you mean 'cosine'?"
    )
    with pytest.raises(ConfigError, match=r"^stages\[0\]\.optimizer\.learning_rate: must be > 0"):
        sub_config(OptimizerConfig, OptimizerConfig(learning_rate=-1.0), "stages[0].optimizer")  # an object too
    assert sub_config(OptimizerConfig, {"learning_rate": 1e-3}, "o").learning_rate == 1e-3
