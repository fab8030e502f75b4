"""The policy's OpenAI-compatible endpoint (``plugins/samplers/openai_endpoint.py``) over real HTTP,
and how an episode's calls become training rows (``episode_rows``).

The "model" is scripted: a ``ModelFn`` that answers each prompt with the assistant turn the test
wrote, rendered by ``tiny_chat`` (so it is exactly what a model emitting that turn samples), with
known logprobs and policy version. These tests need no ``openai`` package (httpx speaks to the
server, as the SDK does underneath); the harness tests through the SDK are test_agent_harness.py.
"""

from __future__ import annotations

import socket
from concurrent.futures import Future
from typing import Any

import httpx
import pytest

from tempering.plugins.samplers.agent import episode_rows, read_result
from tempering.plugins.samplers.openai_endpoint import Call, EndpointLimits, PolicyEndpoint
from tempering.registry import get_registry
from tempering.rollouts.chat import ParsedResponse
from tempering.types import Completion

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


@pytest.fixture(scope="module")
def renderer() -> Any:
    from tempering.plugins.models.tiny import tiny_llama

    _, tokenizer = tiny_llama(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, chat=True)
    return get_registry().build("renderer", "tiny_chat", "renderer", tokenizer=tokenizer)


class Scripted:
    """A ``ModelFn``: the k-th call of an episode answers with ``turns[k]`` (an assistant
    message, rendered), logprob -0.25 per token, policy version 7. Records each call."""

    def __init__(self, renderer: Any, turns: list[dict[str, Any]]) -> None:
        self.renderer, self.turns = renderer, turns
        self.calls: list[tuple[int, list[int], int]] = []

    def __call__(self, key: int, prompt: list[int], max_tokens: int) -> Future[Completion]:
        turn = self.turns[min(len(self.calls), len(self.turns) - 1)]
        self.calls.append((key, list(prompt), max_tokens))
        tokens = self.renderer.render_response(turn)
        stop = "stop" if len(tokens) <= max_tokens else "length"
        tokens = tokens[:max_tokens]
        done: Future[Completion] = Future()
        done.set_result(Completion(list(prompt), tokens, [-0.25] * len(tokens), stop, policy_version=7))
        return done


def call_add(a: int, b: int) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}],
    }


@pytest.fixture
def served(renderer: Any) -> Any:
    """``start(turns, **limits) -> (endpoint, episode, client, model)``: a started endpoint (closed
    after the test), one open episode and an httpx client with the endpoint's token."""
    opened: list[Any] = []

    def start(turns: list[dict[str, Any]], **limits: Any) -> tuple[PolicyEndpoint, Any, httpx.Client, Scripted]:
        model = Scripted(renderer, turns)
        endpoint = PolicyEndpoint(
            model, renderer, renderer.tokenizer, EndpointLimits(**{"max_tokens": 24, **limits})
        ).start()
        episode = endpoint.open_episode(3)
        client = httpx.Client(
            base_url=episode.base_url, headers={"Authorization": f"Bearer {endpoint.token}"}, timeout=10
        )
        opened.append((endpoint, client))
        return endpoint, episode, client, model

    yield start
    for endpoint, client in opened:
        client.close()
        endpoint.close()


