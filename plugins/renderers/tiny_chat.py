"""``tiny_chat``: a compact chat format for the tiny in-code models (``tiny_llama(chat=True)``).

Production formats spend dozens of tokens on headers and JSON; a character-level model with a
few hundred thousand parameters learns faster when a turn is short. One special token per role
and one per tool call, and calls written as Python keyword calls::

    <bos><|system|>tools: mul(a,b) add(a,b)<|user|>what is 12*34+5?<|assistant|><|call|>mul(a=12,b=34)<eos>
    <|tool|>408<|assistant|><|call|>add(a=408,b=5)<eos><|tool|>413<|assistant|>413<eos>

The tools line is the compact signature of each tool's JSON schema (parameter names in schema
order). A call parses with Python's ``ast`` (keyword arguments, literal values only); anything
else is a parse error the environment can score, never an exception. Rendering a parsed call
gives the canonical form back (``name(k=v,...)``, no spaces), so the format is prefix-preserving
for turns written canonically.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    pass

from tempering.errors import ConfigError
from tempering.interfaces import VocabTokenizer
from tempering.rollouts.chat import Message, ParsedResponse, ToolCall, text_of
from tempering.rollouts.renderer import RenderedPrompt
from tempering.rollouts.trajectory import TrainingRow, training_rows

ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>", "tool": "<|tool|>"}
CALL_TOKEN = "<|call|>"


class TinyChat:
    """The ``tiny_chat`` renderer over a tokenizer that has the role and call tokens."""

    name = "tiny_chat"
    prefix_preserving = True

    def __init__(self, tokenizer: VocabTokenizer) -> None:
        ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in [*ROLE_TOKENS.values(), CALL_TOKEN]}
        unk = getattr(tokenizer, "unk_token_id", None)
        missing = [t for t, i in ids.items() if i is None or i == unk]
        if missing:
            raise ConfigError(
                f"the model's tokenizer has no {', '.join(missing)} token(s); tiny_chat needs them: build the "
                "model with model_kwargs: {chat: true}, or pick the renderer of your model's chat format",
                "renderer",
            )
        if tokenizer.eos_token_id is None:
            raise ConfigError("the model's tokenizer has no EOS token to end a turn with", "renderer")
        self.tokenizer = tokenizer
        self.role_ids = {role: ids[tok] for role, tok in ROLE_TOKENS.items()}
        self.call_id = ids[CALL_TOKEN]
        self.eos_id = int(tokenizer.eos_token_id)
        self.bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        self.chars = {t for t in tokenizer.get_vocab() if len(t) == 1}
        self._cache: dict[str, tuple[int, ...]] = {}

    # ------------------------------------------------------------------ rendering
    def _text(self, text: str) -> list[int]:
        """Plain text: marker strings inside it (``<|assistant|>`` in a tool's output) stay
        characters, never become role tokens. Cached: every turn re-renders the whole history,
        and a tokenizer call costs more than the lookup (a third of an episode's CPU time)."""
        if not text:
            return []
        ids = self._cache.get(text)
        if ids is None:
            if len(self._cache) > 100_000:
                self._cache.clear()
            ids = self._cache[text] = tuple(
                self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
            )
        return list(ids)

    def _seen(self, text: str) -> list[int]:
        """Text the model reads but did not write (a question, a tool's result, an error such as
        ``Error: ValueError: ...``) in the model's alphabet: a character tokenizer has no unknown
        token, and an environment's text must never make a prompt unrenderable. Letters outside
        the alphabet are lower-cased, other unknown characters become ``?``."""
        fallback = "?" if "?" in self.chars else ""
        return self._text(
            "".join(c if c in self.chars else c.lower() if c.lower() in self.chars else fallback for c in text)
        )

    def _message(self, m: Message) -> list[int]:
        role: Any = m.get("role")  # a missing role is a KeyError below
        if role == "assistant":
            return [self.role_ids["assistant"], *self.render_response(m)]
        return [self.role_ids[role], *self._seen(text_of(m))]

    def render_response(self, message: Message) -> list[int]:
        """What the model emits for an assistant message: text, calls, EOS."""
        out = self._text(text_of(message))
        for call in message.get("tool_calls") or []:
            c = ToolCall.from_openai(call)
            out += [self.call_id, *self._text(format_call(c.name, c.arguments))]
        return [*out, self.eos_id]

    def _prefix(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None) -> list[int]:
        out = list(self.bos)
        if tools:
            out += [self.role_ids["system"], *self._seen("tools: " + " ".join(signature(t) for t in tools))]
        for m in messages:
            out += self._message(m)
        return out

    def render_prompt(
        self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None = None
    ) -> RenderedPrompt:
        return RenderedPrompt([*self._prefix(messages, tools), self.role_ids["assistant"]], self.parse)

    def render_training(
        self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None = None
    ) -> list[TrainingRow]:
        return training_rows(lambda h: self.render_prompt(h, tools).tokens, self.render_response, messages)

    def stop(self) -> list[int]:
        return [self.eos_id]

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=False)

    # ------------------------------------------------------------------ parsing
    def parse(self, tokens: Sequence[int]) -> ParsedResponse:
        tokens = list(tokens)
        raw = self.decode(tokens)
        if tokens and tokens[-1] == self.eos_id:
            tokens = tokens[:-1]
        parts: list[list[int]] = [[]]
        for t in tokens:
            if t == self.call_id:
                parts.append([])
            else:
                parts[-1].append(t)
        text = self.tokenizer.decode(parts[0], skip_special_tokens=True)
        calls, errors = [], []
        for part in parts[1:]:
            body = self.tokenizer.decode(part, skip_special_tokens=True)
            try:
                calls.append(parse_call(body))
            except ValueError as exc:
                errors.append(str(exc))
        return ParsedResponse(text=text, tool_calls=calls, parse_error="; ".join(errors) or None, raw=raw)


def signature(spec: dict[str, Any]) -> str:
    """``name(a,b)`` from an OpenAI tool spec."""
    fn = spec.get("function", spec)
    params = list(((fn.get("parameters") or {}).get("properties") or {}).keys())
    return f"{fn['name']}({','.join(params)})"


def format_value(v: object) -> str:
    """A Python literal that :func:`ast.literal_eval` reads back as ``v`` (no spaces)."""
    if isinstance(v, str):
        return format_string(v)
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(format_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{format_value(str(k))}:{format_value(x)}" for k, x in v.items()) + "}"
    return repr(v)


def format_string(s: str) -> str:
    """``s`` as a string literal that needs no escape where a quoting allows it: a model's call
    ``search(query='say "hi"')`` is re-rendered with the quotes it used, not as ``"say \\"hi\\""``,
    whose backslash a character model's alphabet may not hold (the next prompt would then be
    unrenderable). Escapes (JSON's) only where no quoting reads back as ``s``."""
    if not any(c in s for c in '"\\\n\r'):  # the common case, without parsing (every turn re-renders the history)
        return f'"{s}"'
    if "\\" not in s:  # a backslash always reads as the start of an escape
        for quote in ('"', "'", '"""', "'''"):
            try:
                if ast.literal_eval(quote + s + quote) == s:
                    return quote + s + quote
            except (SyntaxError, ValueError):
                continue
    return json.dumps(s, ensure_ascii=False)


def format_call(name: str, arguments: dict[str, Any]) -> str:
    return f"{name}(" + ",".join(f"{k}={format_value(v)}" for k, v in arguments.items()) + ")"


def parse_call(text: str) -> ToolCall:
    """``name(k=v, ...)`` with literal values -> :class:`ToolCall`; ``ValueError`` otherwise."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        raise ValueError(f"malformed tool call {text!r}: not a call expression") from None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError(f"malformed tool call {text!r}: expected name(key=value, ...)")
    if node.args:
        raise ValueError(f"malformed tool call {text!r}: arguments must be named (key=value)")
    args = {}
    for kw in node.keywords:
        if kw.arg is None:
            raise ValueError(f"malformed tool call {text!r}: no **kwargs")
        try:
            args[kw.arg] = ast.literal_eval(kw.value)
        except ValueError:
            raise ValueError(f"malformed tool call {text!r}: the value of '{kw.arg}' is not a literal") from None
    return ToolCall(node.func.id, args)
