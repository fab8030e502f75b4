"""The ``openenv`` environment against real OpenEnv servers (openenv-core 0.3).

The servers are openenv-core's own (``create_app`` over its ``Environment``/``Action``/
``Observation`` classes), run by uvicorn on loopback, with two small environments defined here:
``Guess`` (a typed ``guess: int`` action, offered to the model as a tool; hints back; reward 1 and
done on the right number, done after 3 tries) and ``Say`` (a ``message: str`` action filled with
the turn's text). Episodes are played by the registered ``environment`` sampler with a scripted
model rendered by ``tiny_chat``, and one short ``grpo`` run trains through the server. A wrong
``url`` is one line before training.

openenv-core pins its own ``mcp`` (it conflicts with verifiers'): these tests are marked
``extras`` and ``.ci/run`` runs them in a venv that has ``tempering[openenv]``; here they skip.
"""

from __future__ import annotations

import importlib.util
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import pytest

from tempering.registry import get_registry
from tempering.rollouts.rollout import SamplerContext, collect
from tempering.types import Completion, SamplingParams

HAVE_OPENENV = importlib.util.find_spec("openenv") is not None
needs_openenv = pytest.mark.skipif(
    not HAVE_OPENENV, reason="openenv-core is not installed (pip install 'tempering[openenv]')"
)
pytestmark = pytest.mark.extras


#: The targets the guess server was reset with, in order (the server runs in this process).
RESETS: list[int] = []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def guess_app(max_envs: int = 16) -> Any:
    from openenv.core.env_server.http_server import create_app
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State
    from pydantic import Field

    class GuessAction(Action):
        """Guess the hidden number."""

        guess: int = Field(..., description="your guess, 1 to 9")

    class GuessObservation(Observation):
        hint: str = Field(default="", description="higher, lower or right")
        tries: int = Field(default=0, description="guesses so far")

    class Guess(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self) -> None:
            super().__init__()
            self.target, self.tries, self._state = 5, 0, State(step_count=0)

        def reset(
            self, seed: int | None = None, episode_id: str | None = None, target: int = 5, **kwargs: Any
        ) -> GuessObservation:
            self.target, self.tries = int(target), 0
            RESETS.append(self.target)
            return GuessObservation(hint="guess a number from 1 to 9", reward=0.0)

        def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:  # type: ignore[override]
            self.tries += 1
            if action.guess == self.target:
                return GuessObservation(hint="right", tries=self.tries, reward=1.0, done=True)
            hint = "higher" if action.guess < self.target else "lower"
            return GuessObservation(hint=hint, tries=self.tries, reward=0.0, done=self.tries >= 3)

        @property
        def state(self) -> State:
            return self._state

    return create_app(Guess, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=max_envs)


def say_app() -> Any:
    from openenv.core.env_server.http_server import create_app
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State

    class SayAction(Action):
        message: str

    class SayObservation(Observation):
        heard: str = ""

    class Say(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> SayObservation:
            return SayObservation(heard="say hello")

        def step(self, action: SayAction, timeout_s: float | None = None, **kwargs: Any) -> SayObservation:  # type: ignore[override]
            done = action.message.strip() == "hello"
            return SayObservation(heard=f"you said {action.message}", reward=1.0 if done else 0.0, done=done)

        @property
        def state(self) -> State:
            return State(step_count=0)

    return create_app(Say, SayAction, SayObservation, env_name="say", max_concurrent_envs=16)


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, str]]:
    """Both apps served by uvicorn on loopback, stopped at the end."""
    import uvicorn

    running = []
    urls = {}
    for name, app in (("guess", guess_app()), ("say", say_app()), ("single", guess_app(max_envs=1))):
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline, f"the {name} server did not start"
            time.sleep(0.05)
        running.append((server, thread))
        urls[name] = f"http://127.0.0.1:{port}"
    yield urls
    for server, thread in running:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def renderer() -> Any:
    from tempering.plugins.models.tiny import tiny_llama

    _, tokenizer = tiny_llama(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, chat=True)
    return get_registry().build("renderer", "tiny_chat", "renderer", tokenizer=tokenizer)


