"""``chatml``: ChatML with Hermes-style tool calls, written token by token.

For instruct models whose chat format is ChatML and whose template has no tool section --
SmolLM2 (``model: smollm2``, where ``renderer: auto`` picks it) -- or any ChatML vocabulary
(Qwen2.5's, ...). A tool-use episode renders as::

    <|im_start|>system
    You are a helpful AI assistant named SmolLM, trained by Hugging Face

    # Tools
    ... <tools>
    {"type": "function", "function": {"name": "add", ...}}
    </tools> ...<|im_end|>
    <|im_start|>user
    what is 2+3?<|im_end|>
    <|im_start|>assistant
    <tool_call>
    {"name": "add", "arguments": {"a": 2, "b": 3}}
    </tool_call><|im_end|>
    <|im_start|>tool
    5<|im_end|>
    <|im_start|>assistant
    It is 5.<|im_end|>

* **Plain conversations** render to exactly the ids of the model's own chat template, default
  system prompt included: ``system_prompt: auto`` takes the one the template writes when a
  conversation has none (SmolLM2's "You are a helpful AI assistant named SmolLM, ..."; none for a
  tokenizer without a template); a string replaces it, ``null`` (or ``""``) leaves it out.
* **Tools** are listed in the system turn, one JSON spec a line inside ``<tools></tools>``, with
  a short instruction; the model calls them in its turn in the Hermes format
  (:mod:`~tempering.plugins.renderers.hermes`, the parser ``hf_chat`` uses too).
* **Tool results** are a turn of their own, ``<|im_start|>tool\\n...<|im_end|>``: the model's
  template is role-generic (``<|im_start|>`` + role), so a conversation with tool messages still
  renders exactly as the model's template renders it, and one message stays one turn.
  (Qwen2.5 wraps results in ``<tool_response>`` inside a user turn; a model that has never seen
  either learns ours from the same demonstrations.)
* **Token-exact**: ``<|im_start|>`` / ``<|im_end|>`` are written as their ids and the text between
  them is encoded as one piece, so BPE never merges across a marker; an assistant turn's text is
  encoded apart from its ``assistant\\n`` header, exactly as the model sampled it after the
  generation prompt (the template encodes them together, which differs only for a turn that
  starts with a newline). Text never becomes a marker: ``<|im_end|>`` in a tool's output stays
  text (on tokenizers that can split special tokens; Hugging Face's can).
* **Prefix-preserving**: a parsed turn renders back to the tokens it was sampled as when they
  are the canonical encoding of the canonical form (text, then each call as
  :func:`~tempering.plugins.renderers.hermes.format_hermes` writes it). A turn sampled otherwise
  (extra spaces in the JSON, text after a call) re-renders differently and starts a new row,
  as the trajectory builder does for any renderer.

``</think>`` is text here (the format has no reasoning block); an assistant message carrying
``reasoning_content`` is refused rather than silently dropped.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from tempering.errors import ConfigError
from tempering.interfaces import ChatTemplateTokenizer, Tokenizer
from tempering.plugins.renderers.hermes import format_hermes, parse_hermes
from tempering.plugins.renderers.hf_chat import error_line, special_ids
from tempering.rollouts.chat import Message, ParsedResponse, ToolCall, text_of
from tempering.rollouts.renderer import RenderedPrompt
from tempering.rollouts.trajectory import TrainingRow, training_rows

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
AUTO = "auto"
#: How the system turn declares tools (after the system prompt, if any).
TOOLS_INTRO = "# Tools\n\nYou can call the tools whose JSON schemas are listed inside <tools></tools>:\n<tools>\n"
TOOLS_OUTRO = (
    "\n</tools>\n\nTo call a tool, write a JSON object with its name and arguments inside "
    "<tool_call></tool_call> tags, one block per call:\n<tool_call>\n"
    '{"name": "<tool name>", "arguments": {"<argument>": <value>}}\n</tool_call>'
)


class ChatML:
    """The ``chatml`` renderer over ``tokenizer`` (see the module docstring). Config key:
    ``system_prompt`` (``auto``: the model's template's default; a string; ``null``: none)."""

    name = "chatml"
    prefix_preserving = True
    supports_tools = True

    def __init__(self, tokenizer: Tokenizer, system_prompt: str | None = AUTO) -> None:
        self.im_start, self.im_end = marker_ids(tokenizer)
        self.tokenizer = tokenizer
        eos = getattr(tokenizer, "eos_token_id", None)
        self._stop = [self.im_end, *([int(eos)] if isinstance(eos, int) and eos != self.im_end else [])]
        self.system_prompt = template_system_prompt(tokenizer) if system_prompt == AUTO else (system_prompt or None)
        # Every turn re-renders the whole history: a text seen before costs a lookup, not a tokenizer call.
        self._encode = lru_cache(maxsize=1 << 16)(self._encode_text)
        self._header = list(self._encode("assistant\n"))
        self._newline = list(self._encode("\n"))

    # ------------------------------------------------------------------ rendering
    def _encode_text(self, text: str) -> tuple[int, ...]:
        ids = self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        return tuple(int(i) for i in ids)

    def _turn(self, role: str, text: str) -> list[int]:
        """A turn the model reads; its header and text are one piece, as the template encodes them."""
        return [self.im_start, *self._encode(f"{role}\n{text}"), self.im_end, *self._newline]

    def render_response(self, message: Message) -> list[int]:
        """What the model emits for an assistant message: its text and calls, then ``<|im_end|>``."""
        if message.get("reasoning_content"):
            raise ValueError(
                "renderer 'chatml' has no reasoning block, so the assistant message's reasoning_content "
                "would be dropped; put it in the content, or use a renderer whose format reasons"
            )
        calls = [ToolCall.from_openai(c) for c in message.get("tool_calls") or []]
        return [*self._encode(format_hermes(text_of(message), calls)), self.im_end]

    def _history(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None) -> list[int]:
        messages = list(messages)
        system = self.system_prompt
        if messages and messages[0].get("role") == "system":
            system, messages = text_of(messages[0]), messages[1:]
        if tools:
            system = f"{system}\n\n{tools_section(tools)}" if system else tools_section(tools)
        out = self._turn("system", system) if system is not None else []
        for m in messages:
            if m.get("role") == "assistant":
                out += [self.im_start, *self._header, *self.render_response(m), *self._newline]
            else:
                out += self._turn(str(m.get("role")), text_of(m))
        return out

    def render_prompt(
        self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None = None
    ) -> RenderedPrompt:
        return RenderedPrompt([*self._history(messages, tools), self.im_start, *self._header], self.parse)

    def render_training(
        self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None = None
    ) -> list[TrainingRow]:
        return training_rows(lambda h: self.render_prompt(h, tools).tokens, self.render_response, messages)

    def stop(self) -> list[int]:
        return list(self._stop)

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode([int(t) for t in tokens], skip_special_tokens=False)

    # ------------------------------------------------------------------ parsing
    def parse(self, tokens: Sequence[int]) -> ParsedResponse:
        tokens = [int(t) for t in tokens]
        body = tokens[:-1] if tokens and tokens[-1] in self._stop else tokens
        try:
            return parse_hermes(self.decode(body), self.decode(tokens), reasoning=False)
        except Exception as exc:  # noqa: BLE001 - e.g. an id the tokenizer cannot decode: a malformed turn
            return ParsedResponse(parse_error=error_line(exc), raw=repr(tokens))


def tools_section(tools: Sequence[dict[str, Any]]) -> str:
    """The system turn's tool declaration: each OpenAI tool spec as one JSON line."""
    specs = [t if "function" in t else {"type": "function", "function": t} for t in tools]
    return TOOLS_INTRO + "\n".join(json.dumps(s, ensure_ascii=False) for s in specs) + TOOLS_OUTRO


