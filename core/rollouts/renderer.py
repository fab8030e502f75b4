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

A stage's renderer also decides how its text ``prompt`` examples reach the model
(:func:`chat_text_prompts`): as one user turn when the stage has a chat renderer, as raw text
with ``renderer: raw`` or for a model without a chat format.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from tempering.errors import ConfigError
from tempering.interfaces import Tokenizer, model_renderer
from tempering.rollouts.chat import Message, ParsedResponse
from tempering.rollouts.trajectory import TrainingRow

if TYPE_CHECKING:  # pragma: no cover
    from tempering.interfaces import BuildContext


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

    def render_prompt(
        self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None = None
    ) -> RenderedPrompt:
        """Tokens of ``messages`` followed by the header of an assistant turn."""
        ...

    def render_training(
        self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None = None
    ) -> list[TrainingRow]:
        """Supervised rows for every assistant turn of a transcript (weight 1 on its tokens)."""
        ...

    def stop(self) -> list[int]:
        """Token ids that end a model turn."""
        ...

    def decode(self, tokens: Sequence[int]) -> str: ...


AUTO = "auto"
#: ``renderer: raw``: no chat format -- a stage's text prompts go to the model as they are.
RAW = "raw"


def declared_renderer(tokenizer: Tokenizer, declared: str | None) -> str | None:
    """The chat format a model declares: ``declared``, the renderer its builder named
    (:func:`tempering.interfaces.model_renderer` of the backend: ``qwen3_instruct`` for
    ``tiny_qwen3``, ``chatml`` for ``smollm2``), else ``hf_chat`` when the tokenizer has a
    chat template; None for a model without one (the character-level tiny models without
    ``chat: true``)."""
    if declared:
        return declared
    if getattr(tokenizer, "chat_template", None):
        return "hf_chat"
    return None


def default_renderer_name(tokenizer: Tokenizer, declared: str | None) -> str:
    """What ``renderer: auto`` means for a model: its :func:`declared_renderer`, else
    ``tiny_chat``."""
    return declared_renderer(tokenizer, declared) or "tiny_chat"


def chat_text_prompts(spec: object, tokenizer: Tokenizer, declared: str | None) -> bool:
    """Whether a stage renders a text ``prompt`` as one user turn through its renderer (and
    parses the answer back through it) rather than sending the raw text: yes when the stage
    names a renderer, or leaves it ``auto`` and the model declares a chat format
    (:func:`declared_renderer`); no with ``renderer: raw``. An instruct model given raw text
    answers with an immediate end of turn; a model without a chat format keeps raw text."""
    if spec == RAW:
        return False
    if spec is None or spec == AUTO:
        return declared_renderer(tokenizer, declared) is not None
    return True


def renderer_spec(spec: object, tokenizer: Tokenizer, declared: str | None, path: str = "renderer") -> Any:
    """A stage's renderer spec with ``auto`` resolved for the model; ``raw`` is refused
    here, where a chat (``messages``, an environment's episode) needs a renderer."""
    if spec == RAW:
        raise ConfigError(
            "raw sends text prompts as they are, but this stage has chat messages to render "
            "(a 'messages' dataset or an environment); name the model's chat renderer, or auto",
            path,
        )
    return default_renderer_name(tokenizer, declared) if spec is None or spec == AUTO else spec


def resolved_name(spec: object, tokenizer: Tokenizer, declared: str | None) -> Any:
    """``spec`` with ``auto`` replaced by the model's declared chat format
    (:func:`declared_renderer`), for records (``eval.json``, ``tempering show --resolved``):
    naming it then changes nothing. For a model without one ``auto`` stays ``auto`` -- its text
    prompts go raw, which naming ``tiny_chat`` would change (:func:`chat_text_prompts`)."""
    if spec is not None and spec != AUTO:
        return spec
    return declared_renderer(tokenizer, declared) or AUTO


def build_renderer(ctx: BuildContext, spec: object, key: str = "renderer") -> Renderer:
    """Build a stage's renderer for the backend's tokenizer (``auto`` resolved first)."""
    tokenizer = ctx.backend.tokenizer
    path = f"{getattr(ctx, 'path', '')}.{key}".lstrip(".")
    spec = renderer_spec(spec, tokenizer, model_renderer(ctx.backend), path)
    return ctx.build("renderer", spec, key, tokenizer=tokenizer)


def check_renderer(ctx: BuildContext, spec: object, key: str = "renderer") -> None:
    """Validate a renderer spec before training (``auto`` needs the backend: checked at build)."""
    if spec is not None and spec not in (AUTO, RAW):
        ctx.check("renderer", spec, key, context=("tokenizer",))
