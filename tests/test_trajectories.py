"""Acceptance tests of multi-turn trajectories on real models, real renderers, the real sampler.

Two set-ups, both through the registered ``environment`` sampler and :class:`LocalBackend`:
(a) ``tiny_llama(chat=True)`` with ``tiny_chat``, (b) ``tiny_qwen3`` -- the real Qwen3 tokenizer
-- with the real Qwen3 renderers of ``tml-renderers``. The environment never ends an episode,
so every episode runs its 3 turns. What must hold:

(i) a trajectory's rows weigh exactly the tokens the model produced (1) and nothing else (0),
    and every row is exactly what the model saw at its last turn plus what it sampled: no token
    the model never saw;
(ii) the sampler's logprobs on those tokens equal a forward pass of the same weights
     (``backend.logprobs``) to 1e-4, at temperature 1;
(iii) where the turns re-render as sampled, the whole episode is one row equal to the
      renderer's supervised rendering of the final conversation (RL and SFT tokenize alike);
      where they do not (history rewritten, a non-canonical turn), several rows.

(i) and (ii) are checked on episodes sampled from the random models; (iii) needs well-formed
turns, so :class:`ScriptedModel` answers with the renderer's own tokens for scripted assistant
turns and the model's logprobs of them.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest
from tool_envs import WithAdd

from tempering.registry import get_registry
from tempering.rollouts.environment import StepResult
from tempering.rollouts.rollout import SamplerContext, collect
from tempering.rollouts.trajectory import Trajectory
from tempering.types import Batch, Completion, SamplingParams, Segment

MAX_TURNS = 3


class KeepTalking(WithAdd):
    """Answers a tool call with the tool's result and anything else (an answer, a malformed
    turn) with a user message, so an episode lasts ``max_turns``."""

    async def reset(self, example: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"role": "user", "content": example["q"]}]

    async def step(self, response: Any) -> StepResult:
        if response.tool_calls and response.parse_error is None:
            return await super().step(response)
        return StepResult([{"role": "user", "content": "go on"}])


# --------------------------------------------------------------------------- set-ups
@pytest.fixture(scope="module")
def llama() -> Any:
    from tempering.plugins.backends.local import LocalBackend

    backend = LocalBackend(
        "tiny_llama",
        {
            "chat": True,
            "hidden_size": 32,
            "num_layers": 2,
            "num_heads": 2,
            "intermediate_size": 64,
            "max_position_embeddings": 512,
        },
        num_threads=1,
        threaded=False,
    )
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def qwen3() -> Any:
    from tempering.plugins.backends.local import LocalBackend

    backend = LocalBackend("tiny_qwen3", num_threads=1, threaded=False)
    yield backend
    backend.close()


def renderer_for(backend: Any, name: str = "auto") -> Any:
    from tempering.interfaces import model_renderer
    from tempering.rollouts.renderer import default_renderer_name

    spec = default_renderer_name(backend.tokenizer, model_renderer(backend)) if name == "auto" else name
    return get_registry().build("renderer", spec, "renderer", tokenizer=backend.tokenizer)


def run(
    client: Any,
    backend: Any,
    renderer: Any,
    examples: list[dict[str, Any]],
    group_size: int = 1,
    max_tokens: int = 64,
    seed: int | None = None,
) -> list[Trajectory]:
    """Episodes of :class:`KeepTalking` through the registered ``environment`` sampler."""
    reg = get_registry()
    context = SamplerContext(
        backend.tokenizer,
        lambda: renderer,
        None,
        build=lambda k, s, key: reg.build(k, s, key),
        factory=lambda k, s, key: reg.factory(k, s, key),
    )
    sampler = reg.build(
        "sampler",
        {"name": "environment", "environment": KeepTalking, "max_turns": MAX_TURNS},
        "sampler",
        context=context,
    )
    rollout = collect(
        sampler, client, examples, group_size, SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed)
    )
    trajectories = [s.trajectory for g in rollout.groups for s in g.samples]
    assert [(t.stop, len(t.turns)) for t in trajectories] == [("max_turns", MAX_TURNS)] * len(trajectories)
    return trajectories


# --------------------------------------------------------------------------- the checks
def check_rows(traj: Trajectory) -> list[list[int]]:
    """(i): each turn's prompt and completion start one row (in order), weight 1 sits exactly
    on the completions, logprobs are the sampler's, and a row ends with its last turn's
    completion, so all of it was in the model's context or produced by it. Returns which turns
    each row holds."""

    def starts(seg: Segment, c: Completion) -> bool:
        return seg.tokens[: len(c.prompt_tokens) + len(c.tokens)] == [*c.prompt_tokens, *c.tokens]

    rows: list[list[int]] = []
    for k, turn in enumerate(traj.turns):
        c = turn.completion
        assert turn.prompt_len == len(c.prompt_tokens)
        if not rows or not starts(traj.segments[len(rows) - 1], c):
            rows.append([])
        rows[-1].append(k)
        assert starts(traj.segments[len(rows) - 1], c), f"turn {k} is not where its row continues"
    assert len(rows) == len(traj.segments) == 1 + traj.metrics["row_splits"]
    for seg, held in zip(traj.segments, rows):
        last = traj.turns[held[-1]].completion
        assert seg.tokens == [*last.prompt_tokens, *last.tokens]
        weights, logprobs = [0.0] * len(seg.tokens), [0.0] * len(seg.tokens)
        for k in held:
            c = traj.turns[k].completion
            start = len(c.prompt_tokens)
            weights[start : start + len(c.tokens)] = [1.0] * len(c.tokens)
            logprobs[start : start + len(c.tokens)] = c.logprobs
        assert seg.weights == weights and seg.logprobs == logprobs
    return rows


def check_logprobs(backend: Any, trajectories: list[Trajectory]) -> int:
    """(ii): the rows' sampler logprobs against a forward pass; returns the tokens compared.
    One row per call: a batch of Qwen3 rows would hold ~150k logits per position at once."""
    compared = 0
    for d in [seg.to_datum() for t in trajectories for seg in t.segments]:
        [forward] = backend.logprobs(Batch([d])).result()
        pairs = [(f, s) for f, s, w in zip(forward, d.sampler_logprobs, d.weights) if w]
        assert max(abs(f - s) for f, s in pairs) < 1e-4
        compared += len(pairs)
    return compared


def check_equals_training_rendering(renderer: Any, traj: Trajectory) -> None:
    """(iii): the rows are the renderer's supervised rows of the final conversation."""
    last = max(i for i, m in enumerate(traj.messages) if m["role"] == "assistant")
    rows = renderer.render_training(traj.messages[: last + 1], traj.tools)
    assert [(s.tokens, s.weights) for s in traj.segments] == [(r.tokens, r.weights) for r in rows]