def test_a_tool_call_comes_back_in_openai_form_and_every_call_is_recorded(served: Any, renderer: Any) -> None:
    _endpoint, episode, client, model = served([call_add(2, 3), {"role": "assistant", "content": "5"}])
    messages = [{"role": "user", "content": "2+3?"}]
    first = client.post(
        "/chat/completions",
        json={"model": "policy", "messages": messages, "tools": TOOLS, "logprobs": True, "return_token_ids": True},
    ).json()
    [choice] = first["choices"]
    assert choice["finish_reason"] == "tool_calls"
    [tool_call] = choice["message"]["tool_calls"]
    assert tool_call["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'} and tool_call["id"] == "call_0_0"
    sampled = renderer.render_response(call_add(2, 3))
    assert (
        choice["token_ids"] == sampled and first["prompt_token_ids"] == renderer.render_prompt(messages, TOOLS).tokens
    )
    assert [t["logprob"] for t in choice["logprobs"]["content"]] == [-0.25] * len(sampled)
    assert first["system_fingerprint"] == "tempering-policy-v7"
    assert first["usage"] == {
        "prompt_tokens": len(first["prompt_token_ids"]),
        "completion_tokens": len(sampled),
        "total_tokens": len(first["prompt_token_ids"]) + len(sampled),
    }

    messages += [choice["message"], {"role": "tool", "tool_call_id": "call_0_0", "content": "5"}]
    second = client.post("/chat/completions", json={"model": "x", "messages": messages, "tools": TOOLS}).json()
    assert second["choices"][0]["message"] == {"role": "assistant", "content": "5"}
    assert second["choices"][0]["finish_reason"] == "stop" and second["model"] == "x"
    assert [c.completion.tokens for c in episode.calls] == [
        sampled,
        renderer.render_response({"role": "assistant", "content": "5"}),
    ]
    assert [key for key, _, _ in model.calls] == [3, 3]  # the episode's key orders its requests in a batch
    # the history the harness sent back re-renders to the first call's prompt + its sample: one row
    rows, splits = episode_rows(episode.calls)
    assert splits == 0 and len(rows) == 1
    assert rows[0].tokens[: len(first["prompt_token_ids"]) + len(sampled)] == first["prompt_token_ids"] + sampled
    assert client.get("/models").json()["data"][0]["id"] == "policy"


def test_n_stop_strings_and_text_completions(served: Any, renderer: Any) -> None:
    _endpoint, episode, client, model = served([{"role": "assistant", "content": "12345"}])
    out = client.post(
        "/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "n": 3, "stop": ["3"]}
    ).json()
    assert [c["message"]["content"] for c in out["choices"]] == ["12"] * 3 and [c["index"] for c in out["choices"]] == [
        0,
        1,
        2,
    ]
    assert all(c["finish_reason"] == "stop" for c in out["choices"])
    # the recorded completion is cut after the token that completed the stop string: what the harness saw
    assert [renderer.decode(c.completion.tokens) for c in episode.calls] == ["123"] * 3
    text = client.post("/completions", json={"prompt": "12+3=", "max_tokens": 2, "logprobs": 1}).json()
    [choice] = text["choices"]
    assert choice["finish_reason"] == "length" and choice["text"] == "12"
    assert choice["logprobs"]["token_logprobs"] == [-0.25, -0.25] and model.calls[-1][2] == 2
    ids = client.post("/completions", json={"prompt": [1, 5, 6], "max_tokens": 4, "return_token_ids": True}).json()
    assert ids["prompt_token_ids"] == [1, 5, 6] and model.calls[-1][1] == [1, 5, 6]


@pytest.mark.parametrize(
    ("body", "param", "reason"),
    [
        ({"messages": []}, "messages", "messages must be a non-empty list"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0]", "role must be one of"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content",
            "only text parts",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "stream": True}, "stream", "streaming is not supported"),
        (
            {"messages": [{"role": "user", "content": "x"}], "temperature": 0.3},
            "temperature",
            "the stage's temperature 1",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "n": 99}, "n", "n must be an integer between 1 and 8"),
        (
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
            "max_tokens",
            "max_tokens must be an integer >= 1",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs", "not supported"),
        (
            {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
            "tool_choice",
            "use 'auto' or 'none'",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            "tools[0]",
            "must be {type: function",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "stop": [1, 2]}, "stop", "stop must be"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [{"function": {"name": "add", "arguments": "{oops"}}],
                    }
                ]
            },
            "messages[0].tool_calls",
            "is malformed",
        ),
        (
            {"messages": [{"role": "user", "content": "x" * 200}]},
            "messages",
            "leaves no room within the context budget",
        ),
        *(
            ({"messages": [{"role": "user", "content": "x"}], key: value}, key, reason)
            for key, value, reason in [
                (
                    "response_format",
                    {"type": "json_object"},
                    'response_format={"type": "json_object"} is not supported',
                ),
                ("response_format", {"type": "json_schema", "json_schema": {"name": "x"}}, "constrained decoding"),
                ("logit_bias", {"5": 100}, 'logit_bias={"5": 100} is not supported'),
                ("presence_penalty", 0.5, "presence_penalty=0.5 is not supported"),
                ("frequency_penalty", -1, "frequency_penalty=-1 is not supported"),
                ("seed", 3, "seed=3 is not supported"),
                ("parallel_tool_calls", False, "parallel_tool_calls=false is not supported"),
                ("reasoning_effort", "low", 'reasoning_effort="low" is not supported'),
            ]
        ),
    ],
)
def test_a_bad_request_is_an_openai_style_400_with_the_reason(served: Any, body: dict, param: str, reason: str) -> None:
    _endpoint, episode, client, model = served([{"role": "assistant", "content": "1"}], max_total_tokens=100)
    response = client.post("/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and reason in error["message"], error
    assert not episode.calls and not model.calls  # refused before sampling


def test_bad_bodies_routes_and_methods(served: Any) -> None:
    _endpoint, _episode, client, model = served([{"role": "assistant", "content": "1"}])
    assert (
        client.post("/chat/completions", content=b"{not json")
        .json()["error"]["message"]
        .startswith("the request body is not valid JSON")
    )
    assert client.post("/chat/completions", json=[1, 2]).status_code == 400
    assert (
        client.post("/completions", json={"prompt": [999999]})
        .json()["error"]["message"]
        .startswith("prompt token id 999999")
    )
    assert client.post("/completions", json={"prompt": "x", "echo": True}).status_code == 400
    outside = client.post("/completions", json={"prompt": "Zebra"})  # the tiny vocabulary has no capitals
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "prompt", outside.text
    assert "cannot be encoded by the model's tokenizer" in outside.json()["error"]["message"]
    unknown = client.post("/embeddings", json={})
    assert unknown.status_code == 404 and "/v1/chat/completions" in unknown.json()["error"]["message"]
    assert client.get("/chat/completions").status_code == 405
    assert not model.calls


def test_the_endpoint_is_loopback_only_token_guarded_per_episode_and_gone_after(served: Any, renderer: Any) -> None:
    endpoint, episode, client, model = served([{"role": "assistant", "content": "1"}])
    body = {"messages": [{"role": "user", "content": "x"}]}
    assert endpoint.url.startswith("http://127.0.0.1:")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": endpoint.token}):
        denied = httpx.post(f"{episode.base_url}/chat/completions", json=body, headers=headers)
        assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
    other = PolicyEndpoint(model, renderer, renderer.tokenizer, EndpointLimits(max_tokens=4)).start()
    try:
        assert other.token != endpoint.token and len(endpoint.token) >= 40  # a fresh random token per server
    finally:
        other.close()
    wrong_episode = httpx.post(
        episode.base_url.rsplit("/", 2)[0] + "/0123456789abcdef/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {endpoint.token}"},
    )
    assert wrong_episode.status_code == 404 and wrong_episode.json()["error"]["code"] == "episode_not_found"
    assert client.post("/chat/completions", json=body).status_code == 200
    endpoint.end_episode(episode)
    assert client.post("/chat/completions", json=body).json()["error"]["code"] == "episode_not_found"
    port = int(endpoint.url.rsplit(":", 1)[1])
    endpoint.close()
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        pass
    assert len(model.calls) == 1


