"""Hermes-style tool calls: the one parser (and writer) that ``hf_chat`` and ``chatml`` share.

A call is a JSON object inside ``<tool_call></tool_call>`` tags, in the assistant's turn::

    Let me add.
    <tool_call>
    {"name": "add", "arguments": {"a": 2, "b": 3}}
    </tool_call>

the convention of most open models (Hermes, Qwen2.5, ...). :func:`parse_hermes` reads any
whitespace around the JSON; :func:`format_hermes` writes the canonical form above, which
:func:`parse_hermes` reads back to the same text and calls -- what makes a renderer that writes
calls with it prefix-preserving for turns sampled in that form.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from tempering.rollouts.chat import ParsedResponse, ToolCall

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_hermes(text: str, raw: str = "", reasoning: bool = True) -> ParsedResponse:
    """``[<think>reasoning</think>] text <tool_call>{"name": ..., "arguments": {...}}</tool_call> ...``
    -> :class:`ParsedResponse`; well-formed calls are kept next to the errors of the others.
    ``reasoning=False``: a format without a think block, where ``</think>`` is just text (a
    parsed reasoning would be dropped when the turn is rendered back)."""
    thought = None
    if reasoning and "</think>" in text:  # the prompt may have opened the block already
        head, text = text.split("</think>", 1)
        thought = head.replace("<think>", "", 1).strip() or None
    calls, errors = [], []
    for i, match in enumerate(TOOL_CALL.finditer(text)):
        try:
            calls.append(_hermes_call(match.group(1)))
        except ValueError as exc:
            errors.append(f"tool call {i}: {exc}")
    rest = TOOL_CALL.sub("", text)
    if "<tool_call>" in rest:
        errors.append("a <tool_call> without its </tool_call>")
    elif "</tool_call>" in rest:
        errors.append("a </tool_call> without its <tool_call>")
    return ParsedResponse(rest.strip(), calls, thought, "; ".join(errors) or None, raw or text)


def format_hermes(text: str, calls: Sequence[ToolCall]) -> str:
    """An assistant turn's text and calls in the canonical form (see the module docstring):
    the text, then each call on lines of its own, separated by newlines."""
    parts = [text] if text else []
    for c in calls:
        body = json.dumps({"name": c.name, "arguments": c.arguments}, ensure_ascii=False)
        parts.append(f"<tool_call>\n{body}\n</tool_call>")
    return "\n".join(parts)


def _hermes_call(body: str) -> ToolCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError('expected {"name": "...", "arguments": {...}}')
    return ToolCall.from_openai({"function": {"name": obj["name"], "arguments": obj.get("arguments") or {}}})