class Scripted:
    """A sampling client that answers the episode of ``example['id']`` with its ``k``-th
    scripted assistant message at its ``k``-th turn."""

    def __init__(self, renderer: Any, turns: dict[str, list[dict[str, Any]]]) -> None:
        self.renderer, self.turns = renderer, turns

    def sample(self, prompts: list[list[int]], num_samples: int, params: SamplingParams) -> Future[Any]:
        out = []
        for prompt in prompts:
            text = self.renderer.decode(prompt)
            key = next(k for k in self.turns if f"<|user|>{k}" in text)
            turn = prompt.count(self.renderer.role_ids["assistant"]) - 1
            message = dict(self.turns[key][turn])
            cut = message.pop("cut", False)  # a turn the token limit cut: no stop token
            tokens = self.renderer.render_response(message)[: -1 if cut else None]
            out.append([Completion(list(prompt), tokens, [-0.1] * len(tokens), "length" if cut else "stop")])
        done: Future[Any] = Future()
        done.set_result(out)
        return done


def play(
    renderer: Any,
    env: dict[str, Any],
    examples: list[dict[str, Any]],
    turns: dict[str, list[dict[str, Any]]],
    group_size: int = 1,
) -> list[Any]:
    reg = get_registry()
    context = SamplerContext(
        renderer.tokenizer,
        lambda: renderer,
        None,
        build=lambda kind, spec, key: reg.build(kind, spec, key),
        factory=lambda kind, spec, key: reg.factory(kind, spec, key),
    )
    sampler = reg.build(
        "sampler", {"name": "environment", "environment": env, "max_turns": 4}, "sampler", context=context
    )
    rollout = collect(
        sampler, Scripted(renderer, turns), examples, group_size, SamplingParams(max_tokens=30, temperature=0.0)
    )
    return [s for g in rollout.groups for s in g.samples]


def act(guess: int) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "act", "arguments": {"guess": guess}}}],
    }


@needs_openenv
def test_the_typed_action_is_a_tool_and_the_server_scores_the_episode(servers: dict[str, str], renderer: Any) -> None:
    from tempering.plugins.environments.openenv import OpenEnv

    [tool] = OpenEnv(servers["guess"]).tools()
    assert tool.name == "act" and tool.description == "Guess the hidden number."
    assert tool.parameters["properties"]["guess"]["type"] == "integer" and tool.parameters["required"] == ["guess"]
    env = {"name": "openenv", "url": servers["guess"], "reset_keys": ["target"], "observation_field": "hint"}
    examples = [{"prompt": "a", "target": 5}, {"prompt": "b", "target": 7}, {"prompt": "c", "target": 2}]
    turns = {
        "a": [act(3), act(5)],  # higher, then right: reward 1 after two turns
        "b": [act(1), act(2), act(3)],  # three misses: the server ends it, reward 0
        "c": [{"role": "assistant", "content": "i give up"}],  # no action: the episode ends, worth 0
    }
    right, missed, quit_ = play(renderer, env, examples, turns)
    assert (right.reward, right.trajectory.stop, len(right.trajectory.turns)) == (1.0, "done", 2)
    shown = [m["content"] for m in right.trajectory.messages if m["role"] == "tool"]
    assert shown == ["higher", "right"]
    assert right.trajectory.messages[0]["content"] == "a\n\nguess a number from 1 to 9"
    assert (missed.reward, missed.trajectory.stop, len(missed.trajectory.turns)) == (0.0, "done", 3)
    assert (quit_.reward, len(quit_.trajectory.turns)) == (0.0, 1)
    assert right.trajectory.metrics["tool_calls"] == 2.0 and missed.trajectory.metrics["tool_errors"] == 0.0