def test_a_model_that_does_not_answer_is_a_504_within_the_timeout(renderer: Any) -> None:
    def never(key: int, prompt: list[int], max_tokens: int) -> Future[Completion]:
        return Future()

    with PolicyEndpoint(never, renderer, renderer.tokenizer, EndpointLimits(max_tokens=4, timeout=0.3)) as endpoint:
        episode = endpoint.open_episode(0)
        response = httpx.post(
            f"{episode.base_url}/chat/completions",
            json={"messages": [{"role": "user", "content": "x"}]},
            headers={"Authorization": f"Bearer {endpoint.token}"},
            timeout=10,
        )
    assert response.status_code == 504 and "did not answer within 0.3 s" in response.json()["error"]["message"]
    assert not episode.calls


# ----------------------------------------------------------------------------- rows from calls
def recorded(prompt: list[int], sampled: list[int]) -> Call:
    return Call(
        prompt, Completion(prompt, sampled, [-float(t) for t in sampled], "stop", policy_version=2), ParsedResponse()
    )


def test_calls_that_extend_a_row_join_it_and_a_context_edit_starts_a_new_one() -> None:
    calls = [
        recorded([1, 2], [3, 4]),  # the first turn
        recorded([1, 2, 3, 4, 5, 6], [7]),  # the tool result (5, 6) and the next header appended
        recorded([1, 9], [8]),  # the harness rewrote its context: a new row
        recorded([1, 2, 3, 4, 5, 6, 7, 10], [11]),  # back on the first context: the first row goes on
    ]
    rows, splits = episode_rows(calls)
    assert splits == 1
    assert [r.tokens for r in rows] == [[1, 2, 3, 4, 5, 6, 7, 10, 11], [1, 9, 8]]
    assert [r.weights for r in rows] == [[0, 0, 1, 1, 0, 0, 1, 0, 1], [0, 0, 1]]
    assert [r.logprobs for r in rows] == [[0, 0, -3, -4, 0, 0, -7, 0, -11], [0, 0, -8]]


