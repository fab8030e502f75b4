"""Harnesses written against the plain ``openai`` SDK, trained through the ``agent`` sampler.

Each harness here is what a user already has: an async function that drives
``openai.AsyncOpenAI`` -- several turns, a tool call answered by the harness, and a context edit
(the harness starts over with a rewritten prompt). What must hold:

* a scripted model (fast): the rows the sampler builds are exactly the tokens the endpoint
  sampled, one row per context (``row_splits``), weights on the sampled tokens only, the
  sampler's logprobs; failures (a harness that raises, hangs past ``harness_timeout``, never
  calls the model, returns junk) are counted with their cause and traceback, never raised;
* ``grpo`` on the tiny chat model, local backend and Tinker (the local Tinker server): every row
  that reaches ``forward_backward`` is one the harness saw token for token (the ids and logprobs
  the endpoint returned to it), and the weights change;
* slow: on the calculator task, GRPO through a harness raises held-out accuracy like the
  ``environment`` sampler does (bound from measurement: docs/agents.md).

``openai`` is the ``openai`` extra: where it is not installed these tests are skipped, and
``.ci/run`` runs them in the agents venv.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tempering.hookspecs import hookimpl
from tempering.plugins.samplers.agent import episode_rows
from tempering.plugins.samplers.openai_endpoint import Call
from tempering.registry import get_registry
from tempering.rollouts.chat import ParsedResponse
from tempering.rollouts.rollout import SamplerContext, collect, rollout_metrics
from tempering.rollouts.scoring import RewardRunner
from tempering.runs.failures import failure_cause
from tempering.types import Completion, SamplingParams

pytestmark = pytest.mark.extras
pytest.importorskip(
    "openai", reason="openai is not installed (pip install 'tempering[openai]'): .ci/run runs this in its agents venv"
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        },
    }
]
TINY_CHAT = {
    "chat": True,
    "hidden_size": 32,
    "num_layers": 1,
    "num_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 128,
}

#: What each harness episode saw, by question: [(prompt ids, completion ids, logprobs), ...] per call.
SEEN: dict[str, list[list[tuple[list[int], list[int], list[float]]]]] = {}
_LOCK = threading.Lock()


async def ask(client: Any, messages: list[dict[str, Any]], seen: list[Any], **kw: Any) -> Any:
    """One chat call that asks for the token ids and logprobs, noted in ``seen``."""
    out = await client.chat.completions.create(
        model="policy", messages=messages, logprobs=True, extra_body={"return_token_ids": True}, **kw
    )
    choice = out.choices[0]
    seen.append((list(out.prompt_token_ids), list(choice.token_ids), [t.logprob for t in choice.logprobs.content]))
    return choice.message


async def edit_harness(client: Any, example: dict[str, Any]) -> float:
    """Ask with a tool; answer the tool call if the model made one (else say "and?"); ask
    again; then rewrite the context (a fresh prompt with a summary) and ask once more. The
    reward is the share of digits in what the model said (it varies for an untrained model)."""
    seen: list[Any] = []
    messages = [{"role": "user", "content": example["q"]}]
    said = []
    first = await ask(client, messages, seen, tools=TOOLS)
    messages.append(first.model_dump(exclude_none=True, exclude={"refusal", "annotations", "audio", "function_call"}))
    if first.tool_calls:
        args = json.loads(first.tool_calls[0].function.arguments or "{}")
        result = str(sum(v for v in args.values() if isinstance(v, int)))
        messages.append({"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": result})
    else:
        messages.append({"role": "user", "content": "and?"})
    said.append(first.content or "")
    second = await ask(client, messages, seen, tools=TOOLS)
    said.append(second.content or "")
    summary = [{"role": "user", "content": f"{example['q']} so far: {said[-1][:4]}"}]  # the context edit
    third = await ask(client, summary, seen)
    said.append(third.content or "")
    with _LOCK:
        SEEN.setdefault(example["q"], []).append(seen)
    text = "".join(said)
    return sum(c.isdigit() for c in text) / max(len(text), 1)


# --------------------------------------------------------------------------- a scripted model
@pytest.fixture(scope="module")
def renderer() -> Any:
    from tempering.plugins.models.tiny import tiny_llama

    _, tokenizer = tiny_llama(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, chat=True)
    return get_registry().build("renderer", "tiny_chat", "renderer", tokenizer=tokenizer)


class Scripted:
    """A sampling client whose model calls ``add(a=2,b=3)`` on its first turn of a context and
    answers "5" after it (and "7" to anything else), logprob -0.5 per token, policy version 4."""

    def __init__(self, renderer: Any) -> None:
        self.renderer = renderer
        self.requests = 0

    def sample(self, prompts: list[list[int]], n: int, params: SamplingParams) -> Future:
        self.requests += 1
        rows = []
        for prompt in prompts:
            text = self.renderer.decode(prompt)
            turn = (
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"function": {"name": "add", "arguments": {"a": 2, "b": 3}}}],
                }
                if text.endswith("?<|assistant|>")
                else {"role": "assistant", "content": "5" if "<|tool|>5" in text else "7"}
            )
            tokens = self.renderer.render_response(turn)[: params.max_tokens]
            rows.append([Completion(list(prompt), tokens, [-0.5] * len(tokens), "stop", policy_version=4)])
        done: Future = Future()
        done.set_result(rows)
        return done


def agent(renderer: Any, reward: Any = None, **keys: Any) -> Any:
    """The registered ``agent`` sampler, built the way a stage builds it."""
    reg = get_registry()
    context = SamplerContext(
        renderer.tokenizer,
        lambda: renderer,
        RewardRunner(reward) if reward is not None else None,
        build=lambda kind, spec, key: reg.build(kind, spec, key),
        factory=lambda kind, spec, key: reg.factory(kind, spec, f"sampler.{key}"),
    )
    return reg.build("sampler", {"name": "agent", **keys}, "sampler", context=context)


def test_rows_are_the_sampled_tokens_one_per_context(renderer: Any) -> None:
    SEEN.clear()
    model = Scripted(renderer)
    examples = [{"q": "2+3?"}, {"q": "1+4?"}]
    rollout = collect(
        agent(renderer, harness="test_agent_harness:edit_harness"), model, examples, 2, SamplingParams(max_tokens=24)
    )
    samples = [s for g in rollout.groups for s in g.samples]
    assert len(samples) == 4 and not any(s.failed for s in samples)
    call_tokens = renderer.render_response(
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "add", "arguments": {"a": 2, "b": 3}}}],
        }
    )
    for s in samples:
        [seen] = [e for e in SEEN[s.example["q"]] if True][:1]
        calls = [Call(p, Completion(p, t, lp, "stop"), ParsedResponse()) for p, t, lp in seen]
        expected, splits = episode_rows(calls)
        assert [r.tokens for r in s.trajectory.segments] == [r.tokens for r in expected]
        assert [r.weights for r in s.trajectory.segments] == [r.weights for r in expected]
        assert [r.logprobs for r in s.trajectory.segments] == [r.logprobs for r in expected]
        # the tool call and the tool's answer kept one row; the rewritten context started a second
        assert len(expected) == 2 and splits == 1 and s.trajectory.metrics["row_splits"] == 1.0
        first, second, third = seen
        assert first[1] == call_tokens and second[0][: len(first[0]) + len(first[1])] == first[0] + first[1]
        assert renderer.decode(second[1]) == "5<eos>" and renderer.decode(third[1]) == "7<eos>"
        assert s.trajectory.segments[0].tokens == second[0] + second[1]  # prompt, call, tool result, answer
        assert s.policy_version == 4 and s.trajectory.metrics["tool_calls"] == 1.0
        assert s.reward == pytest.approx(2 / 2)  # "5" and "7": every character a digit (the call has no text)
    metrics = rollout_metrics(rollout.groups)
    assert (
        metrics["env/turns_mean"] == 3.0
        and metrics["env/row_splits"] == 4.0
        and rollout.metrics["env/model_calls"] == 12.0
    )
    assert model.requests == 3  # lockstep: each round of the four episodes' calls is one batched request


async def raises(client: Any, example: dict[str, Any]) -> float:
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x?"}])
    raise KeyError("no 'answer' in the example")


async def hangs(client: Any, example: dict[str, Any]) -> float:
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x?"}])
    time.sleep(30)  # noqa: ASYNC251 - the point: it blocks its thread, which is only its own episode's loop
    return 1.0


async def silent(client: Any, example: dict[str, Any]) -> float:
    return 1.0


async def junk(client: Any, example: dict[str, Any]) -> Any:
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x?"}])
    return "five"


async def bad_request(client: Any, example: dict[str, Any]) -> Any:
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x?"}], temperature=0.2)


async def by_stage(client: Any, example: dict[str, Any]) -> None:
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])  # answered "7"


@pytest.mark.parametrize(
    ("harness", "cause", "error"),
    [
        ("raises", "harness_error", "harness: KeyError: \"no 'answer' in the example\""),
        ("hangs", "harness_timeout", "the harness did not return within 1 s (sampler.harness_timeout"),
        ("silent", "no_model_calls", "the harness returned without calling the model"),
        ("junk", "harness_error", "harness: returned a str"),
        ("bad_request", "harness_error", "the stage's temperature 1"),
    ],
)
def test_a_failing_harness_is_counted_with_its_cause_never_raised(
    renderer: Any, harness: str, cause: str, error: str
) -> None:
    t0 = time.perf_counter()
    rollout = collect(
        agent(renderer, harness=f"test_agent_harness:{harness}", harness_timeout=1),
        Scripted(renderer),
        [{"q": "1?"}],
        2,
        SamplingParams(max_tokens=8),
    )
    assert time.perf_counter() - t0 < 10
    metrics = rollout_metrics(rollout.groups)
    assert metrics["reward/failed"] == 2.0 and metrics[f"failed/{cause}"] == 2.0
    assert error in metrics["first_error"], metrics["first_error"]
    if harness == "raises":  # the harness's own frame is in the traceback rollouts.jsonl keeps
        assert "in raises\n    raise KeyError" in metrics[f"first_traceback/{cause}"]


async def hangs_before_calling(client: Any, example: dict[str, Any]) -> float:
    """Episode "hang?" never calls the model (it waits forever); the others call twice."""
    if example["q"] == "hang?":
        await asyncio.Event().wait()
    for _ in range(2):
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": example["q"]}])
    return 1.0


def test_a_hung_harness_holds_only_its_own_episode_in_lockstep(renderer: Any) -> None:
    """With the default ``batch_wait: null`` one harness that never calls the model fails
    alone (``harness_timeout``); the other seven finish, their calls still batched together
    (the hang holds the first batch for ``lockstep_wait`` only, never again)."""
    model = Scripted(renderer)
    examples = [{"q": "hang?"}] + [{"q": f"{i}?"} for i in range(7)]
    t0 = time.perf_counter()
    rollout = collect(
        agent(renderer, harness="test_agent_harness:hangs_before_calling", harness_timeout=4),
        model,
        examples,
        1,
        SamplingParams(max_tokens=8),
    )
    wall = time.perf_counter() - t0
    samples = [s for g in rollout.groups for s in g.samples]
    assert [s.failed for s in samples] == [True] + [False] * 7
    assert failure_cause(samples[0]) == "harness_timeout" and [s.reward for s in samples[1:]] == [1.0] * 7
    assert model.requests == 2  # the seven's two rounds of calls, each one batch
    assert wall < 10, wall


def test_a_harness_that_returns_none_is_scored_by_the_stage_reward(renderer: Any) -> None:
    def digits(completion: str, example: dict[str, Any]) -> float:
        return float(completion == "7")

    rollout = collect(
        agent(renderer, digits, harness="test_agent_harness:by_stage"),
        Scripted(renderer),
        [{"q": "1?"}],
        2,
        SamplingParams(max_tokens=8),
    )
    assert [s.reward for s in rollout.groups[0].samples] == [1.0, 1.0]


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({}, "sampler.harness: the agent sampler needs 'harness: module:function'"),
        ({"harness": "no_such_module_xyz:run"}, "sampler.harness: cannot import 'no_such_module_xyz:run'"),
        ({"harness": "test_agent_harness:nothing"}, "sampler.harness: module 'test_agent_harness' has no 'nothing'"),
        ({"harness": "test_agent_harness:TOOLS"}, "sampler.harness: 'test_agent_harness:TOOLS' is a list"),
        (
            {"harness": "test_agent_harness:ask"},
            "sampler.harness: 'test_agent_harness:ask' must take (client, example)",
        ),
        ({"harness": "test_agent_harness:silent", "harness_timeout": 0}, "sampler.harness_timeout: must be > 0"),
        ({"harness": "test_agent_harness:silent", "max_concurrent": 0}, "sampler.max_concurrent: must be >= 1"),
    ],
)
def test_bad_sampler_keys_are_one_line_before_anything_runs(keys: dict[str, Any], message: str) -> None:
    from tempering.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        get_registry().check("sampler", {"name": "agent", **keys}, "sampler", context=("context",))
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


class HarnessPlugin:
    """A third party's plugin that registers a harness by name, as an entry point would."""

    @staticmethod
    @hookimpl
    def register_harnesses(register: Any) -> None:
        register("calc_demo", "test_agent_harness:by_stage", description="answers once; the stage scores")


