"""``hf_chat``: the chat template of any Hugging Face tokenizer that has one.

For models no dedicated renderer knows. The template decides everything it can:

* **prompts**: ``apply_chat_template(messages, tools=..., add_generation_prompt=True)``;
* **an assistant turn's tokens**: what the template adds for it, i.e. the rendering of
  ``history + [turn]`` minus the prompt for ``history``, cut after its first stop token (templates
  write a newline after the end-of-turn token; it belongs to the next prompt, not to what the
  model samples). When the prompt is *not* a prefix of that rendering -- the generation prompt
  writes something a stored turn does not (an opened ``<think>``), or the template renders
  earlier messages differently once the turn is added -- no token-exact cut exists and
  :meth:`HfChat.render_training` raises saying so: such a model needs a renderer of its own;
* **stop ids** (explicit): the EOS id(s), every :data:`END_OF_TURN` marker that the template's
  source mentions and that is one token in the vocabulary, and the first special token the
  template writes after an assistant message's text (found by rendering a probe turn), so an
  unusual marker still ends a turn;
* **parsing**: transformers' ``tokenizer.parse_response`` when the tokenizer declares a
  ``response_template`` (transformers 5), else Hermes-style calls -- ``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>``, the convention of most open models, read by the parser
  ``chatml`` shares (:mod:`~tempering.plugins.renderers.hermes`) -- plus an optional
  ``<think>...</think>`` block. A malformed call is a ``parse_error``, never an exception.

``prefix_preserving`` is measured when the renderer is built: a probe answer is parsed, put
back into the history with a user reply, and the new prompt must start with the old prompt
plus the answer's tokens. Tool-call arguments are handed to the template as dicts (the Hugging
Face convention), whatever form the messages carry them in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedTokenizerBase

from tempering.errors import ConfigError
from tempering.interfaces import Tokenizer
from tempering.plugins.renderers.hermes import parse_hermes
from tempering.rollouts.chat import Message, ParsedResponse, ToolCall
from tempering.rollouts.renderer import RenderedPrompt
from tempering.rollouts.trajectory import TrainingRow, training_rows

#: End-of-turn markers of common chat formats (ChatML, Llama 3, Phi, Gemma, harmony, DeepSeek, ...).
END_OF_TURN = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|end_of_turn|>",
    "<|return|>",
    "<|call|>",
    "</s>",
    "<｜end▁of▁sentence｜>",
    "<|endoftext|>",
)


class HfChat:
    """The ``hf_chat`` renderer over ``tokenizer`` (see the module docstring)."""

    name = "hf_chat"

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                f"the model's tokenizer ({type(tokenizer).__name__}) has no chat template, which hf_chat renders "
                "with; give the tokenizer one, or pick the renderer of the model's format (tiny_chat, qwen3, ...)",
                "renderer",
            )
        self.tokenizer = tokenizer
        self.response_template = getattr(tokenizer, "response_template", None)
        self._stop = stop_ids(tokenizer, self._template)
        self.prefix_preserving = self._measure_prefix()

    # ------------------------------------------------------------------ rendering
    def _template(
        self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None, generation: bool
    ) -> list[int]:
        ids: Any = self.tokenizer.apply_chat_template(
            [_hf_message(m) for m in messages],
            tools=list(tools) if tools else None,
            add_generation_prompt=generation,
            tokenize=True,
            return_dict=False,
        )
        return [int(i) for i in (ids["input_ids"] if isinstance(ids, Mapping) else ids)]

    def render_prompt(
        self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None = None
    ) -> RenderedPrompt:
        tokens = self._template(messages, tools, True)
        return RenderedPrompt(tokens, lambda sampled: self.parse(sampled, tokens, tools))

    def response_tokens(
        self,
        prompt: Sequence[int],
        history: Sequence[Message],
        message: Message,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The tokens the model emits for assistant ``message`` after ``history`` (whose
        generation prompt is ``prompt``), its stop token included."""
        full = self._template([*history, message], tools, False)
        prompt = list(prompt)
        if full[: len(prompt)] != prompt:
            at = next((i for i, (a, b) in enumerate(zip(full, prompt)) if a != b), min(len(full), len(prompt)))
            raise ValueError(
                f"hf_chat: the chat template renders the conversation before an assistant turn differently once the "
                f"turn is added (from token {at}, the prompt has {self.decode(prompt[at : at + 8])!r}, the transcript "
                f"{self.decode(full[at : at + 8])!r}), so the turn's tokens cannot be cut out of it; train this model "
                "with a renderer written for its format"
            )
        turn = full[len(prompt) :]
        end = next((i + 1 for i, t in enumerate(turn) if t in self._stop), None)
        # A template that writes no stop token: a sampled turn still ends with one.
        return turn[:end] if end is not None else [*turn, self._stop[0]]

    def render_training(
        self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None = None
    ) -> list[TrainingRow]:
        # training_rows asks for each assistant turn's prompt, then for its tokens: the turn's
        # tokens need that prompt and history, kept here between the two calls.
        last: dict[str, Any] = {}

        def prompt(history: Sequence[Message]) -> list[int]:
            last.update(history=list(history), tokens=self._template(history, tools, True))
            return last["tokens"]

        return training_rows(
            prompt, lambda m: self.response_tokens(last["tokens"], last["history"], m, tools), messages
        )

    def stop(self) -> list[int]:
        return list(self._stop)

    def decode(self, tokens: Sequence[int]) -> str:
        return str(self.tokenizer.decode([int(t) for t in tokens], skip_special_tokens=False))  # one row: one str

    # ------------------------------------------------------------------ parsing
    def parse(
        self, tokens: Sequence[int], prompt: Sequence[int] = (), tools: Sequence[dict[str, Any]] | None = None
    ) -> ParsedResponse:
        tokens = [int(t) for t in tokens]
        raw = self.decode(tokens)
        try:
            if self.response_template is not None:
                message = self.tokenizer.parse_response(
                    tokens, prefix=list(prompt), tools=list(tools) if tools else None
                )
                return _from_message(message, raw)
            body = tokens[:-1] if tokens and tokens[-1] in self._stop else tokens
            return parse_hermes(self.decode(body), raw)
        except Exception as exc:  # noqa: BLE001 - a malformed turn is a parse result
            return ParsedResponse(parse_error=error_line(exc), raw=raw)

    def _measure_prefix(self) -> bool:
        history: list[Message] = [{"role": "user", "content": "hi"}]
        try:
            prompt = self.render_prompt(history)
            turn = self.response_tokens(prompt.tokens, history, {"role": "assistant", "content": "ok"})
            reply = prompt.parse(turn).to_message()
            after = self._template([*history, reply, {"role": "user", "content": "go on"}], None, True)
        except Exception:  # noqa: BLE001 - a template that cannot render the probe promises nothing
            return False
        return after[: len(prompt.tokens) + len(turn)] == [*prompt.tokens, *turn]


