"""The ``chatml`` renderer on SmolLM2-135M-Instruct's real tokenizer, and the rule for text prompts
in a stage with a chat renderer (a user turn; raw text with ``renderer: raw``).

Sampled turns are written as the ids a model emits: the turn's text in the tokenizer's own
encoding, then ``<|im_end|>`` (id 2). Assumes the smollm2 model is installed
(``tempering install-model smollm2``; CI installs it); only its tokenizer is loaded.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tempering.errors import ConfigError
from tempering.registry import get_registry
from tempering.rollouts.chat import ToolCall, assign_call_ids, tool_message
from tempering.rollouts.renderer import chat_text_prompts, default_renderer_name
from tempering.rollouts.rollout import collect
from tempering.rollouts.trajectory import TrajectoryBuilder
from tempering.training.evaluate import completion_sampler
from tempering.types import SamplingParams

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
USER = [{"role": "user", "content": "What is 2+3?"}]
IM_START, IM_END, NL = 1, 2, 198
#: "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
SMOL_SYSTEM = [
    1,
    9690,
    198,
    2683,
    359,
    253,
    5356,
    5646,
    11173,
    3365,
    3511,
    308,
    34519,
    28,
    7018,
    411,
    407,
    19712,
    8182,
    2,
    198,
]
#: "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
USER_TURN = [1, 4093, 198, 1780, 314, 216, 34, 27, 35, 47, 2, 198, 1, 520, 9531, 198]
SMOL = "chatml"  # the renderer SmolLM2's builder declares
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


@pytest.fixture(scope="module")
def smol() -> Any:
    from transformers import AutoTokenizer

    from tempering.plugins.models.smollm2 import RENDERER, smollm2_folder

    assert RENDERER == SMOL  # what the model builder declares (smollm2().renderer)
    return AutoTokenizer.from_pretrained(smollm2_folder())


def build(tokenizer: Any, name: str = "chatml", **keys: Any) -> Any:
    return get_registry().build("renderer", {"name": name, **keys}, "renderer", tokenizer=tokenizer)


@pytest.fixture(scope="module")
def chatml(smol: Any) -> Any:
    return build(smol)


def sampled(tokenizer: Any, text: str) -> list[int]:
    """A turn as the model emits it: the text's own encoding, then <|im_end|>."""
    return [*tokenizer(text, add_special_tokens=False)["input_ids"], IM_END]


def weighted(renderer: Any, row: Any) -> list[str]:
    """The decoded runs of weight-1 tokens of a row."""
    assert set(row.weights) <= {0.0, 1.0} and len(row.weights) == len(row.tokens)
    runs: list[list[int]] = [[]]
    for t, w in zip(row.tokens, row.weights):
        if w:
            runs[-1].append(t)
        elif runs[-1]:
            runs.append([])
    return [renderer.decode(r) for r in runs if r]


# --------------------------------------------------------------------------- the format
def test_auto_picks_chatml_for_smollm2_and_it_stops_at_im_end(smol, chatml):
    assert default_renderer_name(smol, SMOL) == "chatml" and chatml.name == "chatml"
    assert chatml.stop() == [IM_END] == [smol.eos_token_id]
    assert chatml.prefix_preserving and chatml.supports_tools


@pytest.mark.parametrize(
    "conversation",
    [
        USER,
        [{"role": "system", "content": "Be brief."}, *USER],
        [
            *USER,
            {"role": "assistant", "content": "It is 5."},
            {"role": "user", "content": "And 12345 * 6? naïve café, 東京!"},
        ],
        [
            *USER,
            {"role": "assistant", "content": "Let me add."},
            {"role": "tool", "content": "5"},
            {"role": "user", "content": "so?"},
        ],
    ],
)
def test_plain_conversations_are_the_ids_of_the_models_own_template(smol, chatml, conversation):
    template = smol.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert chatml.render_prompt(conversation).tokens == list(template)