def test_a_registered_harness_is_named_like_any_component(renderer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``harness: calc_demo`` (and ``dist:calc_demo``) resolves through the registry; a name
    nothing registers is one line naming the kind's known names, before anything runs."""
    from tempering import registry as registry_module
    from tempering.errors import ConfigError
    from tempering.testing import make_registry

    monkeypatch.setattr(registry_module, "_default", make_registry(HarnessPlugin, dist="acme-agents"))

    def seven(completion: str, example: dict[str, Any]) -> float:
        return float(completion == "7")

    for name in ("calc_demo", "acme-agents:calc_demo"):
        rollout = collect(
            agent(renderer, seven, harness=name), Scripted(renderer), [{"q": "1?"}], 2, SamplingParams(max_tokens=8)
        )
        assert [s.reward for s in rollout.groups[0].samples] == [1.0, 1.0]
    with pytest.raises(ConfigError) as err:
        get_registry().check("sampler", {"name": "agent", "harness": "calc_dmeo"}, "sampler", context=("context",))
    text = str(err.value)
    assert text.startswith("sampler.harness: ") and "calc_demo" in text and "module:function" in text, text
    assert "\n" not in text


# --------------------------------------------------------------------------- grpo, for real
def recipe(tmp_path: Path, **backend: Any) -> dict[str, Any]:
    return {
        "name": "agent",
        "output_dir": str(tmp_path),
        "loggers": ["jsonl"],
        "seed": 0,
        **backend,
        "stages": [
            {
                "id": "rl",
                "name": "grpo",
                "steps": 2,
                "prompts_per_step": 2,
                "group_size": 3,
                "max_tokens": 6,
                "dataset": [{"q": f"{a}+{b}?"} for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]],
                "loss": {"name": "grpo", "loss_type": "dapo"},
                "optimizer": {"learning_rate": 1e-2},
                "sampler": {"name": "agent", "harness": "test_agent_harness:edit_harness", "max_total_tokens": 120},
            }
        ],
    }


