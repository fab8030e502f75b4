"""Chat messages, tool calls and what a renderer parses out of a model's turn.

Messages are plain dicts in the OpenAI chat format (``role``, ``content``, ``tool_calls``,
``tool_call_id``, ``name``) because that is what every tool in the ecosystem reads and writes:
JSONL transcripts, Hugging Face chat templates, ``tml-renderers``' ``from_oss_messages``,
OpenAI-compatible servers. Only the two things a loop must *reason* about get a type of their
own: a :class:`ToolCall` (name plus decoded arguments) and a :class:`ParsedResponse` (what the
model said, thought and called in one turn, or why that could not be parsed).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Message = dict[str, Any]
"""One chat message in the OpenAI format, e.g. ``{"role": "user", "content": "hi"}``."""

ROLES = ("system", "user", "assistant", "tool")


@dataclass
class ToolCall:
    """A call the model asked for: ``name`` with decoded JSON ``arguments``.

    ``id`` pairs the call with its tool message (``tool_call_id``); renderers that do not
    produce ids get one assigned by :func:`assign_call_ids`.
    """

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    id: str | None = None

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)},
        }

    @classmethod
    def from_openai(cls, call: Mapping[str, Any]) -> ToolCall:
        """Read ``{"id", "type": "function", "function": {"name", "arguments"}}``; ``arguments``
        may be a JSON string (the OpenAI convention) or already a dict."""
        fn = call.get("function", call)
        args = fn.get("arguments") or {}
        if isinstance(args, str):
            args = json.loads(args) if args.strip() else {}
        if not isinstance(args, dict):
            raise ValueError(f"tool call arguments must be a JSON object, got {type(args).__name__}")
        return cls(str(fn["name"]), dict(args), call.get("id"))


@dataclass
class ParsedResponse:
    """One assistant turn as the renderer read it from the sampled tokens.

    A malformed turn is data, not an exception: ``parse_error`` says what was wrong (an
    unterminated tool call, arguments that are not JSON, a turn cut by the token limit) and the
    environment decides what it is worth. ``raw`` is the decoded text including markup, for logs.
    """

    text: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    reasoning: str | None = None
    parse_error: str | None = None
    raw: str = ""

    @property
    def ok(self) -> bool:
        return self.parse_error is None

    def to_message(self) -> Message:
        """The assistant message to put in the history (what the next prompt re-renders)."""
        msg: Message = {"role": "assistant", "content": self.text}
        if self.reasoning:
            msg["reasoning_content"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        return msg


def assign_call_ids(calls: Sequence[ToolCall], turn: int) -> None:
    """Give id-less calls a stable id (``call_<turn>_<i>``) so tool messages can refer to them."""
    for i, call in enumerate(calls):
        if not call.id:
            call.id = f"call_{turn}_{i}"


def tool_message(call: ToolCall, content: str) -> Message:
    """The message carrying a tool's result (or error text) back to the model."""
    return {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": content}


def text_of(message: Mapping[str, Any]) -> str:
    """The text of a message whose ``content`` is a string or a list of OpenAI content parts."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if isinstance(part, Mapping) and part.get("type", "text") == "text":
            parts.append(str(part.get("text", "")))
        elif isinstance(part, str):
            parts.append(part)
    return "".join(parts)


def check_messages(messages: object, where: str) -> list[Message]:
    """Validate a message list early, with a message that says which one is wrong and why."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise ValueError(f"{where}: messages must be a list of {{role, content}} dicts, got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, Mapping) else type(m).__name__
            raise ValueError(f"{where}[{i}]: a message needs role one of {ROLES}, got {role!r}")
        out.append(dict(m))
    return out
