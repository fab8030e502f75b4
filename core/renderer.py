"""Renderers: messages <-> tokens for one model family (component kind ``renderer``).

A renderer owns everything a chat format decides: how a conversation and its tools become the
prompt's tokens, which tokens end a model turn (:meth:`Renderer.stop`, always explicit, so no
backend default decides where a turn ends), how a sampled turn parses into text, reasoning and
tool calls, and how a transcript becomes supervised rows. The same renderer object is used on
every backend, so a recipe tokenizes identically locally and on Tinker.

Built-ins (``tempering plugins --kind renderer``): ``tiny_chat`` for the in-code tiny models,
``hf_chat`` (a tokenizer's own chat template plus a tool-call parser) and the production
formats of ``tml-renderers`` (``qwen3``, ``deepseek_v3``, ``kimi_k2``, ``gpt_oss``, ...).
A renderer factory receives the backend's ``tokenizer`` and must refuse one whose ids do not
match its format (a Qwen3 renderer on a Llama tokenizer) rather than train on garbage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from tempering.chat import Message, ParsedResponse
from tempering.trajectory import TrainingRow


@dataclass
class RenderedPrompt:
    """A generation prompt and the parser for the model's answer to it (a parser may depend on
    the prompt, e.g. a prompt that opens a reasoning block)."""

    tokens: list[int]
    parser: Callable[[Sequence[int]], ParsedResponse]

    def parse(self, tokens: Sequence[int]) -> ParsedResponse:
        return self.parser(list(tokens))


@runtime_checkable
class Renderer(Protocol):
    """``prefix_preserving``: the renderer promises that rendering a history extended by a
    parsed model turn and new messages starts with the previous prompt plus the sampled
    tokens (then a trajectory is one training row); renderers that rewrite history say False
    and trajectories split into rows where they do."""

    name: str
    prefix_preserving: bool

    def render_prompt(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None = None) -> RenderedPrompt:
        """Tokens of ``messages`` followed by the header of an assistant turn."""
        ...

    def render_training(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None = None) -> list[TrainingRow]:
        """Supervised rows for every assistant turn of a transcript (weight 1 on its tokens)."""
        ...

    def stop(self) -> list[int]:
        """Token ids that end a model turn."""
        ...

    def decode(self, tokens: Sequence[int]) -> str: ...


AUTO = "auto"


def default_renderer_name(tokenizer: Any) -> str:
    """What ``renderer: auto`` means for a tokenizer: the renderer a model builder asked for
    (``tokenizer.tempering_renderer``, e.g. ``qwen3_instruct`` for ``tiny_qwen3``), else the
    tokenizer's own chat template (``hf_chat``), else ``tiny_chat``."""
    hint = getattr(tokenizer, "tempering_renderer", None)
    if isinstance(hint, str) and hint:
        return hint
    if getattr(tokenizer, "chat_template", None):
        return "hf_chat"
    return "tiny_chat"


def build_renderer(ctx: Any, spec: Any, key: str = "renderer") -> Renderer:
    """Build a stage's renderer for the backend's tokenizer (``auto`` resolved first)."""
    tokenizer = ctx.backend.tokenizer
    if spec is None or spec == AUTO:
        spec = default_renderer_name(tokenizer)
    return ctx.build("renderer", spec, key, tokenizer=tokenizer)


def check_renderer(ctx: Any, spec: Any, key: str = "renderer") -> None:
    """Validate a renderer spec before training (``auto`` needs the backend: checked at build)."""
    if spec is not None and spec != AUTO:
        ctx.check("renderer", spec, key, context=("tokenizer",))