def test_n_choices_of_one_prompt_each_get_a_row_and_the_continued_one_grows() -> None:
    calls = [recorded([1], [2]), recorded([1], [3]), recorded([1, 3, 4], [5])]
    rows, splits = episode_rows(calls)
    assert [r.tokens for r in rows] == [[1, 2], [1, 3, 4, 5]] and splits == 1


def test_only_the_choices_the_harness_continued_are_trained(served: Any, renderer: Any) -> None:
    """``n: 3``, and the harness sends back only the second choice: by default (``n_choices:
    used``) the two it threw away are left out of the rows; ``all`` trains every choice."""
    from tempering.plugins.samplers.agent import trajectory_of

    _endpoint, episode, client, _model = served([{"role": "assistant", "content": c} for c in ("12", "3", "45", "6")])
    messages = [{"role": "user", "content": "hi"}]
    out = client.post("/chat/completions", json={"messages": messages, "n": 3}).json()
    messages += [out["choices"][1]["message"], {"role": "user", "content": "more"}]
    assert client.post("/chat/completions", json={"messages": messages}).status_code == 200
    used = trajectory_of(episode.calls)
    assert len(used.segments) == 1 and used.metrics["unused_choices"] == 2.0
    assert sum(used.segments[0].weights) == len(episode.calls[1].completion.tokens) + len(
        episode.calls[3].completion.tokens
    )
    every = trajectory_of(episode.calls, n_choices="all")
    assert len(every.segments) == 3 and "unused_choices" not in every.metrics