@needs_openenv
def test_a_bad_action_is_the_tools_error_not_a_crash(servers: dict[str, str], renderer: Any) -> None:
    env = {"name": "openenv", "url": servers["guess"], "observation_field": "hint"}
    bad = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "act", "arguments": {"guess": "five"}}}],
    }
    [sample] = play(renderer, env, [{"prompt": "x"}], {"x": [bad, act(5)]})
    tool_said = [m["content"] for m in sample.trajectory.messages if m["role"] == "tool"]
    assert tool_said[0].startswith("Error:") and sample.trajectory.metrics["tool_errors"] == 1.0
    assert sample.reward == 1.0  # the server's validation error was the model's observation; it went on


@needs_openenv
def test_the_turns_text_as_the_action(servers: dict[str, str], renderer: Any) -> None:
    env = {"name": "openenv", "url": servers["say"], "action_field": "message"}
    turns = {"p": [{"role": "assistant", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    [sample] = play(renderer, env, [{"prompt": "p"}], turns)
    assert (sample.reward, sample.trajectory.stop, len(sample.trajectory.turns)) == (1.0, "done", 2)
    users = [m["content"] for m in sample.trajectory.messages if m["role"] == "user"]
    assert users == ['p\n\n{"heard":"say hello"}', '{"heard":"you said hi"}']


@needs_openenv
def test_a_one_session_server_plays_every_episode_of_a_step(servers: dict[str, str], renderer: Any) -> None:
    """openenv-core's default server holds one session (``max_concurrent_envs=1``) and states no
    limit: the sampler plays the step's 8 episodes one at a time, none refused."""
    from tempering.plugins.environments.openenv import OpenEnv

    assert OpenEnv(servers["single"]).max_concurrent == 1  # the documented default
    env = {"name": "openenv", "url": servers["single"], "reset_keys": ["target"], "observation_field": "hint"}
    examples = [{"prompt": p, "target": 5} for p in "abcd"]
    samples = play(renderer, env, examples, {p: [act(5)] for p in "abcd"}, group_size=2)
    assert [s.reward for s in samples] == [1.0] * 8, [s.error for s in samples]


@needs_openenv
def test_the_session_limit_the_server_states_is_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    from tempering.plugins.environments import openenv

    said = {"http://a/health": {"status": "healthy", "max_concurrent_envs": 3}, "http://b/metadata": {"name": "b"}}

    def get_json(url: str, timeout: float) -> Any:
        if url not in said:
            raise OSError("no route")
        return said[url]

    monkeypatch.setattr(openenv, "_get_json", get_json)
    monkeypatch.setattr(openenv, "_sessions", {})
    assert openenv.server_sessions("http://a", 1.0) == 3
    assert openenv.server_sessions("http://b", 1.0) == openenv.DEFAULT_SESSIONS == 1
    assert openenv.OpenEnv("http://b", max_sessions=4).max_concurrent == 4


@needs_openenv
@pytest.mark.parametrize(("policy", "reward", "cut_turns"), [({}, -1.0, 1.0), ({"cut_turn": "send"}, 1.0, None)])
def test_a_turn_cut_at_max_tokens_follows_the_cut_turn_policy(
    servers: dict[str, str], renderer: Any, policy: dict[str, Any], reward: float, cut_turns: float | None
) -> None:
    """The cut turn "hello" (no stop token): by default the episode ends with cut_turn_reward
    (-1, never the silent 0 that beat a real answer); ``cut_turn: send`` sends it and the
    server scores it."""
    env = {"name": "openenv", "url": servers["say"], "action_field": "message", **policy}
    [sample] = play(renderer, env, [{"prompt": "p"}], {"p": [{"role": "assistant", "content": "hello", "cut": True}]})
    assert sample.reward == reward and sample.trajectory.metrics.get("cut_turns") == cut_turns


@needs_openenv
def test_an_openenv_server_through_trls_environment_factory(servers: dict[str, str]) -> None:
    """The same server as a TRL environment (tempering.plugins.interop.trl): the action is TRL's
    tool, each call one step; the server's rewards are the episode's."""
    from transformers.utils import get_json_schema

    from tempering.plugins.interop import trl as tt

    guess = tt.environment_factory("openenv", url=servers["guess"], reset_keys=["target"], observation_field="hint")
    env = guess()
    assert env.reset(prompt=None, target=7) == "guess a number from 1 to 9"
    assert get_json_schema(env.act)["function"]["parameters"]["properties"]["guess"]["type"] == "integer"
    assert (env.act(guess=3), env.act(guess=7)) == ("higher", "right")
    assert tt.environment_reward([[{"role": "assistant", "content": ""}]], [env]) == [1.0]
    assert env.reset(prompt=None, target=2) == "guess a number from 1 to 9"  # the last episode's session closed


@needs_openenv
def test_grpo_trains_through_the_server(servers: dict[str, str], tmp_path: Any) -> None:
    """Two grpo steps on the tiny chat model (random: its turns do not parse, so each episode is
    one turn): every episode was a session on the server, reset with its example's target."""
    import json

    from tempering.training.recipe import Recipe

    data = tmp_path / "tasks.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"game {i}", "target": 1 + i % 9}) + "\n" for i in range(8)))
    recipe = Recipe.from_dict(
        {
            "name": "openenv_grpo",
            "seed": 0,
            "output_dir": str(tmp_path / "run"),
            "loggers": ["jsonl"],
            "backend": {
                "name": "local",
                "model": "tiny_llama",
                "num_threads": 1,
                "model_kwargs": {
                    "chat": True,
                    "hidden_size": 32,
                    "num_layers": 1,
                    "num_heads": 2,
                    "intermediate_size": 64,
                    "max_position_embeddings": 256,
                },
            },
            "stages": [
                {
                    "id": "rl",
                    "name": "grpo",
                    "renderer": "tiny_chat",
                    "steps": 2,
                    "prompts_per_step": 2,
                    "group_size": 2,
                    "max_tokens": 12,
                    "dataset": {"name": "jsonl", "path": str(data)},
                    "sampler": {
                        "name": "environment",
                        "max_turns": 2,
                        "environment": {"name": "openenv", "url": servers["guess"], "reset_keys": ["target"]},
                    },
                }
            ],
        }
    )
    before = len(RESETS)
    recipe.run()
    assert len(RESETS) - before == 2 * 2 * 2  # steps x prompts x group
    assert set(RESETS[before:]) <= {1 + i % 9 for i in range(8)}
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 2 and all(r["rollout/samples"] == 4 and r["reward/failed"] == 0 for r in steps)


@needs_openenv
def test_an_unreachable_server_is_one_line_before_training(rejects_before_training: Any) -> None:
    recipe = """
name: bad
output_dir: {out}
backend: {{name: local, model: tiny_llama, model_kwargs: {{chat: true}}}}
stages:
  - name: grpo
    renderer: tiny_chat
    dataset: {{name: tool_use, split: train, size: 4}}
    sampler: {{name: environment, environment: {{name: openenv, url: "http://127.0.0.1:9"}}}}
"""
    rejects_before_training(
        recipe, "seed=0", "stages[0].sampler.environment.url: no OpenEnv server answers at http://127.0.0.1:9"
    )


@pytest.mark.skipif(HAVE_OPENENV, reason="checks the message shown where openenv-core is missing")
def test_without_openenv_core_the_message_says_what_to_install() -> None:
    from tempering.plugins.environments.openenv import OpenEnv

    [problem, *_] = list(OpenEnv.check_config({"url": "http://127.0.0.1:9", "timeout": 1.0}))
    assert problem.key == "" and "pip install 'tempering[openenv]'" in problem.message
