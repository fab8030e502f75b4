"""Tests for the template's components. Run with ``pytest`` from this folder after
``pip install -e .`` (the last tests check the installed entry point)."""

from __future__ import annotations

import importlib.metadata as md
import math

import pytest
import torch

import tempering_plugin_template.plugin as plugin
from tempering.errors import ConfigError
from tempering.recipe import Recipe
from tempering.testing import FakeBackend, check_plugin, make_registry
from tempering_plugin_template.advantages import RankAdvantage
from tempering_plugin_template.rewards import LengthPenalty

DIST = "tempering-plugin-template"


def test_plugin_registers_both_components_and_their_targets_import():
    comps = check_plugin(plugin)
    assert sorted((c.kind, c.name) for c in comps) == [("advantage", "rank"), ("reward", "length_penalty")]
    assert {c.load() for c in comps} == {LengthPenalty, RankAdvantage}


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
    with pytest.raises(ConfigError, match=r"stages\[0\]\.reward\.max_char: unknown key 'max_char'\. Did you mean 'max_chars'\?"):
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
    with pytest.raises(ValueError, match="same length|one length"):
        RankAdvantage()(torch.zeros(3), torch.zeros(2, dtype=torch.long))


def test_in_a_grpo_stage(tmp_path):
    """The components inside a real GRPO stage, on a fake backend (no model needed)."""
    reg = make_registry(plugin, dist=DIST)  # tempering's built-ins + this plugin
    recipe = Recipe.from_dict({
        "name": "template", "output_dir": str(tmp_path), "loggers": [],
        "stages": [{"name": "grpo", "steps": 1, "prompts_per_step": 2, "group_size": 3, "max_tokens": 8,
                    "dataset": {"name": "arithmetic", "size": 4},
                    "reward": {"name": f"{DIST}:length_penalty", "max_chars": 1, "penalty": 0.5},
                    "advantage": f"{DIST}:rank"}],
    })
    backend = FakeBackend(complete=lambda prompt, i: "7" * (i + 1))  # lengths 1, 2, 3
    result = recipe.run(registry=reg, backend=backend)
    assert result.stages["grpo"]["reward/mean"] == pytest.approx((1.0 + 0.5 + 0.0) / 3)
    last_token_adv = [d.advantages[-1] for d in backend.batches[0].data]
    assert last_token_adv == pytest.approx([0.5, 0.0, -0.5] * 2)


def _installed() -> bool:
    try:
        md.distribution(DIST)
    except md.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not _installed(), reason=f"{DIST} is not installed: pip install -e . first")
def test_installed_entry_point_is_discovered(tempering_registry):
    for kind, name in [("reward", "length_penalty"), ("advantage", "rank")]:
        comp = tempering_registry.get(kind, name)
        assert comp.plugin.dist == DIST and comp.plugin.name == "template"
    assert not [p for p in tempering_registry.plugins if p.error]
