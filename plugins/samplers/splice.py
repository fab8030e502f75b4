"""Exact token history for the endpoint: an assistant turn it returned re-enters a later prompt as
the tokens that were sampled, not as the renderer's re-rendering of its parsed text.

A harness sends its history back as messages, and a renderer renders messages canonically: the
turn the endpoint returned becomes the canonical tokens of its parsed text and tool calls. Those
differ from the sampled tokens whenever the model wrote the turn in a form the parse does not
keep -- a word split into other BPE pieces than the tokenizer's own, whitespace between text and
a tool call, spacing inside the call's JSON, text after a call (issue 35 reported 5 of 10 text +
tool-call turns of SmolLM2 under ``chatml``): the follow-up prompt then showed the model a turn it
never wrote, and the episode's training row split there.

:func:`spliced_prompt` undoes that without any renderer's help. Each chat call keeps its
canonical prompt and the message it returned; when a new request's canonical rendering starts
with an earlier call's canonical prompt followed by the canonical tokens of that call's returned
turn (:func:`turn_end`), that part is replaced by the earlier call's actual prompt and its sampled
tokens. The rest -- tool results, new user turns, the generation header -- is the renderer's.
The latest such call wins (its prompt holds the earlier splices). A harness that edited the turn
or the history before it matches nothing and gets the canonical rendering: a new row, as any
context edit. A renderer that rewrites history (Qwen3 dropping old reasoning) renders the turn
elsewhere than after the old prompt, so it matches nothing either and keeps its own rewriting.

A turn the model did not end (cut at ``max_tokens`` or at a ``stop`` string) gets its
canonical end-of-turn token after the sampled tokens -- the history closes the turn, as the
re-rendering would; that token is context (weight 0), never trained.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tempering.rollouts.chat import Message

if TYPE_CHECKING:  # pragma: no cover
    from tempering.rollouts.renderer import Renderer


def turn_end(
    renderer: Renderer,
    messages: Sequence[Message],
    tools: Sequence[dict[str, Any]] | None,
    turn: Message,
    prompt: list[int],
) -> list[int] | None:
    """The canonical tokens of ``messages`` followed by the assistant ``turn`` as the renderer
    writes it for the model to emit (up to its end-of-turn token), when they start with
    ``prompt`` (the canonical generation prompt of ``messages``); None when the renderer cannot
    say."""
    try:
        response = getattr(renderer, "render_response", None)
        if callable(response):  # tiny_chat, chatml: the prompt, then the turn as the model emits it
            head = [*prompt, *response(turn)]
        else:  # any renderer: the last supervised row of the conversation, earlier turns as context
            context = [dict(m, weight=0) if m.get("role") == "assistant" else m for m in messages]
            row = renderer.render_training([*context, turn], tools or None)[-1]
            weighted = [i for i, w in enumerate(row.weights) if w > 0]
            if not weighted:
                return None
            head = list(row.tokens[: weighted[-1] + 1])
    except Exception:  # noqa: BLE001 - a turn the renderer cannot render back is never spliced
        return None
    return head if len(head) > len(prompt) and head[: len(prompt)] == prompt else None


def spliced_prompt(canonical: list[int], calls: Sequence[Any], renderer: Renderer) -> list[int]:
    """``canonical`` (a request's rendering) with the latest earlier turn it holds as the tokens
    sampled for it (see the module docs). ``calls`` are the episode's recorded calls
    (:class:`~tempering.plugins.samplers.openai_endpoint.Call`): chat calls carry their canonical
    prompt and returned message."""
    stops = set(renderer.stop())
    best: tuple[int, Any, list[int]] | None = None
    for call in calls:
        before = call.canonical
        if before is None or len(before) >= len(canonical) or canonical[: len(before)] != before:
            continue
        turn = call.turn_end(renderer)
        if turn is None:
            continue
        end = _turn_in_history(renderer, canonical, len(before), turn[len(before) :], stops)
        if end is not None and (best is None or end > best[0]):
            best = (end, call, canonical[end:])
    if best is None:
        return list(canonical)
    _, call, rest = best
    sampled = list(call.completion.tokens)
    if sampled and sampled[-1] in stops and rest[:1] == sampled[-1:]:
        rest = rest[1:]  # the history's end of turn is the one the model sampled
    return [*call.prompt, *sampled, *rest]


def _turn_in_history(
    renderer: Renderer, canonical: list[int], start: int, turn: list[int], stops: set[int]
) -> int | None:
    """Where the text of ``turn`` (its end-of-turn tokens left out) ends in ``canonical`` from
    ``start``, or None when the history does not hold it there. The history may spell the same
    text in other pieces than the turn (tml-renderers encode a supervised turn in spans): the
    text decides."""
    while turn and turn[-1] in stops:
        turn = turn[:-1]
    if canonical[start : start + len(turn)] == turn:
        return start + len(turn)
    text = renderer.decode(turn)
    lo, hi = start, len(canonical)
    while lo < hi:  # the shortest prefix whose text is at least as long as the turn's
        mid = (lo + hi) // 2
        if len(renderer.decode(canonical[start:mid])) < len(text):
            lo = mid + 1
        else:
            hi = mid
    return lo if renderer.decode(canonical[start:lo]) == text else None


__all__ = ["spliced_prompt", "turn_end"]