def marker_ids(tokenizer: Tokenizer) -> tuple[int, int]:
    """The ids of ``<|im_start|>`` and ``<|im_end|>``; a :class:`ConfigError` in one line unless
    the tokenizer holds each as one special token that its text encodes to (a character
    tokenizer would spell them out, and then text could never end a turn)."""
    ids = {marker: _marker_id(tokenizer, marker) for marker in (IM_START, IM_END)}
    special = special_ids(tokenizer)
    missing = [m for m, i in ids.items() if i is None]
    ordinary = [m for m, i in ids.items() if i is not None and i not in special]
    if missing or ordinary:
        path = getattr(tokenizer, "name_or_path", "")
        theirs = type(tokenizer).__name__ + (f" '{path}'" if isinstance(path, str) and path else "")
        problems = ([f"no {' or '.join(missing)} token"] if missing else []) + [
            f"{m} as an ordinary token" for m in ordinary
        ]
        raise ConfigError(
            f"renderer 'chatml' needs {IM_START} and {IM_END} as single special tokens, but the model's tokenizer "
            f"({theirs}) has {' and '.join(problems)}; use the renderer of the model's chat format (renderer: auto "
            "picks it), or renderer: raw for plain text prompts",
            "renderer",
        )
    return ids[IM_START], ids[IM_END]  # type: ignore[return-value]


def _marker_id(tokenizer: Tokenizer, marker: str) -> int | None:
    """The id of ``marker`` when it is one token and the tokenizer encodes its text to that id."""
    tid = tokenizer.convert_tokens_to_ids(marker)
    if not isinstance(tid, int) or tid == getattr(tokenizer, "unk_token_id", None):
        return None
    try:
        ids = [int(i) for i in tokenizer(marker, add_special_tokens=False)["input_ids"]]
    except Exception:  # noqa: BLE001 - a vocabulary that cannot spell it
        return None
    return tid if ids == [tid] else None


def template_system_prompt(tokenizer: Tokenizer) -> str | None:
    """The system prompt the tokenizer's chat template writes when a conversation has none, read
    off the template's rendering of a one-message conversation; None when it writes none, has no
    template, or is not ChatML."""
    if not (isinstance(tokenizer, ChatTemplateTokenizer) and tokenizer.chat_template):
        return None
    probe = "Tempering probe"
    user = f"{IM_START}user\n{probe}{IM_END}\n"
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": probe}], tokenize=False)
    except Exception:  # noqa: BLE001 - a template that needs more than this: no default to copy
        return None
    head, tail = f"{IM_START}system\n", f"{IM_END}\n{user}"
    if isinstance(text, str) and text.startswith(head) and text.endswith(tail):
        return text[len(head) : -len(tail)]
    return None
