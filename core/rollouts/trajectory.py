"""Multi-turn trajectories: exactly the tokens a model saw and produced over an episode.

The one rule: a trajectory is built by *appending*. Before each model turn the renderer
renders the whole conversation; if that rendering starts with every token of the current
training row (the previous prompt plus what the model sampled), only the new tokens -- tool
results, observations, the next turn's header -- are appended, with weight 0. If it does not
(a renderer that rewrites history, e.g. drops earlier reasoning, or re-renders a malformed
tool call differently from how it was sampled), the row is closed and a new one starts from
the new prompt: several training rows, never a row with tokens the model did not see.

The same builder turns an SFT transcript into rows (:func:`training_rows`), so supervised and
RL data of one conversation are tokenized by the same code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tempering.rollouts.chat import Message, ParsedResponse
from tempering.types import Completion, Segment


class TrajectoryBuilder:
    """Accumulates training rows (:class:`~tempering.types.Segment`) turn by turn."""

    def __init__(self) -> None:
        self.segments: list[Segment] = []
        self.splits = 0  # times a new prompt did not extend the current row

    def observe(self, prompt: Sequence[int]) -> None:
        """The full prompt before the next model turn (weight 0 wherever it is new)."""
        prompt = list(prompt)
        current = self.segments[-1] if self.segments else None
        if (
            current is not None
            and len(prompt) >= len(current.tokens)
            and prompt[: len(current.tokens)] == current.tokens
        ):
            current.extend(prompt[len(current.tokens) :], 0.0)
            return
        if current is not None:
            self.splits += 1
        self.segments.append(Segment(prompt, [0.0] * len(prompt), [0.0] * len(prompt)))

    def act(self, tokens: Sequence[int], logprobs: Sequence[float] | None = None, weight: float = 1.0) -> None:
        """Tokens the model produced (weight 1, with their sampler logprobs)."""
        if not self.segments:
            raise RuntimeError("TrajectoryBuilder.act before observe: a turn needs a prompt")
        self.segments[-1].extend(list(tokens), weight, list(logprobs) if logprobs is not None else None)

    @property
    def num_tokens(self) -> int:
        """Tokens in the current row: what the model's context holds now."""
        return len(self.segments[-1].tokens) if self.segments else 0


@dataclass
class Turn:
    """One model turn: the prompt length it saw, what it sampled and how that parsed, and the
    messages the environment answered with."""

    prompt_len: int
    completion: Completion
    response: ParsedResponse
    observation: list[Message] = field(default_factory=list)
    reward: float | None = 0.0
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Trajectory:
    """An episode: the transcript, the tools offered, every turn and the training rows.

    ``stop`` says why it ended: ``done`` (the environment said so), ``max_turns``,
    ``context`` (the token budget), ``error`` (the environment raised) or ``parse_error``.
    ``metrics`` are counts summed over turns (tool calls, tool errors, ...);
    ``errors`` the first error texts seen. On ``error``: ``failure`` is the cause
    (``episode_error``, or ``env_timeout`` when an environment call did not return in time) and
    ``traceback`` the exception's formatted traceback (the environment's frames), kept for the
    rollout log. ``feedback``: what the episode said about the attempt in words, in order --
    each turn's failed tool calls and ``StepResult.feedback``, then running out of turns or
    context -- which the sampler joins into ``Sample.feedback``. ``calls``: every model call of
    the episode as a JSON-able record, where the sampler keeps them (the agent samplers: a
    harness's calls need not form one transcript), for the rollout log.
    """

    messages: list[Message] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    stop: str = "done"
    metrics: dict[str, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    failure: str | None = None
    traceback: str | None = None
    feedback: list[str] = field(default_factory=list)
    calls: list[dict[str, Any]] | None = None

    @property
    def num_generated(self) -> int:
        return sum(len(t.completion.tokens) for t in self.turns)

    def count(self, key: str, value: float = 1.0) -> None:
        self.metrics[key] = self.metrics.get(key, 0.0) + value


@dataclass
class TrainingRow:
    """A teacher-forced row from a transcript: ``weights`` (unshifted) are 1 on the assistant
    tokens to learn and 0 elsewhere."""

    tokens: list[int]
    weights: list[float]

    def segment(self) -> Segment:
        return Segment(list(self.tokens), list(self.weights), [0.0] * len(self.tokens))


def training_rows(
    render_prompt: Callable[[Sequence[Message]], Sequence[int]],
    render_response: Callable[[Message], Sequence[int]],
    messages: Sequence[Message],
) -> list[TrainingRow]:
    """Rows for supervised training on every assistant turn of ``messages``.

    ``render_prompt(history)`` is the generation prompt before a model turn and
    ``render_response(message)`` the tokens the model would emit for an assistant message (its
    stop token included): the rows are what a rollout of this transcript would have produced,
    so an SFT warmup and RL later train on identically tokenized text. An assistant message
    with ``"weight": 0`` (OpenAI's fine-tuning convention, :func:`trains`) is context only.
    """
    builder = TrajectoryBuilder()
    for i, message in enumerate(messages):
        if not trains(message):
            continue
        builder.observe(render_prompt(messages[:i]))
        builder.act(render_response(message))
    return [TrainingRow(s.tokens, s.weights) for s in builder.segments]


def trains(message: Message) -> bool:
    """Whether supervised training learns ``message``: an assistant message, unless it says
    ``"weight": 0`` -- a turn kept as context, e.g. an earlier turn of a conversation whose
    history was rewritten (one row per context, each training only its own turns), or the
    shared prefix of a preference pair."""
    return message.get("role") == "assistant" and float(message.get("weight", 1.0)) != 0.0


def as_context(messages: Sequence[Message]) -> list[Message]:
    """``messages`` as context only: each message :func:`trains` would learn marked
    ``"weight": 0`` (copies: the caller's messages are left as they are)."""
    return [{**m, "weight": 0} if trains(m) else dict(m) for m in messages]
