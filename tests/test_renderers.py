"""Renderers on real tokenizers: the ``tml-renderers`` families, ``hf_chat`` and ``tiny_qwen3``.

Sampled turns are written as token ids the way a model emits them (markup as the format's
special tokens), then parsed; training rows are decoded back to the exact text that carries
weight. No downloads: tml-renderers bundles its tokenizers, and the ``hf_chat`` tokenizer is
the character tokenizer of the tiny models with a chat template written here.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tempering.errors import ConfigError
from tempering.plugins.renderers.plugin import TML_FAMILIES
from tempering.registry import get_registry
from tempering.rollouts.chat import ToolCall, assign_call_ids, tool_message
from tempering.rollouts.renderer import Renderer, default_renderer_name

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
USER = [{"role": "user", "content": "what is 2+3?"}]


def build(name: str, tokenizer: Any = None, **keys: Any) -> Any:
    return get_registry().build("renderer", {"name": name, **keys}, "renderer", tokenizer=tokenizer)


def add_call(
    a: int, b: int, call_id: str | None = None, text: str = "", reasoning: str | None = None
) -> dict[str, Any]:
    call = {"type": "function", "function": {"name": "add", "arguments": json.dumps({"a": a, "b": b})}}
    msg = {"role": "assistant", "content": text, "tool_calls": [{**call, **({"id": call_id} if call_id else {})}]}
    return {**msg, "reasoning_content": reasoning} if reasoning else msg


def weighted(renderer: Any, row: Any) -> list[str]:
    """The decoded runs of weight-1 tokens of a row (and a check that weights are 0 or 1)."""
    assert set(row.weights) <= {0.0, 1.0} and len(row.weights) == len(row.tokens)
    runs, current = [], []
    for t, w in zip(row.tokens, row.weights):
        if w:
            current.append(t)
        elif current:
            runs, current = [*runs, current], []
    return [renderer.decode(r) for r in [*runs, *([current] if current else [])]]


# --------------------------------------------------------------------------- tml-renderers: Qwen3
@pytest.fixture(scope="module")
def qwen() -> Any:
    return build("qwen3_instruct")


def emitted(renderer: Any, *parts: str) -> list[int]:
    """Token ids of a sampled turn: special tokens (``<tool_call>``) as their ids, the rest as text."""
    lib = renderer.lib_tokenizer
    specials = set(lib.all_special_tokens)
    return [t for p in parts for t in ([lib.encode_special(p)] if p in specials else lib.encode_ordinary(p))]


CALL_23 = ["<tool_call>", '\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n', "</tool_call>"]


def test_qwen3_parses_text_tool_calls_and_reasoning(qwen):
    prompt = qwen.render_prompt(USER, [ADD])
    assert qwen.decode(prompt.tokens).endswith("<|im_start|>user\nwhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")
    assert '"name": "add"' in qwen.decode(prompt.tokens)  # the tool is declared in the system block
    text = prompt.parse(emitted(qwen, "It is 5.", "<|im_end|>"))
    assert (text.text, text.tool_calls, text.reasoning, text.parse_error) == ("It is 5.", [], None, None)
    assert text.raw == "It is 5.<|im_end|>"
    calls = prompt.parse(
        emitted(
            qwen,
            "Let me add.\n",
            *CALL_23,
            "\n",
            "<tool_call>",
            '\n{"name": "add", "arguments": {"a": "x", "b": [1]}}\n',
            "</tool_call>",
            "<|im_end|>",
        )
    )
    assert calls.text == "Let me add." and calls.parse_error is None
    assert [(c.name, c.arguments) for c in calls.tool_calls] == [
        ("add", {"a": 2, "b": 3}),
        ("add", {"a": "x", "b": [1]}),
    ]
    assert all(c.id for c in calls.tool_calls)  # the format's own ids, kept for the tool messages
    thinking = (
        build("qwen3")
        .render_prompt(USER)
        .parse(emitted(qwen, "<think>", "\nFirst add.\n", "</think>", "\n\nIt is 5.", "<|im_end|>"))
    )
    assert (thinking.reasoning, thinking.text) == ("First add.", "It is 5.")
    # markup typed as ordinary text is text: only a model emitting the special tokens calls a tool
    literal = prompt.parse(
        qwen.lib_tokenizer.encode_ordinary('<tool_call>{"name": "add"}</tool_call>') + emitted(qwen, "<|im_end|>")
    )
    assert literal.tool_calls == [] and literal.text == '<tool_call>{"name": "add"}</tool_call>'


@pytest.mark.parametrize(
    "parts, error",
    [
        (
            ["<tool_call>", '\n{"name": "add", "arguments": {"a": 2,}}\n', "</tool_call>", "<|im_end|>"],
            "trailing comma",
        ),
        (["<tool_call>", '\n{"arguments": {"a": 2}}\n', "</tool_call>", "<|im_end|>"], "Expected string 'name'"),
        (["<tool_call>", '\n{"name": "add", "arguments": {"a": 2}}\n', "<|im_end|>"], "unterminated_content"),
        (["It is"], "unterminated_content (Detail: stream ended"),
        (["hi", "<|im_end|>", "more"], "tokens after im_end"),
    ],
)
def test_qwen3_malformed_turns_are_parse_errors_not_exceptions(qwen, parts, error):
    tokens = emitted(qwen, *parts)
    parsed = qwen.render_prompt(USER, [ADD]).parse(tokens)
    assert error in parsed.parse_error and "\n" not in parsed.parse_error
    assert parsed.tool_calls == [] and parsed.raw == qwen.decode(tokens)


def test_tml_parse_survives_ids_outside_the_vocabulary(qwen):
    parsed = qwen.render_prompt(USER).parse([9707, 10**6])
    assert parsed.parse_error and parsed.raw == "Hello<|1000000|>"


def test_a_declared_string_argument_stays_a_string():
    # Nemotron 3 writes string arguments bare; "123" must not come back as the number 123
    schema = {
        "type": "function",
        "function": {
            "name": "f",
            "description": "d",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}, "n": {"type": "integer"}}},
        },
    }
    turn = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c0", "type": "function", "function": {"name": "f", "arguments": {"code": "123", "n": 4}}}
        ],
    }
    r = build("nemotron3")
    prompt = r.render_prompt(USER, [schema])
    sampled = r.render_training([*USER, turn], [schema])[-1].tokens[len(prompt.tokens) :]
    assert "<parameter=code>\n123\n</parameter>" in r.decode(sampled)
    assert prompt.parse(sampled).tool_calls[0].arguments == {"code": "123", "n": 4}


@pytest.mark.parametrize(
    "name, stop",
    [
        ("qwen3", ["<|im_end|>"]),
        ("qwen3_instruct", ["<|im_end|>"]),
        ("deepseek_v3", ["<｜end▁of▁sentence｜>"]),
        ("kimi_k2", ["<|im_end|>"]),
        ("glm_5", ["<|endoftext|>", "<|user|>", "<|observation|>"]),
        ("gpt_oss", ["<|return|>", "<|call|>", "<|endoftext|>"]),
        ("nemotron3", ["<|im_end|>"]),
    ],
)
def test_stop_ids_are_explicit_and_the_formats_turn_end_tokens(name, stop):
    r = build(name)
    assert isinstance(r, Renderer) and r.name == name
    assert [r.decode([i]) for i in r.stop()] == stop and all(isinstance(i, int) for i in r.stop())


def test_qwen3_stop_id_is_the_real_im_end(qwen):
    assert qwen.stop() == [151645]


def test_render_training_weighs_exactly_the_assistant_tokens(qwen):
    conversation = [
        *USER,
        add_call(2, 3, "functions.add:0"),
        {"role": "tool", "tool_call_id": "functions.add:0", "content": "5"},
        {"role": "assistant", "content": "It is 5."},
    ]
    [row] = qwen.render_training(conversation, [ADD])
    assert weighted(qwen, row) == [
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>',
        "It is 5.<|im_end|>",
    ]
    prompt = qwen.render_prompt(conversation[:1], [ADD]).tokens
    assert row.tokens[: len(prompt)] == prompt and set(row.weights[: len(prompt)]) == {0.0}
    # Qwen3 with thinking rewrites history (drops reasoning): one row per turn, each turn trained once
    thinking = build("qwen3")
    rows = thinking.render_training(
        [*conversation[:3], {"role": "assistant", "content": "It is 5.", "reasoning_content": "Done."}], [ADD]
    )
    assert [weighted(thinking, r) for r in rows] == [
        ['<think>\n\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'],
        ["<think>\nDone.\n</think>\n\nIt is 5.<|im_end|>"],
    ]


def test_tool_call_arguments_may_be_json_text_or_a_dict(qwen):
    as_dict = add_call(2, 3)
    as_dict["tool_calls"][0]["function"]["arguments"] = {"a": 2, "b": 3}
    assert (
        qwen.render_training([*USER, as_dict], [ADD])[0].tokens
        == qwen.render_training([*USER, add_call(2, 3)], [ADD])[0].tokens
    )


def test_an_option_the_family_refuses_is_a_config_error():
    with pytest.raises(
        ConfigError, match=r"renderer: tml-renderers' GptOss refuses .*reasoning effort must be low, medium, or high"
    ):
        build("gpt_oss", reasoning_effort="extreme")


def test_formats_without_tools_refuse_them_by_name():
    r = build("deepseek_v3")
    assert r.render_prompt(USER).tokens  # plain chat renders
    with pytest.raises(ValueError, match="renderer 'deepseek_v3' has no tool format"):
        r.render_prompt(USER, [ADD])


# --------------------------------------------------------------------------- prefix preservation, measured
SYSTEM = [{"role": "system", "content": "Be brief."}, *USER]
PROBE_TURNS = {
    "call": add_call(2, 3, "functions.add:0"),
    "text+call": add_call(2, 3, "functions.add:0", text="Let me add."),
    "call+reasoning": add_call(2, 3, "functions.add:0", reasoning="Use add."),
    "answer": {"role": "assistant", "content": "It is 5."},
    "answer+reasoning": {"role": "assistant", "content": "It is 5.", "reasoning_content": "Easy."},
}


def prefix_probe(r: Any) -> dict[str, bool]:
    """For each turn shape the format can express: is the prompt after the parsed turn and an
    observation (tool result or user message) the old prompt plus the turn's tokens? The
    "sampled" tokens are the format's own rendering of the turn (its SFT rows); a shape the
    format cannot write or read back unchanged is skipped."""
    tools = [ADD] if r.supports_tools else None
    out = {}
    for shape, turn in PROBE_TURNS.items():
        if "call" in shape and tools is None:
            continue
        prompt = r.render_prompt(SYSTEM, tools)
        try:
            sampled = r.render_training([*SYSTEM, turn], tools)[-1].tokens[len(prompt.tokens) :]
        except ValueError:  # e.g. reasoning in a format with thinking off
            continue
        parsed = prompt.parse(sampled)
        same = (parsed.text, parsed.reasoning, [(c.name, c.arguments) for c in parsed.tool_calls]) == (
            turn["content"],
            turn.get("reasoning_content"),
            [("add", {"a": 2, "b": 3})] * len(turn.get("tool_calls", [])),
        )
        if parsed.parse_error or not same:
            continue
        assign_call_ids(parsed.tool_calls, 0)
        observation = [tool_message(c, "5") for c in parsed.tool_calls] or [{"role": "user", "content": "thanks"}]
        after = r.render_prompt([*SYSTEM, parsed.to_message(), *observation], tools).tokens
        out[shape] = after[: len(prompt.tokens) + len(sampled)] == [*prompt.tokens, *sampled]
    return out


#: Formats on the Qwen3.5 vocabulary (248k tokens), whose tokenizer takes ~15 s to load.
QWEN3_5 = {"qwen3_5", "qwen3_8"}
VARIANTS = [(name, {}) for name in TML_FAMILIES if name not in QWEN3_5] + [
    ("kimi_k2", {"strip_thinking_from_history": False}),
    ("kimi_k2_5", {"strip_thinking_from_history": False}),
    ("qwen3", {"strip_thinking_from_history": False}),
    ("deepseek_v3_1", {"thinking": True}),
    ("deepseek_v4", {"thinking_mode": "chat"}),
    ("nemotron3", {"strip_thinking_from_history": False}),
    ("gpt_oss", {"reasoning_effort": "low", "current_date": "2025-01-01"}),
]


def check_prefix_flag(name: str, keys: dict[str, Any]) -> None:
    r = build(name, **keys)
    measured = prefix_probe(r)
    assert "answer" in measured  # every format can answer
    assert r.supports_tools == ("call" in measured)
    assert r.prefix_preserving == all(measured.values()), measured


@pytest.mark.parametrize("name, keys", VARIANTS, ids=[f"{n}-{k}" if k else n for n, k in VARIANTS])
def test_prefix_preserving_is_what_the_probe_measures(name, keys):
    check_prefix_flag(name, keys)


@pytest.mark.slow
def test_prefix_preserving_of_the_qwen3_5_formats():
    for name, keys in [
        ("qwen3_5", {}),
        ("qwen3_5", {"enable_thinking": False}),
        ("qwen3_8", {}),
        ("qwen3_8", {"reasoning_effort": "low"}),
    ]:
        check_prefix_flag(name, keys)
    assert build("qwen3_5").stop() == [248046]  # its own vocabulary: <|im_end|> is another id


def test_the_probe_finds_the_breaks_the_docstrings_name():
    assert prefix_probe(build("qwen3_instruct")) == {"call": True, "text+call": False, "answer": True}
    assert prefix_probe(build("gpt_oss"))["answer"] is False  # <|return|> sampled, <|end|> in history
    assert prefix_probe(build("kimi_k2"))["answer+reasoning"] is False  # reasoning dropped before a user turn


# --------------------------------------------------------------------------- the tokenizer check
@pytest.fixture(scope="module")
def qwen_tokenizer() -> Any:
    from tempering.plugins.models.qwen3 import qwen3_tokenizer

    return qwen3_tokenizer()


def test_a_renderer_accepts_its_own_tokenizer(qwen_tokenizer):
    assert build("qwen3_instruct", qwen_tokenizer).tokenizer is qwen_tokenizer
    assert build("qwen3", qwen_tokenizer).stop() == [qwen_tokenizer.eos_token_id]


def test_a_renderer_on_another_models_tokenizer_is_a_config_error_naming_both(qwen_tokenizer):
    from tempering.plugins.models.tiny import tiny_llama

    _, llama = tiny_llama(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, chat=True)
    with pytest.raises(ConfigError) as err:
        build("qwen3_instruct", llama)
    msg = str(err.value)
    assert msg.startswith("renderer: renderer 'qwen3_instruct' needs the token ids of tml-renderers' Qwen3Tokenizer")
    assert (
        "TokenizersBackend" in msg
        and "cannot encode ordinary text" in msg
        and "\n" not in msg
        and err.value.path == "renderer"
    )
    # a real vocabulary of another family encodes text, differently
    with pytest.raises(
        ConfigError,
        match=r"KimiK2ThinkingTokenizer, but the model's tokenizer \(TmlTokenizer 'Qwen3Tokenizer'\) "
        r"differs: it encodes text differently \(token 0: ",
    ):
        build("kimi_k2", qwen_tokenizer)
    with pytest.raises(ConfigError, match="HarmonyTokenizer"):
        build("gpt_oss", qwen_tokenizer)


def test_a_tokenizer_with_the_same_text_ids_but_another_turn_end_is_refused(qwen_tokenizer):
    from tempering.plugins.models.qwen3 import TmlTokenizer

    class Shifted(TmlTokenizer):
        def convert_tokens_to_ids(self, tokens: Any) -> Any:
            return 7 if tokens == "<|im_end|>" else super().convert_tokens_to_ids(tokens)

    odd = Shifted(qwen_tokenizer.lib, "<|im_end|>", "<|endoftext|>")
    with pytest.raises(ConfigError, match=r"its id of the turn-end token '<\|im_end\|>' is 7, not 151645"):
        build("qwen3_instruct", odd)


# --------------------------------------------------------------------------- hf_chat
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t.function.name }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' %}{{ m.content or '' }}{% for c in m.tool_calls or [] %}"
    '<tool_call>{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}</tool_call>'
    "{% endfor %}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)  # ChatML with Hermes-style tool calls, in the characters the tiny tokenizer has

RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open_pattern": r"\s*<tool_call>",
            "close": "</tool_call>",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"\s*<\|im_end\|>", "content": "text"},
    },
}


def templated_tokenizer(template: str = TEMPLATE) -> Any:
    from tempering.plugins.models.tiny import CHAT_CHARS, build_char_tokenizer

    tokenizer = build_char_tokenizer(CHAT_CHARS, extra_special=("<|im_start|>", "<|im_end|>"))
    tokenizer.chat_template = template
    return tokenizer


@pytest.fixture
def hf() -> Any:
    tokenizer = templated_tokenizer()
    assert default_renderer_name(tokenizer, None) == "hf_chat"  # what renderer: auto picks
    return build("hf_chat", tokenizer)


def test_hf_chat_renders_the_template_and_stops_at_eos_and_its_end_of_turn(hf):
    im_end, eos = hf.tokenizer.convert_tokens_to_ids("<|im_end|>"), hf.tokenizer.eos_token_id
    assert hf.stop() == [eos, im_end]
    assert hf.decode(hf.render_prompt(USER, [ADD]).tokens) == (
        "<|im_start|>system\ntools: add<|im_end|>\n<|im_start|>user\nwhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert hf.prefix_preserving


def test_hf_chat_training_rows_weigh_the_template_difference_up_to_the_stop(hf):
    conversation = [*USER, add_call(2, 3), {"role": "tool", "content": "5"}, {"role": "assistant", "content": "five"}]
    [row] = hf.render_training(conversation, [ADD])
    assert weighted(hf, row) == [
        '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call><|im_end|>',
        "five<|im_end|>",
    ]
    assert hf.decode(row.tokens).endswith(
        "<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\nfive<|im_end|>"
    )  # no "\n" after the stop


def enc(tokenizer: Any, text: str) -> list[int]:
    return [*tokenizer(text, add_special_tokens=False)["input_ids"], tokenizer.convert_tokens_to_ids("<|im_end|>")]


@pytest.mark.parametrize("response_template", [None, RESPONSE_TEMPLATE], ids=["hermes", "parse_response"])
def test_hf_chat_parses_tool_calls_and_text(response_template):
    tokenizer = templated_tokenizer()
    tokenizer.response_template = response_template
    hf = build("hf_chat", tokenizer)
    prompt = hf.render_prompt(USER, [ADD])
    call = prompt.parse(enc(tokenizer, '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'))
    assert (call.tool_calls, call.text, call.parse_error) == ([ToolCall("add", {"a": 2, "b": 3})], "", None)
    assert prompt.parse(enc(tokenizer, "five")).text == "five"
    bad = prompt.parse(enc(tokenizer, '<tool_call>{"name": "add", "arguments": {"a": 2,}}</tool_call>'))
    assert bad.parse_error and "\n" not in bad.parse_error and bad.tool_calls == []
    assert bad.raw == '<tool_call>{"name": "add", "arguments": {"a": 2,}}</tool_call><|im_end|>'


def test_hermes_parse_keeps_good_calls_and_reports_bad_ones(hf):
    prompt = hf.render_prompt(USER, [ADD])
    mixed = prompt.parse(
        enc(hf.tokenizer, 'ok <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call><tool_call>[1]</tool_call>')
    )
    assert mixed.text == "ok" and mixed.tool_calls == [ToolCall("add", {"a": 1})]
    assert mixed.parse_error == 'tool call 1: expected {"name": "...", "arguments": {...}}'
    open_call = prompt.parse(enc(hf.tokenizer, '<tool_call>{"name": "add"'))
    assert open_call.parse_error == "a <tool_call> without its </tool_call>"
    thought = prompt.parse(enc(hf.tokenizer, "<think>add them</think>five"))
    assert (thought.reasoning, thought.text) == ("add them", "five")


def test_hf_chat_explains_a_template_whose_turns_are_not_a_suffix():
    # the generation prompt opens a think block that a stored assistant turn does not have
    template = TEMPLATE.replace("<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n<think>{% endif %}")
    hf = build("hf_chat", templated_tokenizer(template))
    assert not hf.prefix_preserving
    with pytest.raises(
        ValueError,
        match=r"turn differently once the turn is added \(from token 31, the prompt has '<think>', "
        r"the transcript 'five",
    ):
        hf.render_training([*USER, {"role": "assistant", "content": "five"}])


def test_hf_chat_needs_a_chat_template():
    from tempering.plugins.models.tiny import build_char_tokenizer

    with pytest.raises(ConfigError, match=r"renderer: the model's tokenizer .* has no chat template"):
        build("hf_chat", build_char_tokenizer())


# --------------------------------------------------------------------------- tiny_qwen3
def test_tiny_qwen3_is_deterministic_and_picks_the_qwen3_renderer():
    import torch

    from tempering.plugins.models.qwen3 import tiny_qwen3

    loaded = tiny_qwen3()
    model, tokenizer = loaded
    again, _ = tiny_qwen3()
    other, _ = tiny_qwen3(seed=1)
    weights = [p for _, p in sorted(model.state_dict().items())]
    assert all(torch.equal(a, b) for a, b in zip(weights, [p for _, p in sorted(again.state_dict().items())]))
    assert not torch.equal(model.model.embed_tokens.weight, other.model.embed_tokens.weight)
    assert (
        model.config.vocab_size == len(tokenizer) == 151669 and model.lm_head.weight is model.model.embed_tokens.weight
    )
    assert sum(p.numel() for p in model.parameters()) < 10_000_000
    assert loaded.renderer == "qwen3_instruct" and default_renderer_name(tokenizer, loaded.renderer) == "qwen3_instruct"
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id) == (151645, 151643, None)


def test_tiny_qwen3_tokenizer_speaks_the_hugging_face_calls_the_backend_makes(qwen_tokenizer, tmp_path):
    from tempering.plugins.models.qwen3 import TmlTokenizer

    ids = qwen_tokenizer("Hello world<|im_end|>", add_special_tokens=True)["input_ids"]
    assert ids == [9707, 1879, 151645]  # special tokens in text are their ids; no BOS
    assert qwen_tokenizer(["a", "bc"])["input_ids"] == [qwen_tokenizer.encode("a"), qwen_tokenizer.encode("bc")]
    assert (
        qwen_tokenizer.decode(ids) == "Hello world<|im_end|>"
        and qwen_tokenizer.decode(ids, skip_special_tokens=True) == "Hello world"
    )
    assert qwen_tokenizer.batch_decode([ids, ids[:1]], skip_special_tokens=True) == ["Hello world", "Hello"]
    assert qwen_tokenizer.convert_tokens_to_ids(["<tool_call>", "Hello", "Hello world"]) == [151657, 9707, None]
    [file] = qwen_tokenizer.save_pretrained(str(tmp_path))
    back = TmlTokenizer.from_pretrained(str(tmp_path))
    assert back("Hello world<|im_end|>")["input_ids"] == ids and back.renderer == "qwen3_instruct"
    with open(file) as f:
        assert json.load(f)["class"] == "Qwen3Tokenizer"
