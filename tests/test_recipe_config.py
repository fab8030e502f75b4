"""Recipes from YAML or Python objects, interpolation, stage ids, and how the registry turns a
config mapping into a component (``Registry.build``) for each kind of factory."""

from __future__ import annotations

import dataclasses
import json
import textwrap
from dataclasses import dataclass, field
from typing import Any

import pytest

from tempering.errors import ConfigError, PluginError
from tempering.hookspecs import hookimpl
from tempering.registry import PluginInfo, Registry, params_schema
from tempering.testing import FakeBackend
from tempering.training.config import apply_overrides, resolve_recipe
from tempering.training.recipe import Recipe

YAML = """
name: demo
seed: 3
loggers: [jsonl]
stages:
  - {id: rl, name: grpo, steps: 2, prompts_per_step: 2, group_size: 2, max_tokens: 4,
     dataset: {name: arithmetic, size: 4}, reward: exact_match}
"""


def digits_only(completion: str, example: dict) -> float:
    """A reward written in Python, used directly (no registration)."""
    digits_only.calls += 1  # type: ignore[attr-defined]
    return 1.0 if completion.strip().isdigit() else 0.0


def test_a_python_recipe_resolves_like_the_yaml_one(tmp_path, fresh_registry):
    path = tmp_path / "demo.yaml"
    path.write_text(YAML, encoding="utf-8")
    from_yaml = Recipe.from_yaml(str(path))

    estimator = fresh_registry.build("advantage", {"name": "group_norm"})
    from_python = Recipe.from_dict(
        {
            "name": "demo",
            "seed": 3,
            "loggers": ["jsonl"],
            "stages": [
                {
                    "id": "rl",
                    "name": "grpo",
                    "steps": 2,
                    "prompts_per_step": 2,
                    "group_size": 2,
                    "max_tokens": 4,
                    "dataset": {"name": "arithmetic", "size": 4},
                    "reward": digits_only,
                    "advantage": estimator,
                }
            ],
        }
    )
    py, ym = from_python.to_dict(), from_yaml.to_dict()
    stage = py["stages"][0]
    assert stage["reward"] is digits_only and stage["advantage"] is estimator  # objects kept, not copied
    assert "__object_" not in json.dumps({k: v for k, v in py.items() if k != "stages"})
    py["stages"] = [{k: v for k, v in s.items() if k != "advantage"} | {"reward": "exact_match"} for s in py["stages"]]
    assert py == ym
    assert ym["output_dir"] == "runs/demo" and ym["checkpoint_every"] == 0 and ym["resume"] is True

    # the Python objects reach the stage and are used as they are
    digits_only.calls = 0  # type: ignore[attr-defined]
    backend = FakeBackend(complete=lambda prompt, i: ["12", "x"][i])
    result = Recipe(**{**from_python.to_dict(), "output_dir": str(tmp_path / "run")}).run(fresh_registry, backend)
    assert digits_only.calls == 2 * 2 * 2  # steps x prompts x group
    assert result.stages["rl"]["reward/mean"] == 0.5
    assert result.metadata["recipe"]["stages"][0]["reward"] == "<python object digits_only>"
    assert "reward:exact_match" not in result.metadata["components"]


def test_registry_build_passes_objects_through(empty_registry):
    obj = object()
    assert empty_registry.build("reward", obj) is obj


def test_output_dir_interpolation():
    base = {"stages": [{"name": "grpo"}]}
    assert resolve_recipe({**base, "name": "demo"})["output_dir"] == "runs/demo"
    assert (
        resolve_recipe({**base, "name": "demo", "seed": 4, "output_dir": "out/${name}-s${seed}"})["output_dir"]
        == "out/demo-s4"
    )
    # overrides apply before interpolation
    assert resolve_recipe({**base, "name": "demo"}, ["name=other"])["output_dir"] == "runs/other"
    assert Recipe.from_dict({**base, "name": "x"}, ["seed=2", "output_dir=o/${name}/${seed}"]).output_dir == "o/x/2"
    with pytest.raises(ConfigError, match=r"^output_dir: Interpolation key 'nope' not found"):
        resolve_recipe({**base, "output_dir": "runs/${nope}"})


