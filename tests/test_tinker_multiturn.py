"""A multi-turn recipe (the ``environment`` sampler, GRPO) on the Tinker backend, through the
real SDK against the local Tinker server (tests/fake_tinker.py), and the same YAML on the local
backend.

The environment comes from a real installed distribution (an entry point written by the
``fake_dist`` fixture) and is named in the YAML by its registered name. On Tinker, what must
hold is what the service sees: every sample request carries the renderer's stop ids
explicitly, and each trajectory row reaches ``forward_backward`` with weight -- for the ``ppo``
built-in, which has no mask, a non-zero sampler logprob and advantage -- exactly on the tokens
the model sampled, and zero on the prompt, the tool results and the follow-up messages.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_tinker import CHAT_KWARGS, serve

from tempering.plugins.backends.tinker.mapping import plain_datum
from tempering.plugins.tinker_server.service import ServedModel

ENV_PLUGIN = '''
from tempering import hookimpl
from tempering.rollouts.environment import Environment, StepResult
from tempering.rollouts.tools import tool
from tool_envs import WithAdd


class AskedTwice(WithAdd):
    """Whatever the model says first, it is asked once more; the episode is worth the share of
    digits in its two turns (a reward that varies for an untrained model)."""

    async def reset(self, example):
        self.said = []
        return [{"role": "user", "content": example["q"]}]

    async def step(self, response):
        self.said.append(response.raw)
        if response.tool_calls and not response.parse_error:  # a real call: answer it, go on
            return await super().step(response)
        if len(self.said) == 1:
            return StepResult([{"role": "user", "content": "and?"}], reward=0.0, metrics={"asked_again": 1.0})
        text = "".join(self.said)
        return StepResult(reward=sum(c.isdigit() for c in text) / max(len(text), 1), done=True)


@hookimpl
def register_environments(register):
    register("asked_twice", AskedTwice, description="asks twice, rewards digits")
'''

RECIPE = """
name: multiturn
seed: 0
backend:
  name: local
  model: tiny_llama
  model_kwargs: {chat: true, hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64,
                 max_position_embeddings: 128}
  num_threads: 1
loggers: [jsonl]
stages:
  - id: rl
    name: grpo
    dataset:
      - {q: "1+2?", answer: "3"}
      - {q: "3+4?", answer: "7"}
      - {q: "5+6?", answer: "11"}
    sampler: {name: environment, environment: asked_twice, max_turns: 3}
    loss: {name: grpo, loss_type: dapo}
    steps: 2
    prompts_per_step: 2
    group_size: 3
    max_tokens: 6
    optimizer: {learning_rate: 1.0e-2}
"""


def _rl_rows(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("stage") == "rl" and "env/turns_mean" in r]


def _sampled_targets(tokens: list[int], samples: list[tuple[list[int], list[int]]]) -> set[int]:
    """Target positions (``tokens[1:]`` indices) of every span the model sampled in this row:
    after a generation prompt that the row starts with, the tokens sampled for it."""
    positions: set[int] = set()
    for prompt, sampled in samples:
        end = len(prompt) + len(sampled)
        if sampled and tokens[:end] == prompt + sampled:
            positions.update(range(len(prompt) - 1, end - 1))
    return positions


@pytest.fixture
def chat_server(monkeypatch, tmp_path):
    yield from serve(monkeypatch, tmp_path, {"tiny_llama": ServedModel("tiny_llama", CHAT_KWARGS)})


def test_a_multi_turn_recipe_trains_on_tinker_on_exactly_the_sampled_tokens(tmp_path, chat_server, fake_dist):
    from tempering.training.recipe import Recipe

    server = chat_server
    fake_dist("multiturn-env", ENV_PLUGIN)
    recipe = tmp_path / "multiturn.yaml"
    recipe.write_text(RECIPE)

    Recipe.from_yaml(str(recipe), [f"output_dir={tmp_path / 'local'}"]).run()
    with pytest.warns(UserWarning, match="ignores local-backend keys: model_kwargs, num_threads"):
        result = Recipe.from_yaml(str(recipe), [f"output_dir={tmp_path / 'tinker'}", "backend.name=tinker"]).run()
    assert result.metadata["components"]["environment:asked_twice"] == "multiturn-env 1.0"

    local, remote = _rl_rows(tmp_path / "local"), _rl_rows(tmp_path / "tinker")
    assert [r["step"] for r in local] == [r["step"] for r in remote] == [1, 2]
    for r in local + remote:  # the same episode metrics on both backends
        assert math.isfinite(r["loss"]) and r["reward/failed"] == 0.0 and r["env/masked"] == 0.0
        assert r["env/turns_mean"] >= 2.0 and r["env/asked_again"] >= 1.0 and r["env/model_calls"] >= 2.0
        assert sum(v for k, v in r.items() if k.startswith("env/stop/")) == pytest.approx(1.0)

    tokenizer = server.service.base("tiny_llama").tokenizer
    renderer_stop = [tokenizer.eos_token_id]  # tiny_chat ends a turn with EOS, and says so explicitly
    sampled = server.sampled  # (prompt, sampled tokens) of every sequence the server served
    requests = [r for r in server.bodies("Sample") if not r.prompt_logprobs]  # not scoring requests
    assert sum(r.num_samples for r in requests) == len(sampled) >= 2 * 6 * 2  # 2 steps x 6 episodes x at least 2 turns
    assert all(r.sampling_params.stop == renderer_stop for r in requests)

    fbs = server.bodies("ForwardBackward")
    assert [r.loss_fn for r in fbs] == ["ppo", "ppo"]
    multi = 0
    for fb in fbs:
        for datum in fb.data:
            row = plain_datum(datum)
            tokens = row["model_input"] + row["loss_fn_inputs"]["target_tokens"][-1:]
            expected = _sampled_targets(tokens, sampled)
            logprobs, advantages = row["loss_fn_inputs"]["logprobs"], row["loss_fn_inputs"]["advantages"]
            assert {i for i, x in enumerate(logprobs) if x != 0.0} == expected
            assert {i for i, x in enumerate(advantages) if x != 0.0} <= expected
            assert (
                len({advantages[i] for i in expected}) <= 1
            )  # one value per row: the sequence advantage times dapo's token-mean constant
            # the first sampled position follows a generation prompt: the row starts with a rendered prompt
            assert tokens[min(expected)] == tokenizer.convert_tokens_to_ids("<|assistant|>")
            multi += len([i for i in expected if i - 1 not in expected]) > 1  # more than one sampled span
    assert multi >= 1  # at least one row carries two model turns with the observation between them at weight 0
