"""Tests for the template's components. Run with ``pytest`` from this folder after
``pip install -e .`` (the last tests check the installed entry point)."""

from __future__ import annotations

import asyncio
import importlib.metadata as md
import math

import pytest
import tempering_plugin_template.plugin as plugin
import torch
from tempering_plugin_template.advantages import RankAdvantage
from tempering_plugin_template.datasets import unit_questions
from tempering_plugin_template.environments import UnitConverter
from tempering_plugin_template.rewards import LengthPenalty

from tempering.errors import ConfigError
from tempering.rollouts.chat import ParsedResponse, ToolCall
from tempering.testing import FakeBackend, check_plugin, make_registry
from tempering.training.recipe import Recipe

DIST = "tempering-plugin-template"


def test_plugin_registers_its_components_and_their_targets_import():
    comps = check_plugin(plugin)
    assert sorted((c.kind, c.name) for c in comps) == [
        ("advantage", "rank"),
        ("dataset", "unit_questions"),
        ("environment", "unit_converter"),
        ("reward", "length_penalty"),
    ]
    assert {c.load() for c in comps} == {LengthPenalty, RankAdvantage, UnitConverter, unit_questions}
    # the dataset's three shapes (docs/writing-a-plugin.md#datasets)
    assert set(unit_questions("tasks", 2)[0]) == {"question", "answer"}
    assert set(unit_questions("transcripts", 2)[0]) == {"messages", "tools"}
    assert set(unit_questions("pairs", 2)[0]) == {"messages", "tools", "chosen", "rejected"}


def test_length_penalty():
    reward = LengthPenalty(max_chars=3, penalty=0.25)
    assert reward("abc", {}) == 1.0
    assert reward("  abc  ", {}) == 1.0  # stripped
    assert reward("abcde", {}) == 0.5
    assert reward("a" * 20, {}) == 0.0  # floored
    with pytest.raises(ValueError, match="max_chars and penalty must be >= 0"):
        LengthPenalty(max_chars=-1)


def test_config_keys_come_from_the_dataclass_fields():
    reg = make_registry(plugin)
    built = reg.build("reward", {"name": "length_penalty", "max_chars": 2}, "stages[0].reward")
    assert built == LengthPenalty(max_chars=2)
    with pytest.raises(
        ConfigError, match=r"stages\[0\]\.reward\.max_char: unknown key 'max_char'\. Did you mean 'max_chars'\?"
    ):
        reg.build("reward", {"name": "length_penalty", "max_char": 2}, "stages[0].reward")


def test_rank_advantage():
    rewards = torch.tensor([0.0, 1.0, 0.5, 2.0, 2.0, 3.0, 7.0, float("nan"), 1.0, 1.0])
    groups = torch.tensor([5, 5, 5, 9, 9, 2, 4, 4, 8, 8])
    adv = RankAdvantage(scale=2.0)(rewards, groups)
    expected = [-1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]  # ties, a singleton, a NaN, all equal
    assert adv.tolist() == expected
    four = RankAdvantage()(torch.tensor([3.0, 1.0, 2.0, 2.0]), torch.zeros(4, dtype=torch.long))
    assert four.tolist() == [0.5, -0.5, 0.0, 0.0]  # the tied pair shares rank 1.5
    assert math.isclose(float(four.sum()), 0.0, abs_tol=1e-7)
    with pytest.raises(ValueError, match=r"same length|one length"):
        RankAdvantage()(torch.zeros(3), torch.zeros(2, dtype=torch.long))


def test_in_a_grpo_stage(tmp_path):
    """The components inside a real GRPO stage, on a fake backend (no model needed)."""
    reg = make_registry(plugin, dist=DIST)  # tempering's built-ins + this plugin
    recipe = Recipe.from_dict(
        {
            "name": "template",
            "output_dir": str(tmp_path),
            "loggers": [],
            "stages": [
                {
                    "name": "grpo",
                    "steps": 1,
                    "prompts_per_step": 2,
                    "group_size": 3,
                    "max_tokens": 8,
                    "dataset": {"name": "arithmetic", "size": 4},
                    "reward": {"name": f"{DIST}:length_penalty", "max_chars": 1, "penalty": 0.5},
                    "advantage": f"{DIST}:rank",
                }
            ],
        }
    )
    backend = FakeBackend(complete=lambda prompt, i: "7" * (i + 1))  # lengths 1, 2, 3
    result = recipe.run(registry=reg, backend=backend)
    assert result.stages["grpo"]["reward/mean"] == pytest.approx((1.0 + 0.5 + 0.0) / 3)
    last_token_adv = [d.advantages[-1] for d in backend.batches[0].data]
    assert last_token_adv == pytest.approx([0.5, 0.0, -0.5] * 2)


def test_unit_converter_episode():
    """One episode by hand, as the environment sampler plays it: reset, a tool call, an answer."""
    env = make_registry(plugin).factory("environment", {"name": "unit_converter", "rel_tol": 0.01}, "environment")()
    assert env.rel_tol == 0.01

    async def episode():
        first = await env.reset({"question": "how many m is 3 km?", "answer": "3000"})
        [spec] = [t.spec() for t in env.tools()]
        call = ParsedResponse(tool_calls=[ToolCall("convert", {"value": 3, "unit": "km", "to": "m"}, "c0")])
        answered = await env.step(call)
        bad = await env.step(
            ParsedResponse(tool_calls=[ToolCall("convert", {"value": 3, "unit": "km", "to": "yd"}, "c1")])
        )
        right, wrong, junk = [await env.step(ParsedResponse(text=t)) for t in ("2999", "30", "three km")]
        return first, spec, answered, bad, right, wrong, junk

    first, spec, answered, bad, right, wrong, junk = asyncio.run(episode())
    assert first == [{"role": "user", "content": "how many m is 3 km?"}]
    assert spec["function"]["name"] == "convert"
    assert spec["function"]["parameters"]["required"] == ["value", "unit", "to"]
    assert spec["function"]["parameters"]["properties"]["value"] == {
        "type": "number",
        "description": "the length, in `unit`",
    }
    assert (answered.messages, answered.done, answered.metrics["tool_calls"]) == (
        [{"role": "tool", "tool_call_id": "c0", "name": "convert", "content": "3000"}],
        False,
        1.0,
    )
    # a tool that raises: the model reads the error as the tool's answer, the sampler counts it
    assert bad.messages[0]["content"] == "Error: ValueError: unknown unit 'yd': use one of mm, cm, m, km, in, ft, mi"
    assert (bad.done, bad.metrics["tool_errors"]) == (False, 1.0)
    assert [(r.reward, r.done) for r in (right, wrong, junk)] == [(1.0, True), (0.0, True), (0.0, True)]
    with pytest.raises(ConfigError, match=r"environment\.rel_tl: unknown key 'rel_tl'\. Did you mean 'rel_tol'\?"):
        make_registry(plugin).factory("environment", {"name": "unit_converter", "rel_tl": 1}, "environment")


def _installed() -> bool:
    try:
        md.distribution(DIST)
    except md.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not _installed(), reason=f"{DIST} is not installed: pip install -e . first")
def test_installed_entry_point_is_discovered(tempering_registry):
    for kind, name in [("reward", "length_penalty"), ("advantage", "rank"), ("environment", "unit_converter")]:
        comp = tempering_registry.get(kind, name)
        assert comp.plugin.dist == DIST and comp.plugin.name == "template"
    assert not [p for p in tempering_registry.plugins if p.error]