def test_stage_ids_must_be_unique():
    with pytest.raises(ConfigError) as err:
        resolve_recipe({"stages": [{"id": "rl", "name": "grpo"}, {"id": "rl", "name": "sft"}]})
    assert str(err.value) == "stages: stage ids must be unique; give the stages distinct 'id:' values (rl)"
    # without an id a stage is known by its algorithm's name, so two of the same clash too
    with pytest.raises(ConfigError, match=r"distinct 'id:' values \(grpo\)"):
        resolve_recipe({"stages": [{"name": "grpo"}, {"name": "grpo"}]})
    ids = [s.get("id") for s in resolve_recipe({"stages": [{"name": "grpo"}, {"name": "grpo", "id": "rl2"}]})["stages"]]
    assert ids == [None, "rl2"]
    with pytest.raises(ConfigError, match="at least one stage"):
        resolve_recipe({"name": "empty"})


def test_overrides_by_stage_id_and_index():
    cfg = {
        "stages": [{"id": "warmup", "name": "sft", "steps": 5}, {"name": "grpo", "steps": 5, "reward": "exact_match"}]
    }
    apply_overrides(
        cfg,
        [
            "stages.warmup.steps=3",
            "stages.1.steps=4",
            "stages.grpo.max_tokens=6",
            "stages.-1.reward.strip=false",
            "backend.device=cpu",
            "loggers=[jsonl]",
        ],
    )
    assert cfg["stages"][0]["steps"] == 3
    assert cfg["stages"][1] == {
        "name": "grpo",
        "steps": 4,
        "max_tokens": 6,
        "reward": {"name": "exact_match", "strip": False},
    }
    assert cfg["backend"] == {"device": "cpu"} and cfg["loggers"] == ["jsonl"]
    # a key the recipe does not set merges with the default ({name: local}), it does not replace it
    assert resolve_recipe(cfg)["backend"] == {"name": "local", "device": "cpu"}


# --------------------------------------------------------------------------- Registry.build
@dataclass
class Scaled:
    """A dataclass factory: its fields are its config keys."""

    factor: float
    offset: float = 0.0
    tags: list = field(default_factory=lambda: ["a"])  # type: ignore[type-arg]
    fn: Any = None

    def __call__(self, completion: str, example: dict) -> float:
        return self.factor * len(completion) + self.offset


def make_threshold(threshold: int, strict: bool = True, scale=2.0):
    """A function factory: its signature gives the config keys (and their types)."""
    return lambda completion, example: (
        scale * float(len(completion) > threshold if strict else len(completion) >= threshold)
    )


def make_anything(**kwargs):
    """A factory taking **kwargs accepts any key."""
    return kwargs


class WithParams:
    """A factory with a ``Params`` dataclass: that is its schema, whatever __init__ looks like."""

    @dataclass
    class Params:
        k: int = 1

    def __init__(self, **kwargs):
        self.kwargs = kwargs


class Logs:
    """A factory with a runtime (context) argument that is not a config key."""

    def __init__(self, output_dir: str, every: int = 1):
        self.output_dir, self.every = output_dir, every


class Factories:
    @hookimpl
    def register_rewards(self, register):
        register("scaled", Scaled)
        register("threshold", make_threshold)
        register("anything", make_anything)
        register("with_params", WithParams)

    @hookimpl
    def register_loggers(self, register):
        register("logs", Logs)


@pytest.fixture
def reg() -> Registry:
    r = Registry(entry_points=False, strict=True)
    r.add_plugin(Factories(), PluginInfo("factories", "test-dist", "1.0", "tests"))
    return r


def test_build_dataclass_factory(reg):
    built = reg.build("reward", {"name": "scaled", "factor": 2}, "stages[0].reward")
    assert built == Scaled(factor=2.0) and isinstance(built.factor, float)  # int converted to the field's type
    assert built("abc", {}) == 6.0
    assert reg.build("reward", {"name": "scaled", "factor": 1, "tags": ["x", "y"]}).tags == ["x", "y"]
    with pytest.raises(ConfigError) as err:
        reg.build("reward", {"name": "scaled", "factor": 1, "ofset": 1}, "stages[0].reward")
    assert str(err.value) == (
        "stages[0].reward.ofset: unknown key 'ofset'. Did you mean 'offset'? Valid keys: factor, fn, offset, tags"
    )
    with pytest.raises(ConfigError, match=r"^stages\[0\]\.reward\.factor: missing required key 'factor'$"):
        reg.build("reward", {"name": "scaled"}, "stages[0].reward")
    with pytest.raises(ConfigError, match=r"^stages\[0\]\.reward\.factor: .*could not be converted to Float"):
        reg.build("reward", {"name": "scaled", "factor": "big"}, "stages[0].reward")
    with pytest.raises(ConfigError, match=r"^stages\[0\]\.reward: a component needs 'name: <registered name>'"):
        reg.build("reward", {"factor": 1}, "stages[0].reward")