def check_trained_rows(datums: list[Any], out: Path) -> None:
    """Every row that reached forward_backward is one a harness episode saw, token for token:
    its tokens, weight exactly on the tokens the endpoint returned as sampled, and those
    tokens' logprobs as the endpoint returned them."""
    expected = {}
    for episodes in SEEN.values():
        for seen in episodes:
            calls = [Call(p, Completion(p, t, lp, "stop"), ParsedResponse()) for p, t, lp in seen]
            for row in episode_rows(calls)[0]:
                expected[tuple(row.tokens)] = row
    assert datums
    for d in datums:
        tokens = tuple(d["input"] + d["target"][-1:])
        assert tokens in expected, "a trained row no harness saw"
        row = expected[tokens]
        assert [i for i, w in enumerate(d["weights"]) if w] == [i for i, w in enumerate(row.weights[1:]) if w]
        assert d["logprobs"] == pytest.approx(row.logprobs[1:], abs=1e-5)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r and "env/turns_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert math.isfinite(r["loss"]) and r["reward/failed"] == 0.0
        assert r["env/turns_mean"] == 3.0 and r["env/row_splits"] >= 6.0 and r["env/model_calls"] == 18.0


def test_grpo_trains_on_exactly_what_the_harness_saw_local(tmp_path: Path) -> None:
    import torch

    from tempering.plugins.backends.local.backend import LocalBackend
    from tempering.training.recipe import Recipe

    SEEN.clear()
    backend = LocalBackend(model="tiny_llama", model_kwargs=TINY_CHAT, num_threads=1)
    before = {k: v.clone() for k, v in backend.model.state_dict().items()}
    datums: list[dict[str, Any]] = []
    forward_backward = backend.forward_backward

    def spy(batch: Any, *args: Any, **kwargs: Any) -> Any:
        datums.extend(
            {"input": d.input_tokens, "target": d.target_tokens, "weights": d.weights, "logprobs": d.sampler_logprobs}
            for d in batch.data
        )
        return forward_backward(batch, *args, **kwargs)

    backend.forward_backward = spy  # type: ignore[method-assign]
    Recipe.from_dict(recipe(tmp_path)).run(backend=backend)
    check_trained_rows(datums, tmp_path)
    after = backend.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


