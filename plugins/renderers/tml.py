"""The production chat formats of ``tml-renderers``: Qwen3, DeepSeek, Kimi, GLM, GPT-OSS, Nemotron.

``tml-renderers`` renders a conversation to tokens, parses sampled tokens back into messages
and builds supervised examples for each model family, bundling the real tokenizers (no
download). :class:`TmlRenderer` adapts one of its renderers to tempering's
:class:`~tempering.rollouts.renderer.Renderer` protocol: OpenAI-format messages and tool specs in,
tokens out; sampled tokens in, a :class:`~tempering.rollouts.chat.ParsedResponse` out (a malformed turn
is a ``parse_error``, never an exception). Each registered name below is one family/variant;
its keyword arguments (besides the runtime ``tokenizer``) are its config keys.

``prefix_preserving`` was measured per family, with the probe that
``tests/test_renderers.py`` runs for every registered name: render a prompt, take the tokens
the family's own SFT rendering gives an assistant turn (a tool call, an answer, each with and
without reasoning where the family reasons) as the "sampled" tokens, parse them, append the
parsed turn and an observation (a tool result or a user message) and render again. A family is
prefix-preserving when every such re-rendering starts with the prompt plus the sampled tokens.
Where it does not, trajectories split into several rows (never a row with unseen tokens); why
each one breaks is written next to its factory.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from tempering.errors import ConfigError
from tempering.interfaces import Tokenizer
from tempering.plugins.renderers.hf_chat import error_line
from tempering.rollouts.chat import Message, ParsedResponse, ToolCall, text_of
from tempering.rollouts.renderer import RenderedPrompt
from tempering.rollouts.trajectory import TrainingRow, trains

#: Text whose encoding must agree between the model's tokenizer and the renderer's (letters,
#: digits, punctuation, whitespace runs, accents and CJK hit different merges in every vocab).
PROBE = "Tempering probe: 12345 + 678 = 1023; naïve café, 東京!\n    if x == {'a': [1, 2]}:\n\tpass"


class TmlRenderer:
    """One ``tml_renderers.renderers`` renderer behind tempering's ``Renderer`` protocol.

    Built by the factories below (``qwen3``, ``kimi_k2``, ...), each of which states whether
    its format is ``prefix_preserving``. ``tokenizer`` is the backend's tokenizer: one whose
    ids differ from the format's (a Qwen3 renderer on a Llama tokenizer) is refused with a
    :class:`~tempering.errors.ConfigError` before anything trains. ``supports_tools``: False
    for formats without a tool-declaration grammar (DeepSeek V3 / V3.1 / R1); rendering
    tools with them is a ``ValueError`` naming the renderer.
    """

    def __init__(
        self,
        name: str,
        renderer: Any,
        tokenizer: Tokenizer | None = None,
        *,
        prefix_preserving: bool,
        supports_tools: bool = True,
    ) -> None:
        self.name = name
        self.prefix_preserving = prefix_preserving
        self.supports_tools = supports_tools
        self.renderer = renderer
        self.lib_tokenizer = renderer.tokenizer
        self._stop = _stop_ids(renderer.stop(), self.lib_tokenizer)
        if tokenizer is not None:
            check_tokenizer(name, self.lib_tokenizer, self._stop, tokenizer)
        self.tokenizer = tokenizer

    # ------------------------------------------------------------------ rendering
    def _messages(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None) -> list[Any]:
        from tml_renderers import chat

        out = chat.OpenAIMessage.from_oss_messages([_oss_message(m) for m in messages])
        if tools:
            if not self.supports_tools:
                raise ValueError(
                    f"renderer '{self.name}' has no tool format (tml-renderers cannot declare tools for "
                    "it); use a tool-free environment or a renderer whose format has tools"
                )
            # After any leading system messages: a family with one system block merges them.
            at = next((i for i, m in enumerate(messages) if m.get("role") != "system"), len(messages))
            out.insert(at, tool_declaration(tools))
        return out

    def render_prompt(
        self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None = None
    ) -> RenderedPrompt:
        spans, parser = self.renderer.render_for_completion(self._messages(messages, tools))
        strings = string_parameters(tools or ())
        return RenderedPrompt(_tokens(spans), lambda tokens: self.parse(parser, tokens, strings))

    def render_training(
        self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None = None
    ) -> list[TrainingRow]:
        """The family's own supervised rendering (``render_for_sft``), with its examples merged
        where one extends the previous: tml-renderers gives one example per assistant turn, each
        repeating the earlier turns at weight 0; a merged row trains the same tokens in the same
        context once, and is exactly the row a rollout of the conversation builds. Where the
        format rewrites history the examples stay apart. An assistant message with
        ``"weight": 0`` is context only: its example is dropped."""
        examples = self.renderer.render_for_sft(self._messages(messages, tools))
        keep = [trains(m) for m in messages if m.get("role") == "assistant"]
        if not all(keep):
            if len(keep) != len(examples):
                raise ValueError(
                    f"renderer '{self.name}': {len(examples)} supervised examples for {len(keep)} assistant "
                    "messages, so the 'weight': 0 ones cannot be told apart; give them weight 1"
                )
            examples = [e for e, k in zip(examples, keep) if k]
        rows: list[TrainingRow] = []
        for e in examples:
            tokens, weights = _tokens(e.input_token_spans), [float(w) for w in e.per_token_loss_weight_unshifted]
            if rows and tokens[: len(rows[-1].tokens)] == rows[-1].tokens:
                before = rows.pop().weights
                weights = [max(a, b) for a, b in zip(before, weights)] + weights[len(before) :]
            rows.append(TrainingRow(tokens, weights))
        return rows

    def stop(self) -> list[int]:
        return list(self._stop)

    def decode(self, tokens: Sequence[int]) -> str:
        """Text with the format's markup; ids the vocabulary lacks (a model's padded embedding
        rows) show as ``<|id|>`` instead of failing."""
        tokens = [int(t) for t in tokens]
        try:
            return self.lib_tokenizer.decode(tokens)
        except ValueError:
            return "".join(_decode_one(self.lib_tokenizer, t) for t in tokens)

    # ------------------------------------------------------------------ parsing
    def parse(self, parser: Any, tokens: Sequence[int], strings: dict[str, set[str]] | None = None) -> ParsedResponse:
        """Sampled tokens -> text, reasoning and tool calls. Argument values are JSON-decoded,
        except those the tool declares as strings (``strings``: tool -> parameter names): some
        formats write them bare, and ``123`` must stay the string the model wrote."""
        from tml_renderers import chat

        tokens = [int(t) for t in tokens]
        raw = self.decode(tokens)
        try:
            messages = parser.parse_tokens(tokens)
        except Exception as exc:  # noqa: BLE001 - the parser's ValueError, or a bad id: a malformed turn
            return ParsedResponse(parse_error=error_line(exc), raw=raw)
        text, reasoning, calls = [], [], []
        for m in messages:
            content = m.content
            if isinstance(content, chat.Text):
                text.append(content.text)
            elif isinstance(content, chat.Thinking):
                reasoning.append(content.text)
            elif isinstance(content, chat.InvokeTool):
                bare = (strings or {}).get(content.name, set())
                args = {a.name: _argument(a.value, a.name in bare) for a in content.args}
                calls.append(ToolCall(content.name, args, content.tool_call_id))
        # Stripped: the whitespace between text and a tool call or think block is the format's,
        # which rendering the parsed turn writes back (keeping it would write it twice).
        return ParsedResponse("".join(text).strip(), calls, "\n".join(reasoning) or None, raw=raw)


def tool_declaration(tools: Sequence[dict[str, Any]]) -> Any:
    """OpenAI tool specs -> the system message that declares them to a tml-renderers format."""
    from tml_renderers import chat

    specs = []
    for spec in tools:
        fn = spec.get("function", spec)
        specs.append(
            chat.ToolSpecJson(
                type_name=spec.get("type", "function"),
                name=fn["name"],
                description=fn.get("description", ""),
                parameters=fn.get("parameters") or {},
            )
        )
    return chat.OpenAIMessage(author=chat.Author(chat.AuthorKind.System), content=[chat.ToolDeclareJson(specs)])


def _oss_message(m: Message) -> dict[str, Any]:
    """An OpenAI message as ``from_oss_messages`` reads it: reasoning as a ``thinking`` content
    part (tempering keeps it in ``reasoning_content``), tool-call arguments as JSON strings."""
    out = dict(m)
    reasoning = out.pop("reasoning_content", None) or out.pop("reasoning", None)
    if reasoning:
        text = text_of(out)
        out["content"] = [
            {"type": "thinking", "thinking": reasoning},
            *([{"type": "text", "text": text}] if text else []),
        ]
    if out.get("tool_calls"):
        calls = [ToolCall.from_openai(call).to_openai() for call in out["tool_calls"]]
        out["tool_calls"] = [{k: v for k, v in c.items() if v is not None} for c in calls]  # no "id": None
    return out


def _tokens(spans: Sequence[Any]) -> list[int]:
    return [int(t) for s in spans for t in s.span.tokens]


def string_parameters(tools: Sequence[dict[str, Any]]) -> dict[str, set[str]]:
    """Tool name -> its parameters whose JSON-schema type is ``string``."""
    out = {}
    for spec in tools:
        fn = spec.get("function", spec)
        props = (fn.get("parameters") or {}).get("properties") or {}
        out[fn["name"]] = {k for k, v in props.items() if isinstance(v, dict) and v.get("type") == "string"}
    return out


def _argument(value: str, is_string: bool) -> Any:
    """A tool argument's value: JSON where it is JSON, else the raw string (formats that write
    string arguments bare, e.g. XML parameters); a declared string stays a string."""
    try:
        decoded = json.loads(value)
    except (TypeError, ValueError):
        return value
    return value if is_string and not isinstance(decoded, str) else decoded


def _decode_one(lib_tokenizer: Any, token: int) -> str:
    try:
        return lib_tokenizer.decode([token])
    except ValueError:
        return f"<|{token}|>"


def _stop_ids(stop: Any, lib_tokenizer: Any) -> list[int]:
    """``renderer.stop()`` as ids (a family may name its stop tokens as strings)."""
    items = [stop] if isinstance(stop, (str, int)) else list(stop or [])
    ids = [int(s) if isinstance(s, int) else int(lib_tokenizer.encode_special(s)) for s in items]
    if not ids:
        raise ValueError("the tml-renderers renderer names no stop token; a turn could never end")
    return ids


# ---------------------------------------------------------------------- the tokenizer check
def check_tokenizer(name: str, lib_tokenizer: Any, stop: Sequence[int], tokenizer: Tokenizer) -> None:
    """Refuse a model tokenizer whose ids differ from the format's: the encoding of
    :data:`PROBE` and the id of every stop token must agree."""
    theirs = f"{type(tokenizer).__name__}{_name_of(tokenizer)}"
    ours = type(lib_tokenizer).__name__
    problem = None
    try:
        got = [int(i) for i in tokenizer(PROBE, add_special_tokens=False)["input_ids"]]
    except Exception as exc:  # noqa: BLE001 - e.g. a character tokenizer without these characters
        problem = f"it cannot encode ordinary text ({type(exc).__name__}: {error_line(exc)})"
    else:
        want = [int(i) for i in lib_tokenizer.encode_ordinary(PROBE)]
        if got != want:
            at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            problem = f"it encodes text differently (token {at}: {got[at : at + 3]} vs {want[at : at + 3]})"
    for sid in stop:
        if problem is not None:
            break
        text = lib_tokenizer.decode([sid])
        theirs_id = _token_id(tokenizer, text)
        if theirs_id != sid:
            problem = f"its id of the turn-end token {text!r} is {theirs_id}, not {sid}"
    if problem is not None:
        raise ConfigError(
            f"renderer '{name}' needs the token ids of tml-renderers' {ours}, but the model's tokenizer ({theirs}) "
            f"differs: {problem}; use the renderer of the model's chat format (renderer: auto picks it)",
            "renderer",
        )


def _name_of(tokenizer: Tokenizer) -> str:
    path = getattr(tokenizer, "name_or_path", "")
    return f" '{path}'" if isinstance(path, str) and path else ""


def _token_id(tokenizer: Tokenizer, text: str) -> int | None:
    """The id ``tokenizer`` gives the single token ``text`` (None if it is not one token)."""
    convert = getattr(tokenizer, "convert_tokens_to_ids", None)
    if convert is not None:
        try:
            tid = convert(text)
        except Exception:  # noqa: BLE001 - fall through to encoding
            tid = None
        if isinstance(tid, int) and tid != getattr(tokenizer, "unk_token_id", None):
            return tid
    try:
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    except Exception:  # noqa: BLE001
        return None
    return int(ids[0]) if len(ids) == 1 else None


# ---------------------------------------------------------------------- the registered families
def _family(
    name: str,
    cls: str,
    tokenizer: Tokenizer | None,
    *,
    prefix_preserving: bool,
    supports_tools: bool = True,
    variant: str | None = None,
    **options: object,
) -> TmlRenderer:
    """``tml_renderers.renderers.<cls>(**options)`` (or its ``variant`` constructor) as
    ``name``; an option value the family refuses is a ConfigError."""
    from tml_renderers import renderers

    make = getattr(renderers, cls) if variant is None else getattr(getattr(renderers, cls), variant)
    try:
        renderer = make(**options)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"tml-renderers' {cls} refuses {options}: {error_line(exc)}", "renderer") from None
    return TmlRenderer(name, renderer, tokenizer, prefix_preserving=prefix_preserving, supports_tools=supports_tools)


def qwen3(tokenizer: Tokenizer | None = None, strip_thinking_from_history: bool = True) -> TmlRenderer:
    """Qwen3 hybrid checkpoints with thinking on. Not prefix-preserving: history re-renders a
    turn's ``<think>`` block differently from how it was sampled (dropped by default, written
    without its newlines when kept)."""
    return _family(
        "qwen3", "Qwen3", tokenizer, prefix_preserving=False, strip_thinking_from_history=strip_thinking_from_history
    )


def qwen3_instruct(tokenizer: Tokenizer | None = None, strip_thinking_from_history: bool = True) -> TmlRenderer:
    """Qwen3 instruct checkpoints (no thinking block). Turns that are only tool calls or only an
    answer re-render exactly as sampled, but not prefix-preserving in general: text before a
    tool call is sampled (and SFT-rendered) as ``.`` + ``\\n`` + ``<tool_call>`` while history
    merges ``.\\n`` into one token (tml-renderers' own SFT splits such a conversation in two)."""
    return _family(
        "qwen3_instruct",
        "Qwen3",
        tokenizer,
        prefix_preserving=False,
        variant="instruct",
        strip_thinking_from_history=strip_thinking_from_history,
    )


def qwen3_disable_thinking(tokenizer: Tokenizer | None = None, strip_thinking_from_history: bool = True) -> TmlRenderer:
    """Qwen3 hybrid checkpoints with thinking off (the prompt ends in an empty ``<think>``
    block). Not prefix-preserving: history drops that empty block."""
    return _family(
        "qwen3_disable_thinking",
        "Qwen3",
        tokenizer,
        prefix_preserving=False,
        variant="disable_thinking",
        strip_thinking_from_history=strip_thinking_from_history,
    )


def qwen3_5(
    tokenizer: Tokenizer | None = None, strip_thinking_from_history: bool = True, enable_thinking: bool = True
) -> TmlRenderer:
    """Qwen3.5 (XML tool calls, its own 248k vocabulary). Not prefix-preserving: history
    re-tokenizes the whitespace around an empty think block and drops reasoning before a user
    turn."""
    return _family(
        "qwen3_5",
        "Qwen35",
        tokenizer,
        prefix_preserving=False,
        strip_thinking_from_history=strip_thinking_from_history,
        enable_thinking=enable_thinking,
    )


def qwen3_8(
    tokenizer: Tokenizer | None = None, reasoning_effort: str = "xhigh", strip_thinking_from_history: bool = False
) -> TmlRenderer:
    """Qwen3.8 (Qwen3.5 vocabulary; effort ``low``/``medium``/``xhigh``). Not prefix-preserving:
    an answer without reasoning re-renders its empty think block differently."""
    return _family(
        "qwen3_8",
        "Qwen38",
        tokenizer,
        prefix_preserving=False,
        reasoning_effort=reasoning_effort,
        strip_thinking_from_history=strip_thinking_from_history,
    )


def deepseek_v3(tokenizer: Tokenizer | None = None) -> TmlRenderer:
    """DeepSeek V3 chat (no tool format). Not prefix-preserving: answers re-render as sampled,
    but history drops a turn's ``<think>`` block, which the format parses."""
    return _family("deepseek_v3", "DeepSeekV3", tokenizer, prefix_preserving=False, supports_tools=False)


def deepseek_v3_1(tokenizer: Tokenizer | None = None, thinking: bool = False) -> TmlRenderer:
    """DeepSeek V3.1 (no tool format). Prefix-preserving without thinking; with ``thinking``
    history drops the reasoning."""
    return _family(
        "deepseek_v3_1",
        "DeepSeekV31",
        tokenizer,
        prefix_preserving=not thinking,
        supports_tools=False,
        thinking=thinking,
    )


def deepseek_r1(tokenizer: Tokenizer | None = None) -> TmlRenderer:
    """DeepSeek R1 (no tool format). Not prefix-preserving: history drops the reasoning."""
    return _family("deepseek_r1", "DeepSeekR1", tokenizer, prefix_preserving=False, supports_tools=False)


def deepseek_v4(
    tokenizer: Tokenizer | None = None, reasoning_effort: str | None = None, thinking_mode: str = "thinking"
) -> TmlRenderer:
    """DeepSeek V4 (DSML tool calls; ``thinking_mode`` ``thinking`` or ``chat``). Prefix-preserving."""
    return _family(
        "deepseek_v4",
        "DeepSeekV4",
        tokenizer,
        prefix_preserving=True,
        reasoning_effort=reasoning_effort,
        thinking_mode=thinking_mode,
    )


def deepseek_v4_1(
    tokenizer: Tokenizer | None = None, reasoning_effort: str | None = None, thinking_mode: str = "thinking"
) -> TmlRenderer:
    """DeepSeek V4.1 (effort ``low``/``high``/``max``). Prefix-preserving."""
    return _family(
        "deepseek_v4_1",
        "DeepSeekV41",
        tokenizer,
        prefix_preserving=True,
        reasoning_effort=reasoning_effort,
        thinking_mode=thinking_mode,
    )


def kimi_k2(tokenizer: Tokenizer | None = None, strip_thinking_from_history: bool = True) -> TmlRenderer:
    """Kimi K2 (thinking). Prefix-preserving only with ``strip_thinking_from_history: false``:
    by default the reasoning of a turn answered by a user message is dropped from history."""
    return _family(
        "kimi_k2",
        "KimiK2",
        tokenizer,
        prefix_preserving=not strip_thinking_from_history,
        strip_thinking_from_history=strip_thinking_from_history,
    )


def kimi_k2_5(
    tokenizer: Tokenizer | None = None, support_thinking: bool = True, strip_thinking_from_history: bool = True
) -> TmlRenderer:
    """Kimi K2.5. Prefix-preserving only with ``strip_thinking_from_history: false`` (as K2)."""
    return _family(
        "kimi_k2_5",
        "KimiK25",
        tokenizer,
        prefix_preserving=not strip_thinking_from_history,
        support_thinking=support_thinking,
        strip_thinking_from_history=strip_thinking_from_history,
    )


def glm_5(
    tokenizer: Tokenizer | None = None, reasoning_effort: str = "max", clear_thinking: bool = True
) -> TmlRenderer:
    """GLM-5 (tml-renderers' ``Glm52``, GLM-5.2; effort ``high``/``max``). Not prefix-preserving:
    a sampled turn ends in ``<|endoftext|>`` while history follows it with the next role token."""
    return _family(
        "glm_5",
        "Glm52",
        tokenizer,
        prefix_preserving=False,
        reasoning_effort=reasoning_effort,
        clear_thinking=clear_thinking,
    )


def glm_5_3(
    tokenizer: Tokenizer | None = None, reasoning_effort: str = "max", clear_thinking: bool = True
) -> TmlRenderer:
    """GLM-5.3 (effort ``low``/``high``/``max``). Not prefix-preserving (as ``glm_5``)."""
    return _family(
        "glm_5_3",
        "Glm53",
        tokenizer,
        prefix_preserving=False,
        reasoning_effort=reasoning_effort,
        clear_thinking=clear_thinking,
    )


def glm_5_3_flash(
    tokenizer: Tokenizer | None = None, reasoning_effort: str = "max", clear_thinking: bool = True
) -> TmlRenderer:
    """GLM-5.3 Flash. Not prefix-preserving (as ``glm_5``)."""
    return _family(
        "glm_5_3_flash",
        "Glm53Flash",
        tokenizer,
        prefix_preserving=False,
        reasoning_effort=reasoning_effort,
        clear_thinking=clear_thinking,
    )


def gpt_oss(
    tokenizer: Tokenizer | None = None,
    reasoning_effort: str = "medium",
    current_date: str | None = None,
    model_identity: str | None = None,
) -> TmlRenderer:
    """GPT-OSS (harmony; effort ``low``/``medium``/``high``). Not prefix-preserving: a final
    answer is sampled ending in ``<|return|>`` but sits in history ending in ``<|end|>``. Set
    ``current_date`` (``YYYY-MM-DD``) for reproducible prompts; the default is today's date."""
    return _family(
        "gpt_oss",
        "GptOss",
        tokenizer,
        prefix_preserving=False,
        reasoning_effort=reasoning_effort,
        current_date=current_date,
        model_identity=model_identity,
    )


def nemotron3(
    tokenizer: Tokenizer | None = None,
    strip_thinking_from_history: bool = True,
    ultra: bool = False,
    reasoning_effort: str | None = None,
    support_thinking: bool = True,
) -> TmlRenderer:
    """Nemotron 3. Not prefix-preserving: a turn without reasoning re-renders its empty think
    block without the newline it was sampled with."""
    return _family(
        "nemotron3",
        "Nemotron3",
        tokenizer,
        prefix_preserving=False,
        strip_thinking_from_history=strip_thinking_from_history,
        ultra=ultra,
        reasoning_effort=reasoning_effort,
        support_thinking=support_thinking,
    )