def test_build_function_factory(reg):
    assert reg.build("reward", {"name": "threshold", "threshold": 2})("abc", {}) == 2.0
    assert reg.build("reward", {"name": "threshold", "threshold": 3, "strict": False, "scale": 5})("abc", {}) == 5.0
    with pytest.raises(ConfigError, match=r"^reward\.threshold: missing required key 'threshold'$"):
        reg.build("reward", "threshold")
    with pytest.raises(ConfigError, match=r"^reward\.threshold: .*could not be converted to Integer"):
        reg.build("reward", {"name": "threshold", "threshold": "two"})
    with pytest.raises(
        ConfigError, match=r"^reward\.threshhold: unknown key 'threshhold'\. Did you mean 'threshold'\?"
    ):
        reg.build("reward", {"name": "threshold", "threshhold": 2})
    schema = params_schema(make_threshold)
    assert [f.name for f in dataclasses.fields(schema)] == ["threshold", "strict", "scale"]


def test_build_kwargs_factory_accepts_any_key(reg):
    assert params_schema(make_anything) is None
    assert reg.build("reward", {"name": "anything", "a": 1, "nested": {"b": [1, 2]}}) == {
        "a": 1,
        "nested": {"b": [1, 2]},
    }
    assert reg.build("reward", "anything") == {}


def test_build_params_dataclass_and_context(reg):
    assert reg.build("reward", {"name": "with_params", "k": 3}).kwargs == {"k": 3}
    with pytest.raises(ConfigError, match=r"reward\.j: unknown key 'j'"):
        reg.build("reward", {"name": "with_params", "j": 3})
    # context arguments are passed by the caller, never read from config
    logs = reg.build("logger", {"name": "logs", "every": 5}, "loggers[0]", output_dir="/tmp/x")
    assert (logs.output_dir, logs.every) == ("/tmp/x", 5)
    with pytest.raises(ConfigError, match=r"^loggers\[0\]\.output_dir: unknown key 'output_dir'"):
        reg.build("logger", {"name": "logs", "output_dir": "/elsewhere"}, "loggers[0]", output_dir="/tmp/x")


def test_lazy_targets_are_imported_on_first_use_only():
    class Lazy:
        @hookimpl
        def register_rewards(self, register):
            register("lazy", "tests_lazy_target_module:Thing")
            register("broken", "tempering.plugins.rewards.basic:NoSuchThing")

    reg = Registry(entry_points=False, strict=True)
    reg.add_plugin(Lazy(), PluginInfo("lazy", "lazy-dist", "2.0", "tests"))
    comp = reg.get("reward", "lazy")
    assert comp.target == "tests_lazy_target_module:Thing"  # listing does not import it
    with pytest.raises(
        PluginError,
        match=r"reward 'lazy' from lazy-dist points to 'tests_lazy_target_module:Thing', "
        r"which cannot be loaded: ModuleNotFoundError",
    ):
        reg.build("reward", "lazy")
    with pytest.raises(PluginError, match=r"cannot be loaded: AttributeError.*NoSuchThing"):
        reg.build("reward", "broken")
    from tempering.plugins.rewards.basic import ExactMatch

    builtin = Registry(entry_points=True).get("reward", "tempering:exact_match")
    assert builtin.target == "tempering.plugins.rewards.basic:ExactMatch" and builtin.load() is ExactMatch


def test_invalid_component_names_fail_the_plugin():
    class BadName:
        @hookimpl
        def register_rewards(self, register):
            register("dist:name", lambda: None)

    with pytest.raises(
        PluginError, match=r"register_rewards raised PluginError: bad-dist: invalid reward name 'dist:name'"
    ):
        Registry(entry_points=False, strict=True).add_plugin(BadName(), PluginInfo("bad", "bad-dist", "1", "tests"))


def test_a_recipe_file_round_trip(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(
        textwrap.dedent("""
        name: rt
        stages:
          - {name: sft, id: warmup, steps: 1}
    """),
        encoding="utf-8",
    )
    recipe = Recipe.from_yaml(str(path), ["stages.warmup.steps=9"])
    assert recipe.stages == [{"name": "sft", "id": "warmup", "steps": 9}]
    assert recipe.output_dir == "runs/rt"
    (tmp_path / "list.yaml").write_text("- a\n- b\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="must hold a mapping at the top level"):
        Recipe.from_yaml(str(tmp_path / "list.yaml"))