@pytest.fixture
def chat_server(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    from fake_tinker import CHAT_KWARGS, serve

    from tempering.plugins.tinker_server.service import ServedModel

    yield from serve(monkeypatch, tmp_path, {"tiny_llama": ServedModel("tiny_llama", CHAT_KWARGS)})


def test_grpo_trains_on_exactly_what_the_harness_saw_tinker(tmp_path: Path, chat_server: Any) -> None:
    from tempering.plugins.backends.tinker.mapping import plain_datum
    from tempering.training.recipe import Recipe

    SEEN.clear()
    spec = recipe(tmp_path, backend={"name": "tinker", "base_model": "tiny_llama", "base_url": chat_server.url})
    Recipe.from_dict(spec).run()
    datums = []
    for fb in chat_server.bodies("ForwardBackward"):
        for datum in fb.data:
            row = plain_datum(datum)
            inputs = row["loss_fn_inputs"]
            datums.append(
                {
                    "input": row["model_input"],
                    "target": inputs["target_tokens"],
                    "weights": [float(lp != 0.0) for lp in inputs["logprobs"]],
                    "logprobs": inputs["logprobs"],
                }
            )
    check_trained_rows(datums, tmp_path)


class Multiplier:
    """A sampling client that solves the calculator task the intended way: ``mul`` with the
    question's factors, then the tool's result as the answer."""

    def __init__(self, renderer: Any) -> None:
        self.renderer = renderer

    def sample(self, prompts: list[list[int]], n: int, params: SamplingParams) -> Future:
        rows = []
        for prompt in prompts:
            text = self.renderer.decode(prompt)
            if "<|tool|>" in text:
                turn = {"role": "assistant", "content": text.rsplit("<|tool|>", 1)[1].split("<|", 1)[0]}
            else:
                a, b = text.split("<|user|>", 1)[1].split("<|", 1)[0].split("*")
                turn = {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"function": {"name": "mul", "arguments": {"a": int(a), "b": int(b)}}}],
                }
            tokens = self.renderer.render_response(turn)[: params.max_tokens]
            rows.append([Completion(list(prompt), tokens, [-0.5] * len(tokens), "stop")])
        done: Future = Future()
        done.set_result(rows)
        return done


