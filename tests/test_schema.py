"""One validation style (issue 22 item 5): a component's schema is its fields plus one check
yielding (key, message) problems; the registry runs it once, before building, and reports the
first problem at its full key path; a dataclass built in Python runs the same check."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tempering.algorithms.grpo.loss import GRPOLoss
from tempering.errors import ConfigError, PluginError
from tempering.registry import get_registry
from tempering.schema import Problem, caught, check_config_at, config_problems, first_problem, one_of, raise_problems
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


# --------------------------------------------------------------------------- a raising helper's error as a problem
def fails_at(path: str, message: str = "must be >= 1, got 0") -> None:
    raise ConfigError(message, path)


def test_caught_reports_a_helpers_error_by_its_path_and_bare_message():
    assert caught("backend", fails_at, "backend.lora.rank") == Problem("lora.rank", "must be >= 1, got 0")
    assert caught("backend", fails_at, "backend") == Problem("", "must be >= 1, got 0")
    # a message that itself holds "backend." is not taken apart: only the path is read
    assert caught("backend", fails_at, "backend.model", "backend.model: x") == Problem("model", "backend.model: x")
    assert caught("backend", fails_at, "elsewhere.key") == Problem("", "elsewhere.key: must be >= 1, got 0")
    assert caught("backend", lambda: None) is None
    with pytest.raises(PluginError, match="broken"):  # not a problem of the config's values
        caught("backend", lambda: (_ for _ in ()).throw(PluginError("broken")))


def test_the_check_runs_only_to_its_first_problem():
    seen = []

    class Costly:
        @staticmethod
        def check_config(config: Mapping[str, Any]) -> Iterator[Problem | None]:
            seen.append("first")
            yield Problem("a", "wrong")
            seen.append("second")  # a hub lookup, say: not done for an error nobody sees
            yield Problem("b", "also wrong")

    assert first_problem(Costly, {}) == Problem("a", "wrong") and seen == ["first"]
    with pytest.raises(ConfigError, match=r"^x\.a: wrong$"):
        check_config_at(Costly, {}, "x")
    assert seen == ["first", "first"]


# --------------------------------------------------------------------------- the components once on check_params
def test_no_builtin_component_has_the_legacy_check_params_hook():
    """One validation style: the registry reads ``check_config`` alone, so a ``check_params``
    left on a component would be a check that silently never runs."""
    for component in get_registry().components():
        assert not hasattr(component.load(), "check_params"), component.qualified


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a model name that is not a builder is not looked up


@pytest.mark.parametrize(
    ("keys", "error"),
    [
        (
            {"lora": {"rnk": 8}},
            "backend.lora.rnk: unknown key 'rnk'. Did you mean 'rank'? Valid keys: alpha, dropout, "
            "rank, target_modules",
        ),
        ({"lora": {"rank": 0}}, "backend.lora.rank: must be >= 1, got 0"),
        ({"lora": 5}, "backend.lora: expected a mapping such as {rank: 8} (or null for full fine-tuning), got 5"),
        ({"dtype": "fp8"}, "backend.dtype: unknown dtype 'fp8'; choose one of bfloat16, float16, float32"),
        ({"parallel": "zero3"}, "backend.parallel: unknown mode 'zero3'; choose ddp (replicated) or fsdp (sharded)"),
        ({"sample_batch_size": 0}, "backend.sample_batch_size: must be >= 1, got 0"),
        ({"vllm": 3}, "backend.vllm: expected a mapping such as {max_model_len: 2048}, got 3"),
        ({"model": ""}, "backend.model: expected a model builder name, a folder or a Hugging Face hub id, got ''"),
        ({"model_kwargs": 3}, "backend.model_kwargs: expected a mapping of keyword arguments, got int"),
        (
            {"model_kwargs": {"hiden_size": 8}},
            "backend.model_kwargs.hiden_size: unknown key 'hiden_size'. Did you mean 'hidden_size'?",
        ),
        # the first problem in the check's order is the one reported, as check_params raised it
        ({"model": "tiny_lama", "dtype": "fp8", "lora": {"rnk": 8}}, "backend.lora.rnk: unknown key 'rnk'."),
    ],
)
def test_the_local_backends_check_reports_one_line_at_the_key(keys: dict, error: str, offline: None):
    with pytest.raises(ConfigError) as err:
        get_registry().check("backend", {"name": "local", **keys}, "backend")
    assert str(err.value).startswith(error) and "\n" not in str(err.value)


def test_the_local_backends_defaults_pass_and_a_model_builder_takes_any_name(offline: None):
    get_registry().check("backend", {"name": "local"}, "backend")  # every default is fine
    get_registry().check("backend", {"name": "local", "model": "my_own", "model_builder": lambda seed: None}, "backend")
    with pytest.raises(ConfigError, match=r"^backend\.model: 'my_own' is not a registered model builder"):
        get_registry().check("backend", {"name": "local", "model": "my_own"}, "backend")


def test_the_python_and_remote_rewards_check_at_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "schema_rewards.py").write_text(
        "def score(completion, example):\n    return 1.0\n\n"
        "class Judge:\n    def __init__(self, strict: bool = False):\n        self.strict = strict\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    check = get_registry().check
    check("reward", {"name": "python", "function": "schema_rewards:Judge", "params": {"strict": True}}, "reward")
    cases = [
        (
            {"function": "schema_rewards"},
            "function: expected 'module:function' (e.g. my_rewards:score), got 'schema_rewards'",
        ),
        ({"function": "schema_rewards:nope"}, "function: module 'schema_rewards' has no 'nope'"),
        (
            {"function": "schema_rewards:Judge", "params": {"strct": True}},
            "params.strct: unknown key 'strct'. Did you mean 'strict'? Valid keys: strict",
        ),
        (
            {"function": "schema_rewards:score", "params": {"q": 1}},
            "params: the reward function does not take these params (got an unexpected keyword argument 'q')",
        ),
    ]
    for keys, error in cases:  # each at its key under the reward's path, as check_params raised it
        with pytest.raises(ConfigError) as err:
            check("reward", {"name": "python", **keys}, "stages[2].reward")
        assert str(err.value) == f"stages[2].reward.{error}"
    with pytest.raises(ConfigError, match=r"^stages\[0\]\.reward\.url: expected http\(s\)://host:port, got 'ftp://x'$"):
        check("reward", {"name": "remote", "url": "ftp://x"}, "stages[0].reward")
    with pytest.raises(ConfigError, match=r"^reward\.retries: must be >= 0, got -1$"):
        check("reward", {"name": "remote", "url": "http://x", "retries": -1}, "reward")
    check("reward", {"name": "remote", "url": "http://x"}, "reward")  # the defaults' counts are in range


@pytest.mark.parametrize("tracker", ["wandb", "trackio"])
def test_a_missing_tracker_package_is_one_line_at_the_logger(tracker: str, monkeypatch: pytest.MonkeyPatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == tracker else real(name, *a))
    with pytest.raises(ConfigError) as err:
        get_registry().check("logger", {"name": tracker}, "loggers[0]", context=("output_dir",))
    assert str(err.value) == (
        f"loggers[0]: the {tracker} logger needs the '{tracker}' package: pip install 'tempering[{tracker}]'"
    )
