"""The endpoint's token round trip: an assistant turn it returned, sent back in the history,
re-enters the next prompt as exactly the tokens that were sampled -- on token ids, for every
built-in renderer with tools, on real tokenizers (SmolLM2's for ``chatml``, tml-renderers'
bundled ones, the tiny models' for ``tiny_chat`` and ``hf_chat``).

The model is scripted: its first turn is a text + tool-call turn written the canonical way, with
a word split into other BPE pieces than the tokenizer's own (what a sampling model does), and,
for the Hermes formats, with the whitespace and JSON spacing SmolLM2 writes. The harness keeps
the returned message as it came and appends a tool result, as an OpenAI harness does.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_renderers import ADD, USER, templated_tokenizer

from tempering.plugins.renderers.plugin import TML_FAMILIES
from tempering.plugins.samplers.agent import episode_rows
from tempering.plugins.samplers.openai_endpoint import EndpointLimits, PolicyEndpoint
from tempering.registry import get_registry
from tempering.types import Completion

TURN = {
    "role": "assistant",
    "content": "let me add.",
    "tool_calls": [{"id": "call_0", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}],
}
#: SmolLM2's ways of writing a text + call turn that the Hermes parse does not keep.
HERMES_SHAPES = [
    'let me add.\n\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
    'let me add. <tool_call>{"name":"add","arguments":{"a":2,"b":3}}</tool_call>',
    '<tool_call>\n{"arguments": {"a": 2, "b": 3}, "name": "add"}\n</tool_call>\nlet me add.',
]


def build(name: str, tokenizer: Any = None) -> Any:
    return get_registry().build("renderer", name, "renderer", tokenizer=tokenizer)


def tool_renderers() -> list[str]:
    names = ["tiny_chat", "chatml", "hf_chat"]
    return names + [n for n in TML_FAMILIES if build(n).supports_tools]


def make(name: str) -> tuple[Any, Any]:
    """The renderer ``name`` and a tokenizer that encodes text to its ids."""
    if name == "tiny_chat":
        from tempering.plugins.models.tiny import tiny_llama

        _, tok = tiny_llama(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, chat=True)
        return build(name, tok), tok
    if name == "chatml":
        from transformers import AutoTokenizer

        from tempering.plugins.models.smollm2 import smollm2_folder

        tok = AutoTokenizer.from_pretrained(smollm2_folder())
        return build(name, tok), tok
    if name == "hf_chat":
        tok = templated_tokenizer()
        return build(name, tok), tok
    renderer = build(name)
    return renderer, renderer.lib_tokenizer


def encode(tokenizer: Any, text: str) -> list[int]:
    if hasattr(tokenizer, "encode_ordinary"):
        return list(tokenizer.encode_ordinary(text))
    return [int(i) for i in tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]]


def canonical_turn(renderer: Any) -> list[int]:
    """The tokens the renderer's own supervised rendering gives ``TURN`` after ``USER``."""
    prompt = renderer.render_prompt(USER, [ADD]).tokens
    row = renderer.render_training([*USER, TURN], [ADD])[-1]
    assert row.tokens[: len(prompt)] == prompt
    last = max(i for i, w in enumerate(row.weights) if w)
    return list(row.tokens[len(prompt) : last + 1])


def resplit(renderer: Any, tokenizer: Any, turn: list[int]) -> list[int] | None:
    """``turn`` with its first multi-letter word token written as two tokens: the same text in
    pieces the tokenizer would not choose (None when the vocabulary has no such token)."""
    for i, t in enumerate(turn):
        piece = renderer.decode([t])
        if len(piece.strip()) >= 2 and piece.strip().isalpha():
            pieces = encode(tokenizer, piece[:-1]) + encode(tokenizer, piece[-1:])
            if len(pieces) == 2 and renderer.decode(pieces) == piece:
                return [*turn[:i], *pieces, *turn[i + 1 :]]
    return None


def shapes(name: str, renderer: Any, tokenizer: Any) -> list[list[int]]:
    turn = canonical_turn(renderer)
    out = [turn]
    split = resplit(renderer, tokenizer, turn)
    if split is not None:
        out.append(split)
    if name in ("chatml", "hf_chat"):  # the Hermes tool-call formats
        end = renderer.stop()[0]
        out += [[*encode(tokenizer, text), end] for text in HERMES_SHAPES]
    return out


class Turns:
    """A ``ModelFn``: the first call samples ``first``, later ones the renderer's answer turn."""

    def __init__(self, renderer: Any, first: list[int], reason: str = "stop") -> None:
        self.first, self.reason = first, reason
        self.answer = [*canonical_answer(renderer)]
        self.calls = 0

    def __call__(self, key: int, prompt: list[int], max_tokens: int) -> Future[Completion]:
        tokens, reason = (self.first, self.reason) if self.calls == 0 else (self.answer, "stop")
        self.calls += 1
        done: Future[Completion] = Future()
        done.set_result(Completion(list(prompt), list(tokens), [-0.5] * len(tokens), reason))
        return done


def canonical_answer(renderer: Any) -> list[int]:
    answer = {"role": "assistant", "content": "it is 5."}
    prompt = renderer.render_prompt(USER).tokens
    row = renderer.render_training([*USER, answer])[-1]
    last = max(i for i, w in enumerate(row.weights) if w)
    return list(row.tokens[len(prompt) : last + 1])


