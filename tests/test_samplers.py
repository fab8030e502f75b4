"""Samplers are plugins: the built-ins are listed like any component, a third-party sampler
installed through its entry point drives an RL stage, and single-turn sampling keeps its
explicit stops and numbers."""

from __future__ import annotations

import json

import pytest

from tempering.apps import cli
from tempering.interfaces import model_renderer
from tempering.rollouts.rollout import collect, rollout_metrics
from tempering.rollouts.scoring import RewardRunner
from tempering.testing import FakeBackend
from tempering.training.evaluate import completion_sampler
from tempering.training.recipe import Recipe
from tempering.types import SamplingParams

TINY = {
    "name": "local",
    "model": "tiny_llama",
    "num_threads": 1,
    "model_kwargs": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64},
}

# A sampler from another package: it asks the model for one completion per sample, like an
# external agent harness would through its own client, and scores by length.
SCRIPTED = """
import asyncio
from tempering import hookimpl
from tempering.rollouts.rollout import Rollout
from tempering.types import Group, Sample

CALLS = []
LENGTHS = []  # the completions' token counts, per call: the rewards the stage must report

class Harness:
    def __init__(self, bonus: float = 0.0, context=None):
        self.bonus, self.context = bonus, context

    async def sample(self, client, examples, group_size, params, first_id=0):
        CALLS.append((len(examples), group_size, list(params.stop)))
        prompts = [self.context.tokenizer(e["prompt"])["input_ids"] for e in examples]
        comps = await asyncio.wrap_future(client.sample(prompts, group_size, params))
        groups = [Group(e, [Sample(e, c, reward=len(c.tokens) + self.bonus) for c in cs], first_id + i)
                  for i, (e, cs) in enumerate(zip(examples, comps))]
        LENGTHS.append([len(c.tokens) for cs in comps for c in cs])
        return Rollout(groups)

@hookimpl
def register_samplers(register):
    register("harness", "fake_harness_plugin:Harness", description="an external agent harness")
"""


def test_a_third_party_sampler_drives_an_rl_stage_by_name(fake_dist, tmp_path):
    module = fake_dist("fake-harness", SCRIPTED)
    stage = {
        "name": "grpo",
        "steps": 2,
        "prompts_per_step": 2,
        "group_size": 3,
        "max_tokens": 3,
        "dataset": {"name": "arithmetic", "size": 8},
        "sampler": {"name": "harness", "bonus": 0.5},
    }
    result = Recipe(name="h", output_dir=str(tmp_path), loggers=[], backend=TINY, stages=[stage]).run()
    import importlib

    harness = importlib.import_module(module)
    assert [c[:2] for c in harness.CALLS] == [(2, 3), (2, 3)]
    rows = [h for h in result.history if "reward/mean" in h]
    # its rewards (token count + the configured bonus) reached the stage, exactly
    assert len(rows) == 2 and [len(lengths) for lengths in harness.LENGTHS] == [6, 6]
    for row, lengths in zip(rows, harness.LENGTHS):
        assert row["reward/mean"] == pytest.approx(sum(lengths) / len(lengths) + 0.5)
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["components"]["sampler:harness"] == "fake-harness 1.0"


def test_a_misspelt_sampler_key_fails_before_training(fake_dist, tmp_path):
    fake_dist("fake-harness", SCRIPTED)
    stages = [{"name": "sft", "steps": 1}, {"name": "grpo", "steps": 1, "sampler": {"name": "harness", "bonsu": 1}}]
    from tempering.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^stages\[1\]\.sampler\.bonsu: unknown key 'bonsu'. Did you mean 'bonus'"):
        Recipe(name="h", output_dir=str(tmp_path), loggers=[], backend=TINY, stages=stages).run()
    assert not (tmp_path / "checkpoints").exists()  # nothing trained


def test_plugins_lists_the_rollout_kinds(capsys):
    assert cli.main(["plugins", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    kinds = {(c["kind"], c["name"]) for c in data["components"]}
    assert {("sampler", "completion"), ("sampler", "environment"), ("renderer", "tiny_chat")} <= kinds
    assert any(kind == "environment" for kind, _ in kinds)


def test_completion_sampler_sends_explicit_stops_and_counts_failures():
    backend = FakeBackend(complete=lambda prompt, i: ["1", "x"][i % 2])
    seen = []
    inner = backend.sample

    def spy(prompts, n, params):
        seen.append(list(params.stop))
        return inner(prompts, n, params)

    backend.sample = spy

    def reward(text, example):
        if text == "x":
            raise ValueError("not a number")
        return 1.0

    sampler = completion_sampler(backend.tokenizer, model_renderer(backend), RewardRunner(reward))
    rollout = collect(sampler, backend, [{"prompt": "1+0="}, {"prompt": "0+1="}], 2, SamplingParams(max_tokens=2))
    assert seen == [[backend.tokenizer.eos_token_id]]  # EOS is an explicit stop, not a backend default
    assert [[s.reward for s in g.samples] for g in rollout.groups] == [[1.0, 0.0], [1.0, 0.0]]
    m = rollout_metrics(rollout.groups)
    assert m["reward/failed"] == 2.0 and m["first_error"] == "ValueError: not a number"
    # user stop strings stay strings only (Tinker cannot mix strings and ids)
    collect(sampler, backend, [{"prompt": "1+0="}], 1, SamplingParams(max_tokens=2, stop=["\n"]))
    assert seen[-1] == ["\n"]