# --------------------------------------------------------------------------- scripted turns
class ScriptedModel:
    """A sampling client playing one episode: its ``k``-th answer is ``turns[k]`` (token ids),
    with the logprobs ``backend`` gives them after the prompt it was actually sent."""

    def __init__(self, backend: Any, turns: list[list[int]]) -> None:
        self.backend, self.turns = backend, list(turns)

    def sample(self, prompts: list[list[int]], num_samples: int, params: SamplingParams) -> Future:
        [prompt] = prompts  # one episode
        tokens = self.turns.pop(0)
        assert tokens[-1] in params.stop
        seg = Segment([*prompt, *tokens], [0.0] * len(prompt) + [1.0] * len(tokens))
        [lps] = self.backend.logprobs(Batch([seg.to_datum(logprobs=False)])).result()
        future: Future = Future()
        future.set_result([[Completion(list(prompt), list(tokens), lps[len(prompt) - 1 :], "stop")]])
        return future


def canonical_turns(renderer: Any, conversation: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[list[int]]:
    """The renderer's tokens for each assistant message of ``conversation``: the weight-1 tail
    of its supervised rendering up to that message, after the generation prompt."""
    out = []
    for i, m in enumerate(conversation):
        if m["role"] == "assistant":
            prompt = renderer.render_prompt(conversation[:i], tools).tokens
            row = renderer.render_training(conversation[: i + 1], tools)[-1]
            assert row.tokens[: len(prompt)] == prompt and row.weights[len(prompt) :] == [1.0] * (
                len(row.tokens) - len(prompt)
            )
            out.append(row.tokens[len(prompt) :])
    return out


def call(a: int, b: int, text: str = "", reasoning: str | None = None) -> dict[str, Any]:
    msg = {
        "role": "assistant",
        "content": text,
        "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}],
    }
    return {**msg, "reasoning_content": reasoning} if reasoning else msg


def answer(text: str, reasoning: str | None = None) -> dict[str, Any]:
    return {"role": "assistant", "content": text, **({"reasoning_content": reasoning} if reasoning else {})}


def tool_result(content: str, call_id: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "name": "add", "content": content}


def scripted(backend: Any, renderer: Any, turns: list[dict[str, Any]], call_id: str) -> Trajectory:
    """Play ``turns`` (two tool calls of ``add``, then an answer) through the sampler."""
    tools = [t.spec() for t in KeepTalking().tools()]
    conversation = [
        {"role": "user", "content": "what is 2+3+1?"},
        turns[0],
        tool_result("5", call_id.format(0)),
        turns[1],
        tool_result("6", call_id.format(1)),
        turns[2],
    ]
    model = ScriptedModel(backend, canonical_turns(renderer, conversation, tools))
    [traj] = run(model, backend, renderer, [{"q": "what is 2+3+1?"}])
    assert not model.turns
    assert [m["role"] for m in traj.messages] == ["user", "assistant", "tool", "assistant", "tool", "assistant", "user"]
    assert [[(c.name, c.arguments) for c in t.response.tool_calls] for t in traj.turns] == [
        [("add", {"a": 2, "b": 3})],
        [("add", {"a": 5, "b": 1})],
        [],
    ]
    assert [t.response.parse_error for t in traj.turns] == [None] * 3 and traj.turns[-1].response.text == turns[2][
        "content"
    ]
    return traj


# --------------------------------------------------------------------------- (i) and (ii): sampled episodes
@pytest.mark.parametrize("setup", ["llama", "qwen3"])
def test_sampled_episodes_weigh_exactly_the_sampled_tokens_with_the_models_logprobs(setup, request):
    backend = request.getfixturevalue(setup)
    renderer = renderer_for(backend)
    assert renderer.name == {"llama": "tiny_chat", "qwen3": "qwen3_instruct"}[setup]
    trajectories = run(backend, backend, renderer, [{"q": "what is 2+3?"}], group_size=2, max_tokens=8, seed=11)
    for traj in trajectories:
        check_rows(traj)
        for t in traj.turns:  # the turns end at the renderer's explicit stop ids, or at the limit
            assert (t.completion.stop_reason == "stop") == bool(
                t.completion.tokens and t.completion.tokens[-1] in renderer.stop()
            )
    assert check_logprobs(backend, trajectories) == sum(t.num_generated for t in trajectories) >= 2 * MAX_TURNS


# --------------------------------------------------------------------------- (iii): well-formed episodes
def test_tiny_chat_episode_is_one_row_equal_to_its_training_rendering(llama):
    renderer = renderer_for(llama)
    assert renderer.prefix_preserving
    traj = scripted(llama, renderer, [call(2, 3), call(5, 1), answer("6")], "call_{}_0")
    assert check_rows(traj) == [[0, 1, 2]]
    check_equals_training_rendering(renderer, traj)
    check_logprobs(llama, [traj])


def test_qwen3_episode_of_tool_calls_and_an_answer_is_one_row_equal_to_its_training_rendering(qwen3):
    renderer = renderer_for(qwen3)
    traj = scripted(qwen3, renderer, [call(2, 3), call(5, 1), answer("It is 6.")], "functions.add:{}")
    assert check_rows(traj) == [[0, 1, 2]]
    check_equals_training_rendering(renderer, traj)
    assert (
        renderer.decode(traj.turns[0].completion.tokens)
        == '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'
    )
    check_logprobs(qwen3, [traj])


def test_a_turn_that_does_not_re_render_as_sampled_starts_a_new_row(llama, qwen3):
    # tiny_chat: a call written with spaces parses, but history writes it canonically
    tiny = renderer_for(llama)
    spaced = [tiny.call_id, *llama.tokenizer("add( a=2 , b=3 )", add_special_tokens=False)["input_ids"], tiny.eos_id]
    model = ScriptedModel(llama, [spaced, tiny.render_response(call(5, 1)), tiny.render_response(answer("6"))])
    [traj] = run(model, llama, tiny, [{"q": "what is 2+3+1?"}])
    assert [c.arguments for t in traj.turns for c in t.response.tool_calls] == [{"a": 2, "b": 3}, {"a": 5, "b": 1}]
    assert check_rows(traj) == [[0], [1, 2]]
    # qwen3_instruct: text before a tool call is sampled as "." "\n" but history merges ".\n"
    instruct = renderer_for(qwen3)
    assert not instruct.prefix_preserving
    traj = scripted(
        qwen3, instruct, [call(2, 3, text="Let me add."), call(5, 1), answer("It is 6.")], "functions.add:{}"
    )
    assert check_rows(traj) == [[0], [1, 2]]
    check_equals_training_rendering(instruct, traj)  # tml-renderers' SFT splits it the same way
    # qwen3 with thinking: history drops each turn's reasoning
    thinking = renderer_for(qwen3, "qwen3")
    assert not thinking.prefix_preserving
    turns = [
        call(2, 3, reasoning="Add 2 and 3."),
        call(5, 1, reasoning="Now add 1."),
        answer("It is 6.", reasoning="Done."),
    ]
    traj = scripted(qwen3, thinking, turns, "functions.add:{}")
    assert [t.response.reasoning for t in traj.turns] == ["Add 2 and 3.", "Now add 1.", "Done."]
    assert check_rows(traj) == [[0], [1], [2]]
    check_logprobs(qwen3, [traj])