def test_the_default_system_prompt_is_the_templates_and_an_option(smol, chatml):
    assert chatml.system_prompt == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert chatml.render_prompt(USER).tokens == SMOL_SYSTEM + USER_TURN
    assert build(smol, system_prompt=None).render_prompt(USER).tokens == USER_TURN
    assert build(smol, system_prompt="").render_prompt(USER).tokens == USER_TURN
    own = build(smol, system_prompt="Be brief.")
    assert own.decode(own.render_prompt(USER).tokens).startswith(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
    )
    # a conversation's own system message replaces the default
    assert (
        chatml.render_prompt([{"role": "system", "content": "Be brief."}, *USER]).tokens
        == own.render_prompt(USER).tokens
    )


def test_tools_are_declared_in_the_system_turn(smol, chatml):
    spec = json.dumps(ADD)
    instruction = (
        "# Tools\n\nYou can call the tools whose JSON schemas are listed inside <tools></tools>:\n<tools>\n"
        f"{spec}\n</tools>\n\nTo call a tool, write a JSON object with its name and arguments inside "
        '<tool_call></tool_call> tags, one block per call:\n<tool_call>\n{"name": "<tool name>", "arguments": '
        '{"<argument>": <value>}}\n</tool_call>'
    )
    assert chatml.decode(chatml.render_prompt(USER, [ADD]).tokens) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face\n\n"
        f"{instruction}<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    )
    bare = build(smol, system_prompt=None)
    assert bare.decode(bare.render_prompt(USER, [ADD]).tokens).startswith(
        f"<|im_start|>system\n{instruction}<|im_end|>\n"
    )


def test_markers_typed_in_text_stay_text(chatml):
    tokens = chatml.render_prompt([{"role": "user", "content": "a <|im_end|> b"}]).tokens
    assert tokens.count(IM_END) == 2  # the system turn's and the user turn's ends, not the one in the text
    assert chatml.decode(tokens).endswith("<|im_start|>user\na <|im_end|> b<|im_end|>\n<|im_start|>assistant\n")


# --------------------------------------------------------------------------- parsing
def test_sampled_turns_parse_into_text_and_calls(smol, chatml):
    prompt = chatml.render_prompt(USER, [ADD])
    call = prompt.parse(sampled(smol, CALL))
    assert (call.text, call.tool_calls, call.parse_error) == ("", [ToolCall("add", {"a": 2, "b": 3})], None)
    assert call.raw == CALL + "<|im_end|>"
    two = prompt.parse(sampled(smol, f"Let me add.\n{CALL}\n" + CALL.replace("3", "4")))
    assert two.text == "Let me add." and [c.arguments for c in two.tool_calls] == [{"a": 2, "b": 3}, {"a": 2, "b": 4}]
    answer = prompt.parse(sampled(smol, "It is 5."))
    assert (answer.text, answer.tool_calls, answer.reasoning, answer.parse_error) == ("It is 5.", [], None, None)
    # no reasoning block in this format: </think> is text, so the turn renders back as sampled
    assert prompt.parse(sampled(smol, "<think>hm</think>5")).text == "<think>hm</think>5"


@pytest.mark.parametrize(
    "text, error",
    [
        (
            '<tool_call>\n{"name": "add", "arguments": {"a": 2,}}\n</tool_call>',
            "tool call 0: not JSON (Expecting property name",
        ),
        (
            '<tool_call>\n{"arguments": {"a": 2}}\n</tool_call>',
            'tool call 0: expected {"name": "...", "arguments": {...}}',
        ),
        (
            '<tool_call>\n{"name": "add", "arguments": [2, 3]}\n</tool_call>',
            "tool call 0: tool call arguments must be a JSON object",
        ),
        ('<tool_call>\n{"name": "add", "arguments": {"a": 2}}', "a <tool_call> without its </tool_call>"),
    ],
)
def test_malformed_calls_are_parse_errors_not_exceptions(smol, chatml, text, error):
    parsed = chatml.render_prompt(USER, [ADD]).parse(sampled(smol, text))
    assert parsed.parse_error.startswith(error) and "\n" not in parsed.parse_error and parsed.tool_calls == []
    assert parsed.raw == text + "<|im_end|>"