def test_the_docs_example_harness_solves_the_calculator_task(renderer: Any) -> None:
    """examples/agent_harness.py's ``run`` (docs/agents.md section 2), given a model that calls
    ``mul`` right: every episode scores 1, in two calls that make one row."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    try:
        rollout = collect(
            agent(renderer, harness="agent_harness:run", max_total_tokens=96),
            Multiplier(renderer),
            [{"question": "37*84", "answer": "3108"}, {"question": "12*11", "answer": "132"}],
            2,
            SamplingParams(max_tokens=20),
        )
    finally:
        sys.path.remove(str(Path(__file__).resolve().parents[1] / "examples"))
    samples = [s for g in rollout.groups for s in g.samples]
    assert [s.reward for s in samples] == [1.0] * 4 and not any(s.failed for s in samples)
    assert all(len(s.trajectory.turns) == 2 and len(s.trajectory.segments) == 1 for s in samples)


def test_the_example_script_says_where_the_run_went(tmp_path, monkeypatch, capsys):
    """Issue 35 item 14: ``python examples/agent_harness.py`` trained and printed nothing."""
    import runpy
    from pathlib import Path

    monkeypatch.setenv("TEMPERING_PROGRESS", "0")
    monkeypatch.chdir(tmp_path)
    script = Path(__file__).resolve().parent.parent / "examples" / "agent_harness.py"
    runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out
    assert "Done. Metrics, plot and checkpoints are in runs/agent_harness_demo" in out
    assert "reward/mean=" in out
    assert (tmp_path / "runs" / "agent_harness_demo" / "metrics.jsonl").exists()