def error_line(exc: BaseException) -> str:
    """A parser's error in one line: its first line, plus the first ``Detail:`` / ``Error:``
    line when the message has one (tml-renderers and transformers put the cause there)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
    cause = next((line for line in lines[1:] if line.startswith(("Detail:", "Error:"))), None)
    return f"{lines[0]} ({cause})" if cause else lines[0]


def _from_message(message: Mapping[str, Any], raw: str) -> ParsedResponse:
    """A message dict from ``parse_response`` -> :class:`ParsedResponse`."""
    content = message.get("content")
    text = content.strip() if isinstance(content, str) else ""
    reasoning = message.get("reasoning_content") or message.get("thinking") or None
    calls = [ToolCall.from_openai(c) for c in message.get("tool_calls") or []]
    return ParsedResponse(text, calls, reasoning, raw=raw)


def _hf_message(m: Message) -> dict[str, Any]:
    """Tool-call arguments as dicts, as Hugging Face templates expect them."""
    if not m.get("tool_calls"):
        return dict(m)
    calls = []
    for call in m["tool_calls"]:
        c = ToolCall.from_openai(call)
        calls.append(
            {
                **({"id": c.id} if c.id else {}),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
        )
    return {**m, "tool_calls": calls}


def stop_ids(tokenizer: PreTrainedTokenizerBase, template: object) -> list[int]:
    """EOS id(s), the :data:`END_OF_TURN` markers the template uses, and the first special token
    the template writes after an assistant message's text (``template(messages, tools,
    generation)`` renders; see the module docstring)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    out = [int(e) for e in eos] if isinstance(eos, (list, tuple)) else ([int(eos)] if eos is not None else [])
    source = (
        tokenizer.chat_template
        if isinstance(tokenizer.chat_template, str)
        else " ".join(tokenizer.chat_template.values())
    )
    out += [i for i in (_single_token(tokenizer, m) for m in END_OF_TURN if m in source) if i is not None]
    end = _turn_end(tokenizer, template)
    if end is not None:
        out.append(end)
    out = list(dict.fromkeys(out))
    if not out:
        raise ConfigError(
            f"the model's tokenizer ({type(tokenizer).__name__}) has no EOS and its chat template no "
            "end-of-turn token: a turn could never end; set tokenizer.eos_token",
            "renderer",
        )
    return out


def _single_token(tokenizer: PreTrainedTokenizerBase, text: str) -> int | None:
    tid = tokenizer.convert_tokens_to_ids(text)
    if not isinstance(tid, int) or tid == getattr(tokenizer, "unk_token_id", None):
        return None
    return tid if tokenizer.convert_ids_to_tokens(tid) == text else None


def _turn_end(tokenizer: PreTrainedTokenizerBase, template: Any) -> int | None:
    history = [{"role": "user", "content": "hi"}]
    try:
        prompt = template(history, None, True)
        full = template([*history, {"role": "assistant", "content": "ok"}], None, False)
    except Exception:  # noqa: BLE001 - a template that needs more than this probe: EOS and markers only
        return None
    if full[: len(prompt)] != prompt:
        return None
    special = special_ids(tokenizer)
    return next((t for t in full[len(prompt) :] if t in special), None)


def special_ids(tokenizer: Tokenizer) -> set[int]:
    """The ids the tokenizer treats as special: its named special tokens and the added tokens
    marked special (a tokenizer built with extra special tokens lists them only there)."""
    special = {int(i) for i in getattr(tokenizer, "all_special_ids", ())}
    return special | {
        int(i)
        for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()
        if getattr(t, "special", False)
    }