# --------------------------------------------------------------------------- token-exact episodes
def test_an_episode_with_tool_calls_is_one_row_extended_by_every_prompt(smol, chatml):
    """Render, sample, parse, add the tool's result, render again: each new prompt starts with
    the previous prompt plus the sampled ids, <|im_end|> included, so the episode is one row."""
    messages: list[dict[str, Any]] = list(USER)
    builder = TrajectoryBuilder()
    turns = [CALL, f"Now double it.\n{CALL.replace('2', '5').replace('3', '5')}", "It is 10."]
    for i, text in enumerate(turns):
        prompt = chatml.render_prompt(messages, [ADD])
        builder.observe(prompt.tokens)
        turn = sampled(smol, text)
        builder.act(turn)
        parsed = prompt.parse(turn)
        assert parsed.parse_error is None
        assign_call_ids(parsed.tool_calls, i)
        messages += [parsed.to_message(), *[tool_message(c, str(sum(c.arguments.values()))) for c in parsed.tool_calls]]
        after = chatml.render_prompt(
            messages if parsed.tool_calls else [*messages, {"role": "user", "content": "thanks"}], [ADD]
        )
        assert after.tokens[: len(prompt.tokens) + len(turn)] == [*prompt.tokens, *turn]
    assert builder.splits == 0 and len(builder.segments) == 1
    [row] = builder.segments
    assert [r for r in weighted(chatml, row)] == [t + "<|im_end|>" for t in turns]
    # the row is exactly what render_training makes of the transcript
    [trained] = chatml.render_training(messages, [ADD])
    assert trained.tokens == row.tokens and trained.weights == row.weights
    assert chatml.decode(row.tokens).endswith(
        "<|im_start|>tool\n10<|im_end|>\n<|im_start|>assistant\nIt is 10.<|im_end|>"
    )


def test_the_probe_every_renderer_is_measured_with_finds_chatml_prefix_preserving(chatml):
    from test_renderers import prefix_probe

    assert prefix_probe(chatml) == {"call": True, "text+call": True, "answer": True}  # no reasoning shapes: refused


def test_a_turn_sampled_off_the_canonical_form_starts_a_new_row(smol, chatml):
    prompt = chatml.render_prompt(USER, [ADD])
    turn = sampled(smol, '<tool_call>{"name":"add","arguments":{"a":2,"b":3}}</tool_call>')  # no spaces or newlines
    parsed = prompt.parse(turn)
    assert parsed.tool_calls == [ToolCall("add", {"a": 2, "b": 3})]
    assign_call_ids(parsed.tool_calls, 0)
    builder = TrajectoryBuilder()
    builder.observe(prompt.tokens)
    builder.act(turn)
    builder.observe(
        chatml.render_prompt([*USER, parsed.to_message(), tool_message(parsed.tool_calls[0], "5")], [ADD]).tokens
    )
    assert builder.splits == 1  # history writes the call canonically: never a row with ids the model did not see


def test_render_training_weighs_assistant_tokens_and_honours_weight_zero(chatml):
    conversation = [
        *USER,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}],
        },
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "It is 5."},
    ]
    [row] = chatml.render_training(conversation, [ADD])
    assert weighted(chatml, row) == [CALL + "<|im_end|>", "It is 5.<|im_end|>"]
    prompt = chatml.render_prompt(USER, [ADD]).tokens
    assert row.tokens[: len(prompt)] == prompt and set(row.weights[: len(prompt)]) == {0.0}
    context_first = [*conversation[:1], {**conversation[1], "weight": 0}, *conversation[2:]]
    [only_last] = chatml.render_training(context_first, [ADD])
    assert only_last.tokens == row.tokens and weighted(chatml, only_last) == ["It is 5.<|im_end|>"]
    with pytest.raises(ValueError, match="renderer 'chatml' has no reasoning block"):
        chatml.render_training([*USER, {"role": "assistant", "content": "5", "reasoning_content": "add"}])