def test_the_rollout_log_keeps_every_call_with_its_token_ids(served: Any, renderer: Any) -> None:
    """``rollouts.jsonl``'s ``calls``: each call of the episode (not only the last transcript),
    with its exact ids and logprobs unless ``log_token_ids`` is off."""
    from tempering.plugins.samplers.agent import trajectory_of
    from tempering.runs.rollout_log import sample_record
    from tempering.types import Group, Sample

    _endpoint, episode, client, _model = served([call_add(2, 3), {"role": "assistant", "content": "5"}])
    first = [{"role": "user", "content": "2+3?"}]
    one = client.post("/chat/completions", json={"messages": first, "tools": TOOLS}).json()["choices"][0]["message"]
    edited = [{"role": "user", "content": "add 2 and 3"}]  # a context edit: not one transcript
    client.post("/chat/completions", json={"messages": edited}).raise_for_status()

    def record(**keys: Any) -> dict[str, Any]:
        traj = trajectory_of(episode.calls, **keys)
        sample = Sample(example={}, completion=episode.calls[-1].completion, trajectory=traj)
        return sample_record(sample, Group({}, [sample]), 0)

    calls = record()["calls"]
    assert [c["messages"] for c in calls] == [first, edited] and calls[0]["tools"] == TOOLS
    assert calls[0]["tool_calls"] == one["tool_calls"] and calls[0]["finish_reason"] == "tool_calls"
    assert calls[1]["completion"] == "5" and all(c["trained"] and c["policy_version"] == 7 for c in calls)
    for c, call in zip(calls, episode.calls):
        assert (c["prompt_ids"], c["completion_ids"], c["logprobs"]) == (
            call.prompt,
            call.completion.tokens,
            call.completion.logprobs,
        )
    assert "prompt_ids" not in record(token_ids=False)["calls"][0]


def test_what_a_harness_may_return() -> None:
    from tempering.rollouts.feedback import Scored

    assert read_result(1) == (1.0, {}, None) and read_result(None) == (None, {}, None)
    assert read_result({"reward": 0.5, "metrics": {"tools": 2}, "feedback": "close"}) == (0.5, {"tools": 2.0}, "close")
    assert read_result(Scored(0.0, "expected 5")) == (0.0, {}, "expected 5")
    with pytest.raises(TypeError, match="returned a str"):
        read_result("5")
    with pytest.raises(ValueError, match="unknown keys"):
        read_result({"score": 1})
    with pytest.raises(ValueError, match="not a finite number") as err:
        read_result({"reward": float("nan")})
    assert getattr(err.value, "cause", None) == "not_finite"


def test_a_burst_of_concurrent_calls_is_answered_not_refused(served: Any) -> None:
    """All of a batch's episodes call at once: the listen backlog must hold them (the standard
    library's default of 5 refused some of 256 episodes' connections: APIConnectionError)."""
    import http.client
    import json
    from concurrent.futures import ThreadPoolExecutor

    endpoint, episode, _, _ = served([{"role": "assistant", "content": "1"}])
    body = {"messages": [{"role": "user", "content": "x"}]}

    def one(_: int) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", int(endpoint.url.rsplit(":", 1)[1]), timeout=30)
        try:
            conn.request(
                "POST",
                f"/{episode.slug}/v1/chat/completions",
                json.dumps(body),
                {"Authorization": f"Bearer {endpoint.token}", "Content-Type": "application/json"},
            )
            return conn.getresponse().status
        finally:
            conn.close()

    with ThreadPoolExecutor(max_workers=128) as pool:
        statuses = list(pool.map(one, range(128)))
    assert statuses == [200] * 128 and len(episode.calls) == 128


def test_a_missing_extra_is_one_line_naming_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where openai / verifiers are not installed, a recipe that needs them fails validation
    with the pip command, before anything trains."""
    import importlib.util

    from tempering.errors import ConfigError
    from tempering.plugins.samplers import agent as agent_module

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(agent_module, "openai_missing", lambda: True)
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "verifiers" else find_spec(name, *a)
    )
    for spec, message in [
        (
            {"name": "agent", "harness": "x:y"},
            "sampler: the agent sampler gives harnesses an openai.AsyncOpenAI client, "
            "and openai is not installed: pip install 'tempering[openai]'",
        ),
        (
            {"name": "verifiers", "id": "vf_sums"},
            "sampler.id: verifiers is not installed: pip install 'tempering[verifiers]'",
        ),
    ]:
        with pytest.raises(ConfigError) as err:
            get_registry().check("sampler", spec, "sampler", context=("context",))
        assert str(err.value) == message