def play(renderer: Any, tokenizer: Any, first: list[int]) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """Two chat calls as an OpenAI harness makes them: the returned message kept as it came,
    a tool result appended."""
    with PolicyEndpoint(Turns(renderer, first), renderer, tokenizer, EndpointLimits(max_tokens=256)) as endpoint:
        episode = endpoint.open_episode(0)
        with httpx.Client(
            base_url=episode.base_url, headers={"Authorization": f"Bearer {endpoint.token}"}, timeout=30
        ) as client:
            body: dict[str, Any] = {"messages": list(USER), "tools": [ADD], "return_token_ids": True}
            one = client.post("/chat/completions", json=body).json()
            message = one["choices"][0]["message"]
            calls = message.get("tool_calls") or [{"id": "call_x"}]
            body["messages"] += [message, {"role": "tool", "tool_call_id": calls[0]["id"], "content": "5"}]
            two = client.post("/chat/completions", json=body).json()
            assert "error" not in two, two
        return one, two, episode


#: Formats that rewrite an assistant turn in the history (they drop or reshape its reasoning
#: block): the model's format shows it a different turn than it wrote, so the follow-up is the
#: format's rendering and the episode's row splits there (never a row with unseen tokens).
REWRITES_HISTORY = {"qwen3", "qwen3_disable_thinking", "qwen3_5", "qwen3_8", "nemotron3"}


@pytest.mark.parametrize("name", tool_renderers())
def test_a_returned_turn_comes_back_as_the_tokens_sampled(name: str) -> None:
    renderer, tokenizer = make(name)
    for i, first in enumerate(shapes(name, renderer, tokenizer)):
        one, two, episode = play(renderer, tokenizer, first)
        sampled = one["prompt_token_ids"] + one["choices"][0]["token_ids"]
        assert one["choices"][0]["token_ids"] == first
        rows, splits = episode_rows(episode.calls)
        if name in REWRITES_HISTORY:
            assert two["prompt_token_ids"] == episode.calls[1].canonical and (len(rows), splits) == (2, 1)
            continue
        assert two["prompt_token_ids"][: len(sampled)] == sampled, (
            f"{name} shape {i}: the follow-up prompt re-rendered the turn {renderer.decode(first)!r} as "
            f"{renderer.decode(two['prompt_token_ids'][len(one['prompt_token_ids']) : len(sampled)])!r}"
        )
        assert (len(rows), splits) == (1, 0)
        assert [i for i, w in enumerate(rows[0].weights) if w] == [
            *range(len(one["prompt_token_ids"]), len(sampled)),
            *range(len(two["prompt_token_ids"]), len(rows[0].tokens)),
        ]


def test_a_turn_cut_at_max_tokens_is_closed_by_its_end_token_as_context() -> None:
    renderer, tokenizer = make("chatml")
    cut = encode(tokenizer, "let me think about this")[:3]
    with PolicyEndpoint(Turns(renderer, cut, "length"), renderer, tokenizer, EndpointLimits(max_tokens=3)) as endpoint:
        episode = endpoint.open_episode(0)
        headers = {"Authorization": f"Bearer {endpoint.token}"}
        url = f"{episode.base_url}/chat/completions"
        body: dict[str, Any] = {"messages": list(USER), "return_token_ids": True}
        one = httpx.post(url, json=body, headers=headers, timeout=30).json()
        assert one["choices"][0]["finish_reason"] == "length"
        body["messages"] += [one["choices"][0]["message"], {"role": "user", "content": "go on"}]
        two = httpx.post(url, json=body, headers=headers, timeout=30).json()
    sampled = one["prompt_token_ids"] + one["choices"][0]["token_ids"]
    assert two["prompt_token_ids"][: len(sampled) + 1] == [*sampled, renderer.stop()[0]]
    rows, _ = episode_rows(episode.calls)
    assert len(rows) == 1 and rows[0].weights[len(sampled)] == 0.0  # the closing token is context


def test_an_edited_turn_is_rendered_as_edited() -> None:
    """A harness that changed the returned text gets the renderer's rendering of its text (a new row)."""
    renderer, tokenizer = make("chatml")
    first = [
        *encode(tokenizer, 'let me add.\n\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'),
        renderer.stop()[0],
    ]
    with PolicyEndpoint(Turns(renderer, first), renderer, tokenizer, EndpointLimits(max_tokens=256)) as endpoint:
        episode = endpoint.open_episode(0)
        headers = {"Authorization": f"Bearer {endpoint.token}"}
        url = f"{episode.base_url}/chat/completions"
        body: dict[str, Any] = {"messages": list(USER), "tools": [ADD], "return_token_ids": True}
        one = httpx.post(url, json=body, headers=headers, timeout=30).json()
        edited = dict(one["choices"][0]["message"], content="I add.")
        body["messages"] += [edited, {"role": "tool", "tool_call_id": edited["tool_calls"][0]["id"], "content": "5"}]
        two = httpx.post(url, json=body, headers=headers, timeout=30).json()
    assert two["prompt_token_ids"] == renderer.render_prompt(body["messages"], [ADD]).tokens
    assert episode_rows(episode.calls)[1] == 1
    assert json.loads(edited["tool_calls"][0]["function"]["arguments"]) == {"a": 2, "b": 3}