# --------------------------------------------------------------------------- the tokenizer check
def test_a_tokenizer_without_the_chatml_tokens_is_refused_in_one_line():
    from tempering.plugins.models.tiny import tiny_llama

    _, chars = tiny_llama(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
    with pytest.raises(ConfigError) as err:
        build(chars)
    assert str(err.value) == (
        "renderer: renderer 'chatml' needs <|im_start|> and <|im_end|> as single special tokens, but the model's "
        "tokenizer (TokenizersBackend) has no <|im_start|> or <|im_end|> token; use the renderer of the model's chat "
        "format (renderer: auto picks it), or renderer: raw for plain text prompts"
    )


def test_chatml_tokens_that_are_not_special_are_refused():
    from tempering.plugins.models.tiny import CHAT_CHARS, build_char_tokenizer

    tokenizer = build_char_tokenizer(CHAT_CHARS, extra_special=("<|im_start|>",))
    tokenizer.add_tokens(["<|im_end|>"])  # in the vocabulary, but an ordinary token
    with pytest.raises(ConfigError, match=r"has <\|im_end\|> as an ordinary token; use the renderer"):
        build(tokenizer)


def test_qwen3_on_smollm2_and_chatml_on_qwen3(smol):
    from tempering.plugins.models.qwen3 import qwen3_tokenizer

    with pytest.raises(ConfigError) as err:
        build(smol, "qwen3")
    assert "\n" not in str(
        err.value
    ) and "renderer 'qwen3' needs the token ids of tml-renderers' Qwen3Tokenizer" in str(err.value)
    # Qwen's vocabulary is ChatML too: chatml renders it (no template, so no default system prompt)
    qwen = build(qwen3_tokenizer())
    assert qwen.stop() == [151645] and qwen.system_prompt is None
    assert qwen.render_prompt(USER).tokens == [
        151644,
        872,
        198,
        3838,
        374,
        220,
        17,
        10,
        18,
        30,
        151645,
        198,
        151644,
        77091,
        198,
    ]


# ------------------------------------------------------------------------- text prompts in a stage with a chat renderer
class Recorder:
    """A sampling client that records the prompts and stops it gets and answers ``reply``."""

    def __init__(self, tokenizer: Any, reply: list[int]) -> None:
        self.tokenizer, self.reply, self.calls = tokenizer, reply, []

    def sample(self, prompts: list[list[int]], n: int, params: SamplingParams) -> Any:
        from concurrent.futures import Future

        from tempering.types import Completion

        self.calls.append(([list(p) for p in prompts], list(params.stop)))
        done: Future[Any] = Future()
        done.set_result(
            [
                [Completion(list(p), list(self.reply), [0.0] * len(self.reply), "stop") for _ in range(n)]
                for p in prompts
            ]
        )
        return done


def test_a_text_prompt_is_a_user_turn_with_a_chat_renderer_and_raw_text_with_renderer_raw(smol):
    example = {"prompt": "What is 2+3?", "answer": "5"}
    for renderer in ("chatml", "auto"):
        client = Recorder(smol, sampled(smol, "5"))
        [group] = collect(
            completion_sampler(smol, SMOL, None, renderer), client, [example], 1, SamplingParams(max_tokens=4)
        ).groups
        assert client.calls == [([SMOL_SYSTEM + USER_TURN], [IM_END])]
        assert group.samples[0].completion.text == "5"  # parsed back through the renderer
    client = Recorder(smol, [37, IM_END])
    [group] = collect(
        completion_sampler(smol, SMOL, None, "raw"), client, [example], 1, SamplingParams(max_tokens=4)
    ).groups
    assert client.calls == [([[1780, 314, 216, 34, 27, 35, 47]], [IM_END])]  # the text's ids, EOS the stop
    assert chat_text_prompts("raw", smol, SMOL) is False and chat_text_prompts({"name": "chatml"}, smol, SMOL) is True


def test_a_model_without_a_chat_format_keeps_raw_text_prompts():
    """The arithmetic recipe's tiny_llama: renderer auto, no chat format -- prompts as before."""
    from tempering.plugins.models.tiny import tiny_llama
    from tempering.rollouts.data import encode_prompt

    plain = tiny_llama(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
    tokenizer = plain.tokenizer
    assert plain.renderer is None and chat_text_prompts("auto", tokenizer, plain.renderer) is False
    client = Recorder(tokenizer, [tokenizer.eos_token_id])
    collect(
        completion_sampler(tokenizer, plain.renderer, None),
        client,
        [{"prompt": "12+34="}],
        1,
        SamplingParams(max_tokens=4),
    )
    assert client.calls == [([encode_prompt(tokenizer, {"prompt": "12+34="})], [tokenizer.eos_token_id])]
    assert client.calls[0][0][0][0] == tokenizer.bos_token_id
    chat = tiny_llama(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, chat=True)
    assert chat.renderer == "tiny_chat"  # a tiny chat model declares tiny_chat
    assert chat_text_prompts("auto", chat.tokenizer, chat.renderer) is True


def test_stages_render_text_prompts_and_answers_as_turns(smol, tmp_path):
    """SFT rows, DPO pairs and an RL stage on a text-prompt dataset: one user turn and the
    assistant's answer, as RL samples them; ``renderer: raw`` keeps the raw text."""
    from tempering.testing import FakeBackend
    from tempering.training.recipe import Recipe

    backend = FakeBackend(complete=lambda prompt, i: "5<|im_end|>")
    backend.tokenizer = smol
    seen: list[list[int]] = []
    inner = backend.sample
    backend.sample = lambda prompts, n, params: seen.extend(prompts) or inner(prompts, n, params)
    data = [{"prompt": "What is 2+3?", "answer": "5", "chosen": "5", "rejected": "6"}]
    stages = [
        {"id": "sft", "name": "sft", "steps": 1, "batch_size": 1, "dataset": data},
        {
            "id": "dpo",
            "name": "dpo",
            "steps": 1,
            "batch_size": 1,
            "dataset": data,
            "reference": "precomputed",
            "reference_model": "base",
        },
        {
            "id": "rl",
            "name": "grpo",
            "steps": 1,
            "prompts_per_step": 1,
            "group_size": 2,
            "max_tokens": 16,
            "dataset": data,
        },
        {
            "id": "raw",
            "name": "grpo",
            "steps": 1,
            "prompts_per_step": 1,
            "group_size": 2,
            "max_tokens": 16,
            "dataset": data,
            "renderer": "raw",
        },
    ]
    result = Recipe(name="t", output_dir=str(tmp_path), loggers=[], stages=stages).run(backend=backend)
    sft, dpo, rl, raw = backend.batches
    chatml = build(smol)
    [row] = chatml.render_training([*USER, {"role": "assistant", "content": "5"}])
    assert [[*d.input_tokens, d.target_tokens[-1]] for d in sft.data] == [row.tokens]
    assert [[*d.input_tokens, d.target_tokens[-1]] for d in dpo.data] == [
        row.tokens,
        [*row.tokens[:-2], 38, IM_END],
    ]  # "6"
    assert seen == [SMOL_SYSTEM + USER_TURN, [1780, 314, 216, 34, 27, 35, 47]]
    assert [[*d.input_tokens, d.target_tokens[-1]] for d in rl.data] == [[*SMOL_SYSTEM, *USER_TURN, 37, IM_END]] * 2
    assert [[*d.input_tokens, d.target_tokens[-1]] for d in raw.data] == [
        [1780, 314, 216, 34, 27, 35, 47, 37, IM_END]
    ] * 2
    assert [h["reward/mean"] for h in result.history if "reward/mean" in h][0] == 1.0  # "5<|im_end|>" parsed to "5"


def test_sdft_teachers_see_the_demonstration_in_the_same_format_as_the_student(smol):
    from types import SimpleNamespace

    from tempering.algorithms.sdft.algorithm import SDFT
    from tempering.types import Completion, Sample

    sdft = SDFT(teacher_template="{prompt} Hint: {demonstration}")
    row = {"prompt": "What is 2+3?", "demonstration": "5"}
    sample = Sample({"prompt": row["prompt"]}, Completion([], [37, IM_END], [0.0, 0.0], "stop"))
    sdft.student_sampler = completion_sampler(smol, SMOL, None, "auto")
    assert sdft.teacher_prefix(None, row, sample) == [
        *SMOL_SYSTEM,
        1,
        4093,
        198,
        1780,
        314,
        216,
        34,
        27,
        35,
        47,
        407,
        591,
        42,
        216,
        37,
        2,
        198,
        1,
        520,
        9531,
        198,
    ]  # "...2+3? Hint: 5" as the user turn
    sdft.student_sampler = completion_sampler(smol, SMOL, None, "raw")
    assert (
        sdft.teacher_prefix(SimpleNamespace(tokenizer=smol), row, sample) == smol("What is 2+3? Hint: 5")["input_ids"]
    )


def test_sdft_earlier_turn_shows_the_demonstration_as_the_models_own_answer(smol):
    """``demonstration_placement: earlier_turn``: the teacher's context is the request, the
    demonstration as the assistant's answer to it, then the request again (``teacher_template``
    around it), in the model's own chat format -- the tokens apply_chat_template gives."""
    from types import SimpleNamespace

    from tempering.algorithms.sdft.algorithm import SDFT
    from tempering.types import Completion, Sample

    sdft = SDFT(teacher_template="{prompt}", demonstration_placement="earlier_turn")
    row = {"prompt": "What is 2+3?", "demonstration": "5"}
    sample = Sample({"prompt": row["prompt"]}, Completion([], [37, IM_END], [0.0, 0.0], "stop"))
    sdft.student_sampler = completion_sampler(smol, SMOL, None, "auto")
    messages = [
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "What is 2+3?"},
    ]
    want = smol.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    got = sdft.teacher_prefix(None, row, sample)
    assert got == want and got[: len(SMOL_SYSTEM)] == SMOL_SYSTEM
    assert got.count(1) == 5  # <|im_start|>: system, user, assistant (the demonstration), user, assistant
    assert "<|im_start|>assistant\n5<|im_end|>\n<|im_start|>user\nWhat is 2+3?" in smol.decode(got)
    # a raw-text student has no turns to put the demonstration in
    sdft.student_sampler = completion_sampler(smol, SMOL, None, "raw")
    with pytest.raises(ValueError, match="earlier turns need a chat prompt"):
        sdft.teacher_prefix(SimpleNamespace(tokenizer=smol), row, sample)


def test_renderer_raw_in_a_stage_with_chat_messages_is_a_config_error(smol, tmp_path):
    from tempering.testing import FakeBackend
    from tempering.training.recipe import Recipe

    backend = FakeBackend()
    backend.tokenizer = smol
    stage = {
        "name": "grpo",
        "steps": 1,
        "prompts_per_step": 1,
        "group_size": 2,
        "renderer": "raw",
        "dataset": [{"messages": USER, "answer": "5"}],
    }
    with pytest.raises(ConfigError) as err:
        Recipe(name="t", output_dir=str(tmp_path), loggers=[], stages=[stage]).run(backend=backend)
    assert str(err.value) == (
        "stages[0].renderer: raw sends text prompts as they are, but this stage has chat messages to "
        "render (a 'messages' dataset or an environment); name the model's chat renderer, or auto"
    )
    assert backend.batches == []  # nothing trained
